"""``idem run`` reading a real Kafka topic into a Delta sink, exactly once per business key.

A real single-node Kafka broker (KRaft), a real redis-server, the shared local Spark
session with Spark's Kafka connector, real Delta tables; the sink and the ledger are
written by each Delta engine in turn.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kafka_broker import Record
from kafka_helpers import (
    SCHEMA,
    KafkaCase,
    dead_letters,
    order_value,
    resent_orders,
    sink_counts,
    sink_rows,
    topic_values,
)

from idem.config import IdemConfig
from idem.redis_server import RedisServer, free_port
from idem.spark.run import Pipeline, RunReport, RunSpec

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def _run(
    case: KafkaCase,
    cfg: IdemConfig,
    *,
    checkpoint: str = "checkpoint",
    options: tuple[str, ...] = (),
) -> RunReport:
    """One ``idem run --available-now`` of the case's topic into ``tmp_path/sink``."""
    spec = RunSpec(
        source=case.source,
        key="order_id",
        sink_delta=str(case.tmp_path / "sink"),
        checkpoint=str(case.tmp_path / checkpoint),
        available_now=True,
        schema=SCHEMA,
        kafka_options=options,
    )
    pipeline = Pipeline(case.spark, cfg, spec)
    try:
        return pipeline.run()
    finally:
        pipeline.close()


def test_c1_a_producers_resends_land_in_the_sink_once_each(case: KafkaCase) -> None:
    keys = [f"ORDERID_{i}" for i in range(150)]
    records = resent_orders(keys, seed=1)
    case.produce(records)

    report = _run(case, case.config("c1"), options=("maxOffsetsPerTrigger=120",))

    sink = case.tmp_path / "sink"
    counts = sink_counts(sink)
    assert set(counts) == set(keys)  # nothing lost
    assert set(counts.values()) == {1}  # nothing twice
    t = report.totals
    assert t.batches >= 3  # resends fell into the same batch and into later ones
    assert (t.messages, t.applied, t.duplicates_total) == (len(records), 150, len(records) - 150)
    assert t.mismatched == 0  # a resend is the same payload: the record's position is not
    # Each row names the Kafka record it was written from.
    held = topic_values(case.spark, case.bootstrap, case.topic)
    rows = sink_rows(sink)
    for row in rows:
        assert held[row["msg_id"]] == order_value(row["order_id"])
        assert row["topic"] == case.topic
    assert "_idem_source_id" not in rows[0]


def test_a_consumer_replay_from_an_old_or_a_new_checkpoint_writes_no_key_twice(
    case: KafkaCase,
) -> None:
    cfg, tmp_path = case.config("replay"), case.tmp_path
    first = [f"ORDERID_{i}" for i in range(80)]
    second = [f"ORDERID_{i}" for i in range(60, 160)]  # 20 keys of the first run again
    case.produce(resent_orders(first, seed=2))
    _run(case, cfg)
    shutil.copytree(tmp_path / "checkpoint", tmp_path / "checkpoint-after-run-1")

    case.produce(resent_orders(second, seed=3))
    done = _run(case, cfg, options=("maxOffsetsPerTrigger=90",)).totals  # the group's counters
    assert sink_counts(tmp_path / "sink") == dict.fromkeys(set(first) | set(second), 1)

    # The consumer goes back: its checkpoint restored to what it was after run 1 ...
    shutil.rmtree(tmp_path / "checkpoint")
    shutil.copytree(tmp_path / "checkpoint-after-run-1", tmp_path / "checkpoint")
    again = _run(case, cfg, options=("maxOffsetsPerTrigger=70",)).totals
    assert again.messages > done.messages  # the records of run 2 were read again ...
    assert again.applied == done.applied  # ... and none applied again
    # ... or a new checkpoint reads the topic from its start.
    fresh = _run(case, cfg, checkpoint="checkpoint-new").totals
    assert fresh.messages - again.messages == len(
        topic_values(case.spark, case.bootstrap, case.topic)
    )
    assert fresh.applied == done.applied

    counts = sink_counts(tmp_path / "sink")
    assert set(counts) == set(first) | set(second)
    assert set(counts.values()) == {1}


def test_poison_records_are_dead_lettered_once_each_with_the_reason(case: KafkaCase) -> None:
    good = [f"ORDERID_{i}" for i in range(30)]
    poison = {
        "not json {": "malformed: value of Kafka record {id} is not valid JSON for the schema",
        "[1, 2]": "malformed: value of Kafka record {id} is not valid JSON for the schema",
        '{"order_id": "ORDERID_X", "amount": "lots"}': "malformed: value of Kafka record {id} "
        "is not valid JSON for the schema",
        "": "malformed: Kafka record {id} has an empty value",
        None: "malformed: Kafka record {id} has a null value",  # a tombstone
        '{"amount": 2.0}': "null: order_id: key is null",
        '{"order_id": null, "amount": 3.0}': "null: order_id: key is null",
    }
    records: list[Record] = [(k, order_value(k), i % 3) for i, k in enumerate(good)]
    records += [("poison", value, i % 3) for i, value in enumerate(poison)]
    case.produce(records)
    cfg = case.config("poison")

    report = _run(case, cfg)

    assert sink_counts(case.tmp_path / "sink") == dict.fromkeys(good, 1)
    letters = dead_letters(cfg)
    values = topic_values(case.spark, case.bootstrap, case.topic)
    # One dead letter per poison record, named by its record (topic-partition-offset) ...
    assert sorted(values[x.msg_id] or "<null>" for x in letters) == sorted(
        value or "<null>" for value in poison
    )
    for letter in letters:
        value = values[letter.msg_id]
        # ... with the reason, and the value as its body where it had one.
        assert poison[value].format(id=letter.msg_id) in (letter.last_error or "")
        assert letter.topic == case.topic
        if value and "malformed" in poison[value]:
            assert letter.body.decode() == value
    assert (report.totals.malformed, report.totals.invalid) == (5, 2)
    assert report.dead_letters == len(poison)


def test_an_unreachable_broker_is_a_clear_error_at_start(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    port = free_port()  # nobody listens there
    command = [
        sys.executable, "-m", "idem.cli", "run",
        "--source", f"kafka://127.0.0.1:{port}/orders", "--key", "order_id",
        "--group", "unreachable", "--redis-url", redis_server.url,
        "--data-dir", str(tmp_path / "data"), "--sink-delta", str(tmp_path / "sink"),
        "--schema", SCHEMA, "--available-now",
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"cannot reach the Kafka broker 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 60
    assert not (tmp_path / "sink").exists()
