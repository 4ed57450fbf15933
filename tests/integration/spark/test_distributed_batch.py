"""A micro-batch spread over many partitions: its rows stay on the executors.

Real local Spark, a real redis-server and real Delta tables, on both ledger
engines: copies of a key in different input partitions reach the sink once, the
sink's DataFrame is the same however often it reads it, and copies of a key that
disagree on the payload follow the mismatch policy.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import redis
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as st
from spark_helpers import config_for, dead_letters, sink_key_counts

from idem.config import MismatchPolicy
from idem.errors import PayloadMismatch
from idem.redis_server import RedisServer
from idem.spark.decorator import ExactlyOnce
from idem.spark.delta_sink import delta_sink

pytestmark = [pytest.mark.integration, pytest.mark.spark]

SCHEMA = st.StructType(
    [st.StructField("order_id", st.StringType()), st.StructField("amount", st.LongType())]
)


def _spread(spark: SparkSession, keys: int, copies: int, partitions: int) -> DataFrame:
    """``copies`` identical rows of each of ``keys`` keys, dealt round-robin over
    ``partitions`` input partitions (so the copies of a key sit in different ones)."""
    rows = [(f"ORDERID_{n}", n) for _ in range(copies) for n in range(keys)]
    return spark.createDataFrame(rows, SCHEMA).repartition(partitions)


def test_copies_of_a_key_in_different_partitions_reach_the_sink_once(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    ledger_engine: str,
) -> None:
    batch = _spread(spark, keys=300, copies=3, partitions=8)
    assert batch.rdd.getNumPartitions() == 8
    config = config_for(tmp_path, redis_server.url, "spread", engine=ledger_engine)
    given: Counter[str] = Counter()
    reads: list[int] = []

    def sink(fresh: DataFrame, batch_id: int) -> None:
        reads.append(fresh.count())  # read it twice: the same rows each time
        given.update(r["order_id"] for r in fresh.select("order_id").collect())

    function_sink = ExactlyOnce(sink, config=config, key="order_id", client=real_redis)
    function_sink.query_id = "q"
    outcome = function_sink.process(batch, 0)
    assert reads == [300]
    assert set(given.values()) == {1}
    assert len(given) == 300
    assert (outcome.messages, outcome.applied, outcome.retaken) == (900, 300, 0)
    assert outcome.duplicates == {"in_batch": 600}
    # The same batch again (another batch id): every key is a completed duplicate (and
    # its other copies in-batch ones, as before).
    again = function_sink.process(batch, 1)
    assert again.applied == 0
    assert again.duplicates == {"in_batch": 600, "completed": 300}
    assert len(given) == 300
    assert set(given.values()) == {1}

    table = tmp_path / "orders"
    table_config = config.with_changes(group="spread-table")
    written = delta_sink(str(table), key="order_id", config=table_config, client=real_redis)
    written.query_id = "q"
    assert written.process(batch, 0).applied == 300
    assert written.process(batch, 1).applied == 0
    counts = sink_key_counts(table)
    assert len(counts) == 300
    assert set(counts.values()) == {1}


def test_after_redis_loses_its_index_the_ledgers_window_is_reloaded_and_copies_stay_out(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    ledger_engine: str,
) -> None:
    # On delta-spark the window is loaded by the executors, bucket by bucket; on
    # delta-rs by the driver. Either way every committed key is a duplicate again.
    config = config_for(tmp_path, redis_server.url, "reload", engine=ledger_engine)
    table = tmp_path / "orders"
    sink = delta_sink(str(table), key="order_id", config=config, client=real_redis)
    sink.query_id = "q"
    assert sink.process(_spread(spark, keys=400, copies=1, partitions=4), 0).applied == 400
    sink.close()
    real_redis.flushall()  # an empty Redis: every bucket's watermark is gone

    again = delta_sink(str(table), key="order_id", config=config, client=real_redis)
    again.query_id = "q"
    outcome = again.process(_spread(spark, keys=500, copies=2, partitions=6), 1)
    assert outcome.applied == 100  # ORDERID_400 .. ORDERID_499
    assert outcome.duplicates == {"in_batch": 500, "completed": 400}
    stats = again.dedup.stats
    assert (stats.rebuilt_buckets, stats.rebuilt_keys) == (config.buckets, 400)
    counts = sink_key_counts(table)
    assert len(counts) == 500
    assert set(counts.values()) == {1}


@pytest.mark.parametrize("policy", [MismatchPolicy.WARN, MismatchPolicy.DEAD_LETTER])
def test_copies_of_a_key_that_disagree_follow_the_mismatch_policy(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    policy: MismatchPolicy,
) -> None:
    config = config_for(tmp_path, redis_server.url, "disagree", mismatch_policy=policy)
    rows = [("A", 1), ("B", 2), ("A", 99)]  # A's second copy has another payload
    batch = spark.createDataFrame(rows, SCHEMA).repartition(3)
    given: list[tuple[str, int]] = []

    def sink(fresh: DataFrame, batch_id: int) -> None:
        given.extend((r["order_id"], r["amount"]) for r in fresh.collect())

    decorated = ExactlyOnce(sink, config=config, key="order_id", client=real_redis)
    decorated.query_id = "q"
    outcome = decorated.process(batch, 0)
    assert sorted(k for k, _ in given) == ["A", "B"]
    assert outcome.mismatched == 1
    letters = dead_letters(config)
    if policy is MismatchPolicy.DEAD_LETTER:
        assert [d.key for d in letters] == ["A"]
        assert letters[0].reason.endswith(
            "payload_mismatch: another row of the batch has this key with another payload"
        )
        assert outcome.dead == 1
    else:
        assert letters == []
        assert outcome.dead == 0


def test_strict_mode_hands_the_sink_no_key_the_ledger_holds_though_redis_forgot_it(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    ledger_engine: str,
) -> None:
    """Strict mode trusts the ledger, not Redis: with the completed keys gone from Redis
    but its watermarks kept (an index silently incomplete), the next batch's copies of
    those keys are completed duplicates, a copy with another payload is mismatched, and
    only the new key reaches the sink."""
    config = config_for(
        tmp_path,
        redis_server.url,
        "strict",
        engine=ledger_engine,
        mode="strict",
        mismatch_policy=MismatchPolicy.DEAD_LETTER,
    )
    given: Counter[str] = Counter()

    def sink(fresh: DataFrame, batch_id: int) -> None:
        given.update(r["order_id"] for r in fresh.select("order_id").collect())

    decorated = ExactlyOnce(sink, config=config, key="order_id", client=real_redis)
    decorated.query_id = "q"
    first = spark.createDataFrame([("A", 1), ("B", 2)], SCHEMA).repartition(2)
    assert decorated.process(first, 0).applied == 2
    forgotten = list(real_redis.scan_iter("idem:*:c:*"))
    assert forgotten
    real_redis.delete(*forgotten)

    later = spark.createDataFrame([("A", 1), ("B", 99), ("C", 3)], SCHEMA).repartition(3)
    outcome = decorated.process(later, 1)
    assert given == Counter({"A": 1, "B": 1, "C": 1})
    assert outcome.applied == 1
    assert outcome.duplicates == {"completed": 2}  # a mismatched copy is a duplicate too
    assert outcome.mismatched == 1
    assert [d.key for d in dead_letters(config)] == ["B"]


def test_a_batch_abandoned_by_the_raise_policy_gives_its_claims_back(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Under ``mismatch_policy=raise`` a conflicting copy stops the batch before the sink,
    and the executors release the batch's claims: the next attempt (another owner, as a
    restarted query is) claims every key at once instead of waiting out the leases."""
    config = config_for(tmp_path, redis_server.url, "abandon", mismatch_policy=MismatchPolicy.RAISE)
    given: list[str] = []

    def sink(fresh: DataFrame, batch_id: int) -> None:
        given.extend(r["order_id"] for r in fresh.select("order_id").collect())

    rows = [(f"K{n}", n) for n in range(40)] + [("K0", 99)]  # K0's copy disagrees
    batch = spark.createDataFrame(rows, SCHEMA).repartition(4)
    first = ExactlyOnce(sink, config=config, key="order_id", client=real_redis)
    first.query_id = "first"
    with pytest.raises(PayloadMismatch, match="K0"):
        first.process(batch, 0)
    assert given == []

    fixed = spark.createDataFrame(rows[:40], SCHEMA).repartition(4)
    second = ExactlyOnce(sink, config=config, key="order_id", client=real_redis)
    second.query_id = "second"
    outcome = second.process(fixed, 0)
    assert outcome.busy == 0
    assert outcome.applied == 40
    assert sorted(given) == sorted(f"K{n}" for n in range(40))
