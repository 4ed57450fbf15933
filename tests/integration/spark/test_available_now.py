"""``idem run --available-now`` takes the files that are there when it starts and exits,
however fast new files land; the next run takes those.

Real local Spark, a real redis-server and real Delta tables; a producer thread drops a
file into the source directory every 0.2 s for as long as the first run lasts.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from spark_helpers import config_for, delta_run, order, sink_key_counts, write_files

from idem.redis_server import RedisServer
from idem.spark.run import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.spark]

PRODUCER_GIVES_UP_S = 12.0
"""The producer stops by itself after this long (a run that never exits ends the test)."""


class Producer:
    """Drops one order file into ``source`` every 0.2 s once started, until stopped."""

    def __init__(self, source: Path, spare: Path) -> None:
        self.source = source
        self.spare = spare
        self.keys: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, name="producer", daemon=True)

    def _produce(self) -> None:
        deadline = time.monotonic() + PRODUCER_GIVES_UP_S
        n = 100
        while not self.stop.is_set() and time.monotonic() < deadline:
            key = f"ORDERID_{n}"
            staged = self.spare / f"late-{n}.json"
            staged.write_text(json.dumps(order(key)) + "\n", encoding="utf-8")
            staged.replace(self.source / staged.name)  # lands whole, as a producer's move
            self.keys.append(key)
            n += 1
            self.stop.wait(0.2)

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def test_available_now_takes_the_files_there_at_the_start_and_leaves_later_ones_to_the_next_run(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    source = tmp_path / "in"
    write_files(source, [[order(1), order(2)]])
    spare = tmp_path / "staging"
    spare.mkdir()
    producer = Producer(source, spare)

    def start_producing(fresh: DataFrame, batch_id: int) -> None:
        # The first batch runs after Spark listed the source: every file from now on is late.
        if not producer.thread.is_alive() and not producer.stop.is_set():
            producer.thread.start()

    config = config_for(tmp_path, redis_server.url, "available-now")
    spec = delta_run(tmp_path, source)
    pipeline = Pipeline(spark, config, spec, sink_fn=start_producing, client=redis_server.client())
    try:
        first = pipeline.run()
        producer.close()
        assert producer.keys  # files did land while the first run went on
        assert sink_key_counts(tmp_path / "sink") == {"ORDERID_1": 1, "ORDERID_2": 1}
        assert first.totals.messages == 2

        second = pipeline.run()  # the files that landed meanwhile are there now
    finally:
        producer.close()
        pipeline.close()
    expected = {"ORDERID_1", "ORDERID_2", *producer.keys}
    assert sink_key_counts(tmp_path / "sink") == dict.fromkeys(expected, 1)
    assert second.totals.messages == len(expected)


def test_available_now_with_a_timeout_stops_waiting_for_retries_and_leaves_them_scheduled(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    """``--timeout`` was ignored with ``--available-now``: a run waited out the ladder (up
    to 2 h between retries on RocketMQ's) however short the time it was given."""
    write_files(tmp_path / "in", [[order(1), order(2)]])

    def fails_2_once(fresh: DataFrame, batch_id: int) -> dict[str, str]:
        rows = fresh.select("order_id", "reconsume_times").toArrow().to_pylist()
        return {
            r["order_id"]: "TimeoutError: downstream timed out"
            for r in rows
            if r["order_id"] == "ORDERID_2" and r["reconsume_times"] == 0
        }

    # the first retry (level 3) is due in 2 minutes; the timeout is time enough for the files
    config = config_for(tmp_path, redis_server.url, "timed-out", delay_levels="1s 1s 2m")
    spec = delta_run(tmp_path, timeout_seconds=20.0)
    pipeline = Pipeline(spark, config, spec, sink_fn=fails_2_once, client=redis_server.client())
    started = time.monotonic()
    try:
        report = pipeline.run()
    finally:
        pipeline.close()
    assert time.monotonic() - started < 60
    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_1": 1}
    assert report.pending_retries == 1  # scheduled, not dropped: the next run takes it
    assert report.dead_letters == 0


@pytest.mark.parametrize("left_s", [0.0, 0.0004, 0.0009])
def test_a_wait_ending_within_a_millisecond_of_its_deadline_returns_with_the_query_running(
    spark: SparkSession, left_s: float
) -> None:
    """Spark waits on a query in whole milliseconds and refuses 0: the last fraction of a
    millisecond before a run's deadline ends the wait instead of failing the run."""
    from idem.spark.run import _await

    query = spark.readStream.format("rate").load().writeStream.format("noop").start()
    try:
        _await(query, left_s)
        assert query.isActive
        assert query.exception() is None
    finally:
        query.stop()
