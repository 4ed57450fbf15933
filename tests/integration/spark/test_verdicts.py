"""The claim on the executors: every row of a batch gets its verdict where it lies.

Real local Spark (tasks in Python workers), a real redis-server and a real Delta
ledger; each test reads back the verdicts and what Redis holds.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from pyspark.sql import types as st
from spark_helpers import config_for

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.hotstore_types import KeyStatus
from idem.keys import bucket_of, group_by_bucket
from idem.redis_server import RedisServer
from idem.spark.claimed import claim_batch
from idem.spark.decorator import fingerprint_sql
from idem.spark.ids import spark_hex
from idem.spark.index_task import IndexTask, index_committed
from idem.spark.verdicts import (
    BUCKET_COLUMN,
    CLAIMED,
    DETAIL_COLUMN,
    HASH_COLUMN,
    KEY_COLUMN,
    VERDICT_COLUMN,
    ClaimTask,
    Verdict,
    verdict_frame,
)

pytestmark = [pytest.mark.integration, pytest.mark.spark]

SCHEMA = st.StructType(
    [st.StructField("order_id", st.StringType()), st.StructField("amount", st.LongType())]
)


def _prepared(spark: SparkSession, rows: list[tuple[Any, ...]], partitions: int) -> DataFrame:
    frame = spark.createDataFrame(rows, SCHEMA).repartition(partitions)
    return frame.withColumn(HASH_COLUMN, F.expr(fingerprint_sql(SCHEMA)))


def _claim(
    config: IdemConfig, prepared: DataFrame, owner: str, **task: Any
) -> list[dict[str, Any]]:
    dedup = Dedup(config)
    version = dedup.catch_up()
    dedup.close()
    settings: dict[str, Any] = {
        "now_ms": dedup.clock.now_ms(),
        "min_version": version,
        "hold": True,
        "key": "order_id",
        **task,
    }
    frame = verdict_frame(prepared, ClaimTask(config, owner, **settings))
    picked = frame.select("order_id", "amount", BUCKET_COLUMN, KEY_COLUMN, VERDICT_COLUMN,
                          DETAIL_COLUMN)  # fmt: skip
    return [row.asDict() for row in picked.collect()]


def _by_key(rows: list[dict[str, Any]]) -> dict[str, Counter[Verdict]]:
    found: defaultdict[str, Counter[Verdict]] = defaultdict(Counter)
    for row in rows:
        found[row["order_id"]][Verdict(row[VERDICT_COLUMN])] += 1
    return dict(found)


@pytest.mark.parametrize("records_per_batch", [None, 7], ids=["arrow-default", "arrow-7-rows"])
def test_copies_of_a_key_spread_over_input_partitions_are_claimed_once(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path, records_per_batch: int | None
) -> None:
    """With 7-row Arrow batches a task gets its rows a few at a time, and the copies of
    most keys arrive in different batches of the task: still one of them is claimed."""
    config = config_for(tmp_path, redis_server.url, f"spread-{records_per_batch}", buckets=8)
    keys = [f"ORDERID_{n}" for n in range(200)]
    rows = [(key, 7) for _ in range(4) for key in keys]  # 4 copies, 8 partitions
    name = "spark.sql.execution.arrow.maxRecordsPerBatch"
    before = spark.conf.get(name)
    if records_per_batch is not None:
        spark.conf.set(name, str(records_per_batch))
    try:
        verdicts = _claim(config, _prepared(spark, rows, 8), "q1:0")
    finally:
        spark.conf.set(name, before)

    assert len(verdicts) == len(rows)
    assert _by_key(verdicts) == {k: Counter({Verdict.FRESH: 1, Verdict.IN_BATCH: 3}) for k in keys}
    # Every row carries its key's bucket, as the rest of idem computes it.
    assert all(r[BUCKET_COLUMN] == bucket_of(r["order_id"], 8) for r in verdicts)
    states = Dedup(config).hot.lookup(group_by_bucket(keys, 8))
    assert {s.status for s in states.values()} == {KeyStatus.IN_PROGRESS}
    assert {s.owner for s in states.values()} == {"q1:0"}


def test_a_rerun_of_the_owner_retakes_its_claims_and_another_owner_finds_them_busy(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "rerun")
    rows = [(f"K{n}", n) for n in range(50)]
    prepared = _prepared(spark, rows, 3)
    first = _claim(config, prepared, "q1:7")
    again = _claim(config, prepared, "q1:7")  # a retried task or a replayed batch
    other = _claim(config, prepared, "q2:1")

    assert Counter(Verdict(r[VERDICT_COLUMN]) for r in first) == {Verdict.FRESH: 50}
    assert Counter(Verdict(r[VERDICT_COLUMN]) for r in again) == {Verdict.RETAKEN: 50}
    assert Counter(Verdict(r[VERDICT_COLUMN]) for r in other) == {Verdict.BUSY: 50}


def test_completed_keys_and_their_payloads_and_bad_keys(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "done", max_key_bytes=16)
    done = [(f"D{n}", n) for n in range(6)]
    # The keys D0..D5 completed earlier (ledger and Redis), with the payload of `done`.
    dedup = Dedup(config)
    hashes = _prepared(spark, done, 1).orderBy("order_id").select(HASH_COLUMN).toArrow()
    prints = spark_hex(hashes.column(HASH_COLUMN)).to_pylist()
    claim = dedup.begin([k for k, _ in sorted(done)], owner="earlier:0", fingerprints=prints)
    dedup.complete(claim, batch_id=0)
    dedup.close()

    rows: list[tuple[Any, ...]] = [
        *done[:3],  # the same payload again
        *((key, amount + 100) for key, amount in done[3:]),  # another payload
        ("NEW", 1001),
        (None, 1002),
        ("", 1003),
        ("   ", 1004),
        ("X" * 17, 1005),
        ("ключ", 1006),  # 8 bytes of UTF-8: within the limit
    ]
    verdicts = {r["amount"]: r for r in _claim(config, _prepared(spark, rows, 4), "q1:1")}

    def verdict(amount: int) -> Verdict:
        return Verdict(verdicts[amount][VERDICT_COLUMN])

    assert [verdict(n) for n in range(3)] == [Verdict.COMPLETED] * 3
    assert [verdict(n) for n in range(103, 106)] == [Verdict.MISMATCHED] * 3
    assert verdict(1001) == Verdict.FRESH
    assert verdicts[1006][KEY_COLUMN] == "ключ"
    assert verdict(1006) == Verdict.FRESH
    bad = (1002, 1003, 1004, 1005)
    assert [verdict(n) for n in bad] == [Verdict.INVALID] * 4
    reasons = [str(verdicts[n][DETAIL_COLUMN]).split(":")[0] for n in bad]
    assert reasons == ["null", "empty", "empty", "too_long"]
    assert "the limit is 16 bytes" in verdicts[1005][DETAIL_COLUMN]
    assert all(verdicts[n][KEY_COLUMN] is None for n in bad)


def test_a_bucket_whose_index_is_behind_is_not_examined(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "stale", buckets=4)
    keys = [f"S{n}" for n in range(40)]
    dedup = Dedup(config)
    version = dedup.catch_up()
    dedup.hot.drop_watermark(bucket_of(keys[0], 4))
    task = ClaimTask(config, "q1:2", dedup.clock.now_ms(), version, True, "order_id")
    frame = verdict_frame(_prepared(spark, [(k, 1) for k in keys], 2), task)
    verdicts = {r["order_id"]: Verdict(r[VERDICT_COLUMN]) for r in frame.collect()}

    behind = {k for k in keys if bucket_of(k, 4) == bucket_of(keys[0], 4)}
    assert {k for k, v in verdicts.items() if v is Verdict.STALE} == behind
    assert {k for k, v in verdicts.items() if v is Verdict.FRESH} == set(keys) - behind


def test_the_executors_index_a_committed_version_bucket_by_bucket(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "index", buckets=16)
    keys = [f"I{n}" for n in range(12)]  # 12 keys: some of the 16 buckets get none
    dedup = Dedup(config)
    version = dedup.catch_up()
    now = dedup.clock.now_ms()
    task = ClaimTask(config, "q1:3", now, version, True, "order_id")
    verdicts = verdict_frame(_prepared(spark, [(k, 1) for k in [*keys, *keys]], 3), task)
    claimed = verdicts.where(F.col(VERDICT_COLUMN).isin([int(v) for v in CLAIMED])).cache()

    indexed = index_committed(claimed, IndexTask(config, "q1:3", version + 1, now, now), dedup.hot)

    assert indexed.completed == len(keys)
    assert indexed.fenced == ()
    assert indexed.lagging == frozenset()
    assert set(dedup.hot.watermarks().values()) == {version + 1}  # every bucket, touched or not
    states = dedup.hot.lookup(group_by_bucket(keys, 16))
    assert {s.status for s in states.values()} == {KeyStatus.COMPLETED}
    claimed.unpersist()
    again = ClaimTask(config, "q2:0", now, version + 1, True, "order_id")
    rows = verdict_frame(_prepared(spark, [(k, 1) for k in keys], 2), again).collect()
    assert {Verdict(r[VERDICT_COLUMN]) for r in rows} == {Verdict.COMPLETED}


def test_a_copy_with_another_payload_is_not_a_silent_in_batch_duplicate(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A retried row and a fresh copy of its key with another payload in one batch: the
    copy is told apart (the mismatch policy decides), never dropped as a duplicate."""
    config = config_for(tmp_path, redis_server.url, "conflict")
    rows = [("A", 1), ("A", 1), ("A", 2), ("B", 5)]
    verdicts = _claim(config, _prepared(spark, rows, 2), "q1:4")

    by_amount = Counter((r["amount"], Verdict(r[VERDICT_COLUMN])) for r in verdicts)
    claimed_a = by_amount[1, Verdict.FRESH]
    assert claimed_a + by_amount[2, Verdict.FRESH] == 1  # one row of A claimed
    if claimed_a:  # the first row in precedence order was one with amount 1
        assert by_amount == Counter(
            {(1, Verdict.FRESH): 1, (1, Verdict.IN_BATCH): 1, (2, Verdict.CONFLICTING): 1,
             (5, Verdict.FRESH): 1}
        )  # fmt: skip
    else:
        assert by_amount == Counter(
            {(2, Verdict.FRESH): 1, (1, Verdict.CONFLICTING): 2, (5, Verdict.FRESH): 1}
        )


def test_a_bucket_that_lost_its_index_while_claiming_is_caught_up_from_the_ledger(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The driver's claim: a bucket whose Redis index vanished after the driver's
    catch-up is found stale by the executors, caught up from the ledger and claimed
    again; a key the ledger holds comes out completed."""
    config = config_for(tmp_path, redis_server.url, "lost", buckets=4)
    dedup = Dedup(config)
    earlier = dedup.begin(["A"], owner="earlier:0")
    dedup.complete(earlier, batch_id=0)  # A is in the ledger (version 0) and in Redis
    first = claim_batch(_prepared(spark, [("A", 1), ("B", 1)], 2), dedup,
                        owner="q:1", key="order_id", hold=True)  # fmt: skip
    assert _verdict_of(first.frame) == {"A": Verdict.COMPLETED, "B": Verdict.FRESH}
    assert first.rounds == 1
    first.release()

    lost = bucket_of("A", 4)  # Redis loses that bucket: its watermark and completed keys
    client = redis_server.client()
    for name in client.scan_iter(match=f"idem:{{lost:{lost}}}*"):
        client.delete(name)
    again = claim_batch(_prepared(spark, [("A", 1), ("C", 1)], 2), dedup,
                        owner="q:2", key="order_id", hold=True)  # fmt: skip

    assert _verdict_of(again.frame) == {"A": Verdict.COMPLETED, "C": Verdict.FRESH}
    assert again.rounds == 2
    assert again.counts == {Verdict.COMPLETED: 1, Verdict.FRESH: 1}
    assert again.claimed == 1
    again.release()


def _verdict_of(frame: DataFrame) -> dict[str, Verdict]:
    return {r["order_id"]: Verdict(r[VERDICT_COLUMN]) for r in frame.collect()}
