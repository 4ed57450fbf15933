"""``idem dlq replay``: a fixed poison row is applied once; replaying it again applies nothing."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
import redis
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import DataFrame, SparkSession
from spark_helpers import (
    config_for,
    dead_letters,
    delta_run,
    engines_of,
    order,
    sink_key_counts,
    write_files,
)

from idem.cli import main
from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry.dlq import DLQ_SCHEMA, DeadLetter, DeadLetterStatus, DeadLetterTable
from idem.spark.decorator import exactly_once
from idem.spark.run import Pipeline, RunReport

pytestmark = [pytest.mark.integration, pytest.mark.spark]

POISON = "ORDERID_2"


class PricingSink:
    """Rejects the poison order until the bug is fixed; counts what it was given."""

    def __init__(self) -> None:
        self.fixed = False
        self.seen: Counter[str] = Counter()

    def __call__(self, fresh: DataFrame, batch_id: int) -> dict[str, str]:
        keys = [r["order_id"] for r in fresh.select("order_id").toArrow().to_pylist()]
        self.seen.update(keys)
        if self.fixed or POISON not in keys:
            return {}
        return {POISON: "KeyError: no price for product 'P-17'"}


def _cli(config: IdemConfig, *args: str) -> int:
    return main(
        [
            "dlq",
            *args,
            "--group",
            config.group,
            "--redis-url",
            config.redis_url,
            "--data-dir",
            config.data_dir,
            "--delay-levels",
            "1s 1s 1s",
        ]
    )


def test_replaying_a_fixed_poison_row_applies_it_once_and_again_applies_nothing(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    *,
    capsys: pytest.CaptureFixture[str],
    ledger_engine: str,
) -> None:
    write_files(tmp_path / "in", [[order(1), order(2), order(3)]])
    config = config_for(
        tmp_path, redis_server.url, "replay", max_reconsume_times=1, engine=ledger_engine
    )
    sink = PricingSink()
    spec = delta_run(tmp_path)

    def run() -> RunReport:
        return Pipeline(spark, config, spec, sink_fn=sink, client=real_redis).run()

    run()
    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_1": 1, "ORDERID_3": 1}
    [letter] = dead_letters(config)
    assert letter.key == POISON
    assert letter.status is DeadLetterStatus.DEAD

    assert _cli(config, "ls") == 0
    assert POISON in capsys.readouterr().out
    assert _cli(config, "show", "--key", POISON) == 0
    shown = capsys.readouterr().out
    assert "no price for product" in shown
    assert '"amount"' in shown

    sink.fixed = True  # the bug in the sink is fixed; replay the dead letter
    before_ms = int(time.time() * 1000)
    assert _cli(config, "replay", "--key", POISON, "--by", "alice@ops") == 0
    assert "replayed 1 dead letter" in capsys.readouterr().out
    report = run()
    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_1": 1, "ORDERID_2": 1, "ORDERID_3": 1}
    [letter] = dead_letters(config)
    assert letter.status is DeadLetterStatus.REPLAYED
    assert letter.replayed_at_ms is not None
    assert letter.replayed_at_ms >= before_ms
    assert letter.replayed_by == "alice@ops"
    assert _cli(config, "show", "--key", POISON) == 0
    assert '"replayed_by": "alice@ops"' in capsys.readouterr().out
    assert report.dead_letters == 0
    seen_before = sink.seen[POISON]

    # Replaying again: a REPLAYED row is left alone unless asked; when forced, the
    # dedup layer recognises the completed key and the sink is not called for it.
    assert _cli(config, "replay", "--key", POISON) == 0
    assert "nothing to replay" in capsys.readouterr().out
    assert _cli(config, "replay", "--key", POISON, "--include-replayed") == 0
    report = run()
    assert sink.seen[POISON] == seen_before
    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_1": 1, "ORDERID_2": 1, "ORDERID_3": 1}
    assert report.totals.duplicates.get("completed", 0) >= 1
    assert report.pending_retries == 0
    assert engines_of(tmp_path / "sink") == {ledger_engine}


def _letter(i: int) -> DeadLetter:
    return DeadLetter(
        group="old",
        topic="orders",
        key=f"ORDERID_{i}",
        msg_id=f"M{i}",
        origin_msg_id=f"O{i}",
        body=b"{}",
        properties={},
        reconsume_times=16,
        first_failed_at_ms=1_700_000_000_000,
        dead_at_ms=1_700_000_060_000,
        last_error="ValueError: bad",
    )


def _table_written_before_replayed_by(path: str, n: int) -> DeadLetterTable:
    old_schema = pa.schema([f for f in DLQ_SCHEMA if f.name != "replayed_by"])
    rows = [_letter(i).to_row() for i in range(n)]
    for row in rows:
        del row["replayed_by"]
    write_deltalake(path, pa.Table.from_pylist(rows, schema=old_schema), partition_by=["dead_date"])
    return DeadLetterTable(path, "old")


def test_a_dlq_table_from_before_replayed_by_stays_readable_and_records_who(
    tmp_path: Path,
) -> None:
    """A table written by an older idem has no ``replayed_by``: it reads as before, and
    the first status change adds the column and records who did it, and when."""
    path = str(tmp_path / "dlq")
    table = _table_written_before_replayed_by(path, 3)
    assert [d.replayed_by for d in table.list()] == [None, None, None]

    assert table.mark_replayed([("O0", "M0")], by="alice@ops") == 1
    assert table.mark_discarded([("O1", "M1")], by="bob@ops", at_ms=1_700_000_120_000) == 1

    by_id = {d.msg_id: d for d in table.list()}
    assert (by_id["M0"].status, by_id["M0"].replayed_by) == (DeadLetterStatus.REPLAYED, "alice@ops")
    assert by_id["M0"].replayed_at_ms is not None
    assert (by_id["M1"].status, by_id["M1"].replayed_by, by_id["M1"].replayed_at_ms) == (
        DeadLetterStatus.DISCARDED,
        "bob@ops",
        1_700_000_120_000,
    )
    assert (by_id["M2"].status, by_id["M2"].replayed_by) == (DeadLetterStatus.DEAD, None)
    assert DeltaTable(path).schema().to_arrow().names[-1] == "replayed_by"


def test_new_dead_letters_go_into_a_dlq_table_from_before_replayed_by(tmp_path: Path) -> None:
    path = str(tmp_path / "dlq")
    table = _table_written_before_replayed_by(path, 1)
    assert table.write([_letter(0), _letter(1)]) == 1  # M0 was there already
    assert sorted(d.msg_id for d in table.list(status=DeadLetterStatus.DEAD)) == ["M0", "M1"]


def test_dlq_show_and_ls_json_print_a_row_with_structs_and_maps_not_keyed_by_text(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A map keyed by binary or dates failed ``json.dumps`` (a TypeError traceback), and a
    struct showed as a bare array without its field names."""
    config = config_for(tmp_path, redis_server.url, "odd-rows", max_reconsume_times=0)
    sink = exactly_once(key="id", config=config, client=real_redis)(lambda df, b: ["A"])
    sink.query_id = "q"
    df = spark.sql(
        "SELECT 'A' AS id, map(CAST('k' AS BINARY), 1) AS m, map(DATE'2024-01-02', 'x') AS d, "
        "named_struct('p', 1, 'q', 'z') AS s"
    )
    assert sink.process(df, 0).dead == 1
    assert _cli(config, "show", "--key", "A") == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["row"] == {
        "id": "A",
        "m": {"k": 1},
        "d": {"2024-01-02": "x"},
        "s": {"p": 1, "q": "z"},
    }
    assert _cli(config, "ls", "--json") == 0
    [listed] = json.loads(capsys.readouterr().out)
    assert listed["row"] == shown["row"]
