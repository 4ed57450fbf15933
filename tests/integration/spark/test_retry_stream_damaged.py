"""An entry of ``%RETRY%<group>`` that is not an idem message, read by the Spark retry stream.

The stream leaves it out of the rows instead of failing the query (which every restart
would plan and fail again), and when Spark commits the batch it is dead-lettered with its
reason and raw bytes and removed from the topic; the pipeline's own rows and retries go
on as usual.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from spark_helpers import config_for, dead_letters, delta_run, order, sink_key_counts, write_files

from idem.redis_server import RedisServer
from idem.retry.store import RetryKeys
from idem.spark.run import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.spark]

NOT_JSON = b"\xff{not json"
NO_TOPIC = json.dumps({"v": 1, "msg_id": "FOREIGN", "body": ""}).encode()


class FailsOnce:
    """Fails ``ORDERID_2`` on its first delivery, so a real retry follows the damaged entries."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()

    def __call__(self, fresh: DataFrame, batch_id: int) -> dict[str, str]:
        failed: dict[str, str] = {}
        for row in fresh.select("order_id", "reconsume_times").toArrow().to_pylist():
            key = row["order_id"]
            self.attempts[key] += 1
            if key == "ORDERID_2" and row["reconsume_times"] == 0:
                failed[key] = "TimeoutError: downstream timed out"
        return failed


def test_damaged_retry_entries_end_in_the_dlq_and_the_query_goes_on(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    client = redis_server.client()
    client.flushall()
    config = config_for(tmp_path, redis_server.url, "damaged-retry")
    stream = RetryKeys(config.group).stream
    bad_json = client.xadd(stream, {"m": NOT_JSON, "o": b"0"}).decode()
    no_m = client.xadd(stream, {"junk": b"\xff\x00"}).decode()
    no_topic = client.xadd(stream, {"m": NO_TOPIC, "o": b"1"}).decode()
    write_files(tmp_path / "in", [[order(1), order(2), order(3)]])
    sink = FailsOnce()

    report = Pipeline(spark, config, delta_run(tmp_path), sink_fn=sink, client=client).run()

    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_1": 1, "ORDERID_2": 1, "ORDERID_3": 1}
    assert sink.attempts["ORDERID_2"] == 2  # failed once, retried once through the stream
    assert report.pending_retries == 0
    name = f"%RETRY%{config.group}"
    letters = {d.msg_id: d for d in dead_letters(config)}
    assert sorted(letters) == sorted(
        f"UNDECODABLE-{name}-{entry}" for entry in (bad_json, no_m, no_topic)
    )
    for entry, body, why in (
        (bad_json, NOT_JSON, "not JSON"),
        (no_topic, NO_TOPIC, "field 'topic' is missing"),
        (no_m, None, "has no field 'm'"),
    ):
        letter = letters[f"UNDECODABLE-{name}-{entry}"]
        assert letter.topic == name
        assert f"{name} entry {entry} is not a message" in letter.reason
        assert why in letter.reason
        if body is not None:
            assert letter.body == body
    assert json.loads(letters[f"UNDECODABLE-{name}-{no_m}"].body) == {"junk": "\\xff\x00"}
    assert client.xlen(stream) == 0
