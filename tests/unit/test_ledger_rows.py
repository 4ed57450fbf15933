"""Ledger rows and commit bookkeeping that need no table: schema fitting, log parsing, retries."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake.exceptions import CommitFailedError

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.errors import ConfigError, LedgerConflict, LedgerError
from idem.ledger import LEDGER_SCHEMA, DeltaLedger, conform, make_rows, open_ledger
from idem.ledger._log import parse_commit
from idem.ledger.schema import date_of_ms, first_per_key

pytestmark = pytest.mark.unit

NOON = 1_700_049_600_000  # 2023-11-15 12:00:00 UTC


def test_conform_fills_defaults_and_derives_the_date_partition() -> None:
    rows = pa.table({"group": ["g"], "bucket": [3], "key": ["ORDER_1"], "queue_id": [7]})
    table = conform(rows, now_ms=NOON)
    assert table.schema.equals(LEDGER_SCHEMA)
    row = table.to_pylist()[0]
    assert row["fingerprint"] == ""
    assert row["completed_at"] == dt.datetime(2023, 11, 15, 12, tzinfo=dt.UTC)
    assert row["completed_date"] == dt.date(2023, 11, 15)
    assert row["queue_id"] == 7
    assert row["msg_id"] is None


def test_conform_keeps_a_given_completion_time_and_integer_millis_work() -> None:
    late = NOON + 13 * 3_600_000  # next day 01:00
    rows = pa.table({"group": ["g"], "bucket": [0], "key": ["K"], "completed_at": [late]})
    row = conform(rows, now_ms=NOON).to_pylist()[0]
    assert row["completed_date"] == dt.date(2023, 11, 16) == date_of_ms(late)


def test_conform_keeps_columns_the_ledger_does_not_know_after_its_own() -> None:
    rows = pa.table({"amount": [9.5], "group": ["g"], "bucket": [0], "key": ["K"]})
    table = conform(rows, now_ms=NOON)
    assert table.column_names == [*LEDGER_SCHEMA.names, "amount"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (pa.table({"group": ["g"], "bucket": [0]}), "missing required column(s) key"),
        (pa.table({"group": ["g"], "bucket": [0], "key": [None]}), "'key' holds 1 null"),
        (
            pa.table({"group": ["g"], "bucket": ["zero"], "key": ["K"]}),
            "column 'bucket' of type string cannot become int32",
        ),
    ],
)
def test_bad_rows_are_refused_naming_the_column(rows: pa.Table, message: str) -> None:
    with pytest.raises(LedgerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        conform(rows, now_ms=NOON)


def test_make_rows_refuses_misaligned_values() -> None:
    with pytest.raises(LedgerError, match="buckets: 1 values for 2 keys"):
        make_rows(group="g", keys=["A", "B"], buckets=[0])
    with pytest.raises(LedgerError, match="'nope' is not a ledger column"):
        make_rows(group="g", keys=["A"], buckets=[0], columns={"nope": [1]})


def test_repeated_keys_in_one_batch_keep_the_first_row() -> None:
    rows = make_rows(
        group="g",
        keys=["A", "B", "A", "C", "B"],
        buckets=[1, 2, 1, 3, 2],
        fingerprints=["a1", "b1", "a2", "c1", "b2"],
    )
    kept, repeated = first_per_key(conform(rows, now_ms=NOON))
    assert kept.column("key").to_pylist() == ["A", "B", "C"]
    assert kept.column("fingerprint").to_pylist() == ["a1", "b1", "c1"]
    assert repeated == ["A", "B"]


def test_commit_log_parsing_keeps_adds_removes_and_the_operation() -> None:
    lines = [
        {"commitInfo": {"operation": "MERGE"}},
        {"txn": {"appId": "a", "version": 3}},
        {
            "add": {
                "path": "bucket=1/x.parquet",
                "partitionValues": {"bucket": "1"},
                "dataChange": True,
            }
        },
        {"remove": {"path": "bucket=2/y.parquet", "dataChange": True}},
    ]
    entry = parse_commit(5, "\n".join(json.dumps(line) for line in lines).encode())
    assert entry.operation == "MERGE"
    assert [(a.path, a.partition_values["bucket"]) for a in entry.added] == [
        ("bucket=1/x.parquet", "1")
    ]
    assert entry.removed == ["bucket=2/y.parquet"]


def test_conflicts_are_retried_with_backoff_then_raise_ledger_conflict(tmp_path: Path) -> None:
    clock = ManualClock(NOON)
    ledger = DeltaLedger(str(tmp_path / "l"), clock=clock, max_attempts=4, backoff_s=0.5)
    calls = 0

    def always_conflicts() -> int:
        nonlocal calls
        calls += 1
        raise CommitFailedError("a concurrent transaction added new data")

    with pytest.raises(LedgerConflict, match="after 4 attempts"):
        ledger._retrying(always_conflicts, what="commit")
    assert calls == 4
    assert clock.now_ms() > NOON  # it waited (on the injected clock) between attempts


def test_open_ledger_picks_delta_rs_and_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    config = IdemConfig(group="orders", data_dir=str(tmp_path))
    assert isinstance(open_ledger(config, "delta-rs"), DeltaLedger)
    with pytest.raises(ConfigError, match=r"^engine: 'duckdb' is not one of auto, delta-rs"):
        open_ledger(config, engine="duckdb")
    # In a process with no Spark session (this one may hold the tests' Delta session):
    # auto is delta-rs, and an explicit delta-spark says what is missing.
    script = f"""
from idem.config import IdemConfig, LedgerEngine
from idem.errors import ConfigError
from idem.ledger import DeltaLedger, open_ledger
config = IdemConfig(group="orders", data_dir={str(tmp_path)!r})
ledger = open_ledger(config)
assert isinstance(ledger, DeltaLedger), ledger
print(ledger.path)
try:
    open_ledger(config.with_changes(engine=LedgerEngine.DELTA_SPARK))
except ConfigError as exc:
    print(exc)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    path, refusal = done.stdout.splitlines()
    assert path == str(Path(config.resolved_ledger_path).absolute())
    assert refusal.startswith("engine: delta-spark needs an active Spark session with Delta")
    assert "pip install 'idem[spark-delta]'" in refusal
    assert "deploy/jars/fetch.sh" in refusal
    assert "io.delta.sql.DeltaSparkSessionExtension" in refusal
