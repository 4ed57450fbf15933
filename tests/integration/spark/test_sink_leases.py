"""A function sink slower than its lease keeps its keys, on real Spark and redis-server.

The executors claim the batch's keys; the driver renews their leases while the
batch runs, without gathering them (the claims record each key under the batch's
owner in Redis). Another owner meanwhile finds every key busy; once the batch is
done the keys are completed, each written once. A driver that stops (here: a
simulated crash after the sink) stops renewing, and its keys come free a lease
later.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import redis
from pyspark.sql import DataFrame, SparkSession
from spark_helpers import config_for

from idem.dedup import Dedup
from idem.redis_server import RedisServer
from idem.spark.decorator import exactly_once
from idem.spark.faults import CrashPlan, CrashPoint, SimulatedCrash
from idem.spark.outcome import BatchOutcome

pytestmark = [pytest.mark.integration, pytest.mark.spark]

LEASE_MS = 2_000
KEYS = [f"ORDERID_{i}" for i in range(40)]


class SlowSink:
    """A function sink that records its keys and then takes ``seconds`` to write them."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.keys: list[str] = []
        self.started = threading.Event()

    def __call__(self, fresh: DataFrame, batch_id: int) -> None:
        self.keys += [row["order_id"] for row in fresh.toArrow().to_pylist()]
        self.started.set()
        time.sleep(self.seconds)


def _batch(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame([(k, i) for i, k in enumerate(KEYS)], "order_id string, n int")


def _tracked(client: redis.Redis, group: str) -> list[object]:
    return list(client.scan_iter(f"idem:{{{group}:*}}:o:*"))


def test_a_sink_three_leases_long_keeps_its_keys_until_it_is_done(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "slowsink", lease_ms=LEASE_MS)
    sink = SlowSink(3 * LEASE_MS / 1000)
    query = exactly_once(key="order_id", config=config, client=real_redis)(sink)
    query.query_id = "q1"
    outcome: list[BatchOutcome] = []
    running = threading.Thread(target=lambda: outcome.append(query.process(_batch(spark), 0)))
    running.start()
    other = Dedup(config, client=redis_server.client())
    try:
        assert sink.started.wait(120)
        seen: list[int] = []
        for _ in range(2):  # two leases into the sink: still held, renewed by the driver
            time.sleep(LEASE_MS / 1000)
            taken = other.begin(KEYS, owner="q2:0")
            other.release(taken)  # (a claim the renewal failed to stop must not linger)
            seen.append(len(taken.busy))
            assert taken.fresh == ()
        assert seen == [len(KEYS)] * 2
        running.join(120)
        assert not running.is_alive()
        assert outcome[0].applied == len(KEYS)
        assert sorted(sink.keys) == sorted(KEYS)  # each key written once
        again = other.begin(KEYS, owner="q2:1")
        assert again.counts.duplicates == len(KEYS)  # completed, as before
        assert _tracked(real_redis, "slowsink") == []  # the record of the keys is gone
    finally:
        running.join(120)
        other.close()


def test_a_driver_that_stops_stops_renewing_and_its_keys_come_free_a_lease_later(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "deadsink", lease_ms=LEASE_MS)
    sink = SlowSink(2 * LEASE_MS / 1000)
    query = exactly_once(key="order_id", config=config, client=real_redis)(sink)
    query.query_id = "q1"
    query.crash_plan = CrashPlan(CrashPoint.AFTER_SINK, 0)
    with pytest.raises(SimulatedCrash):
        query.process(_batch(spark), 0)
    other = Dedup(config, client=redis_server.client())
    try:
        held = other.begin(KEYS, owner="q2:0")  # renewed until the crash: still live
        assert len(held.busy) == len(KEYS)
        time.sleep(LEASE_MS / 1000 + 0.5)
        taken = other.begin(KEYS, owner="q2:0")
        assert len(taken.fresh) == len(KEYS)
        assert len(taken.reclaimed) == len(KEYS)
        assert sorted(sink.keys) == sorted(KEYS)
    finally:
        other.close()
