"""The driver's side of a micro-batch's claim: catch up, claim on the executors, count.

:func:`claim_batch` brings the Redis index up to the ledger, has the executors
claim the batch (:mod:`idem.spark.verdicts`), keeps the verdicts (persisted, so
the sink reads the same fresh rows however often it reads them) and counts them
with one aggregation. Rows of a bucket whose index fell behind while the tasks
ran (``STALE``) are claimed again once that bucket is caught up, a few rounds at
most. In strict mode the claimed keys are then checked against the ledger. Only
counts, bucket numbers and (strict mode on delta-rs) claimed keys come to the
driver, never rows.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from idem.claiming import MAX_INDEX_ROUNDS
from idem.clock import SystemClock
from idem.config import DedupMode
from idem.dedup import Dedup
from idem.errors import IndexUnsettled
from idem.keys import group_by_bucket
from idem.spark.faults import TaskFault
from idem.spark.verdicts import (
    BUCKET_COLUMN,
    CLAIMED,
    DETAIL_COLUMN,
    FINGERPRINT_TEXT_COLUMN,
    KEY_COLUMN,
    VERDICT_COLUMN,
    ClaimTask,
    Verdict,
    claim_frame,
    verdict_frame,
)

if TYPE_CHECKING:
    from pyspark import StorageLevel
    from pyspark.sql import DataFrame


@dataclass(frozen=True)
class ClaimedBatch:
    """A batch's rows with their final verdicts, kept by Spark, and how many of each."""

    frame: DataFrame
    """Every row of the batch with its verdict (persisted: read it as often as needed)."""
    counts: Mapping[Verdict, int]
    version: int
    """The ledger version every claimed key's bucket had indexed."""
    owner: str
    claimed_at_ms: int
    rounds: int
    """Claim rounds it took (more than 1: some buckets were caught up in between)."""

    @property
    def fresh(self) -> DataFrame:
        """The rows the sink gets (claimed), with every column of the batch."""
        from pyspark.sql import functions as F  # noqa: N812, PLC0415 -- Spark's convention

        return self.frame.where(F.col(VERDICT_COLUMN).isin([int(v) for v in CLAIMED]))

    @property
    def claimed(self) -> int:
        """How many rows the sink gets."""
        return sum(self.counts.get(v, 0) for v in CLAIMED)

    def release(self) -> None:
        """Let Spark drop the kept verdicts (after the batch)."""
        self.frame.unpersist()


def kept_level() -> StorageLevel:
    """How a batch's verdicts and ledger rows are kept between their reads: on the
    executors' local disks. A block kept in memory is read back whole, and a
    partition of a big batch outgrows an executor's heap; from disk it streams (and
    the operating system's page cache keeps small batches in memory anyway)."""
    from pyspark import StorageLevel  # noqa: PLC0415 -- pyspark is loaded by now

    return StorageLevel.DISK_ONLY


def claim_batch(
    prepared: DataFrame,
    dedup: Dedup,
    *,
    owner: str,
    key: str,
    hold: bool,
    fingerprints: bool = True,
    fault: TaskFault | None = None,
    track: bool = False,
) -> ClaimedBatch:
    """Claim every row of ``prepared`` for ``owner`` on the executors (see the module).

    ``track`` (with ``hold``): the executors also record the claimed keys under
    ``owner`` in Redis, so the driver can renew their leases
    (:meth:`idem.hotstore.RedisHotStore.renew_tracked`) without gathering them.

    Raises :class:`IndexUnsettled` when buckets keep falling behind for
    :data:`~idem.claiming.MAX_INDEX_ROUNDS` rounds (Redis restarting in a loop).
    """
    from pyspark.sql import functions as F  # noqa: N812, PLC0415

    version = dedup.catch_up()
    now = dedup.hot.now_ms()
    at = None if isinstance(dedup.clock, SystemClock) else now  # None: Redis's clock decides
    task = ClaimTask(
        dedup.config,
        owner,
        at,
        version,
        hold,
        key,
        fingerprints=fingerprints,
        fault=fault,
        track=track and hold,
    )
    frame = verdict_frame(prepared, task).persist(kept_level())
    counts = _counts(frame)
    rounds = 1
    stale = F.col(VERDICT_COLUMN) == int(Verdict.STALE)
    while counts.get(Verdict.STALE):
        if rounds >= MAX_INDEX_ROUNDS:
            frame.unpersist()
            raise IndexUnsettled(
                f"{counts[Verdict.STALE]} key(s) kept finding their buckets' Redis index "
                f"behind the ledger ({MAX_INDEX_ROUNDS} catch-ups); is Redis restarting or "
                "failing over in a loop? Their claims expire with their leases"
            )
        buckets = [int(r[0]) for r in frame.where(stale).select(BUCKET_COLUMN).distinct().collect()]
        version = dedup.catch_up(buckets, recheck=True)
        again = dataclasses.replace(task, min_version=version)
        added = [KEY_COLUMN, VERDICT_COLUMN, DETAIL_COLUMN, FINGERPRINT_TEXT_COLUMN]
        redone = claim_frame(frame.where(stale).drop(*added), again)
        merged = frame.where(~stale).unionByName(redone).persist(kept_level())
        counts = _counts(merged)
        frame.unpersist()
        frame = merged
        rounds += 1
    if dedup.config.mode is DedupMode.STRICT and any(counts.get(v) for v in CLAIMED):
        frame, counts = _strict_recheck(frame, counts, dedup, owner=owner, now_ms=now)
    return ClaimedBatch(frame, counts, version, owner, now, rounds)


def _strict_recheck(
    frame: DataFrame, counts: dict[Verdict, int], dedup: Dedup, *, owner: str, now_ms: int
) -> tuple[DataFrame, dict[Verdict, int]]:
    """Strict mode: claimed keys the ledger already holds within the dedup window are
    completed (or mismatched, by their fingerprint), not handed to the sink.

    On delta-spark the claimed keys meet the ledger in a Spark join; on delta-rs
    only the claimed keys (the ledger's own column) come to the driver. The keys
    found, usually none, go back to the executors as a broadcast table.
    """
    from pyspark.sql import functions as F  # noqa: N812, PLC0415

    from idem.ledger.spark_engine import SparkDeltaLedger  # noqa: PLC0415

    since = now_ms - dedup.config.dedup_window_ms
    is_claimed = F.col(VERDICT_COLUMN).isin([int(v) for v in CLAIMED])
    keys = frame.where(is_claimed).select(KEY_COLUMN)
    ledger = dedup.ledger
    if isinstance(ledger, SparkDeltaLedger):
        found = ledger.existing_among(keys, KEY_COLUMN, since_ms=since)
    else:
        found = ledger.existing(keys.toArrow().column(0).to_pylist(), since_ms=since)
    if not found:
        return frame, counts
    dedup.hot.release(group_by_bucket(list(found), dedup.config.buckets), owner)
    spark = frame.sparkSession
    stored = "_idem_stored"
    probe = spark.createDataFrame(
        pa.table(
            {
                KEY_COLUMN: pa.array(list(found), pa.string()),
                stored: pa.array(list(found.values()), pa.string()),
            }
        )
    )
    joined = frame.join(F.broadcast(probe), KEY_COLUMN, "left")
    hit = is_claimed & F.col(stored).isNotNull()
    own = F.col(FINGERPRINT_TEXT_COLUMN)
    differs = hit & (F.col(stored) != "") & own.isNotNull() & (own != "") & (own != F.col(stored))
    verdict = (
        F.when(differs, int(Verdict.MISMATCHED))
        .when(hit, int(Verdict.COMPLETED))
        .otherwise(F.col(VERDICT_COLUMN))
        .cast(frame.schema[VERDICT_COLUMN].dataType)
    )
    detail = F.when(hit, F.col(stored)).otherwise(F.col(DETAIL_COLUMN))
    rechecked = (
        joined.withColumn(VERDICT_COLUMN, verdict)
        .withColumn(DETAIL_COLUMN, detail)
        .select(*frame.columns)
        .persist(kept_level())
    )
    recounted = _counts(rechecked)
    frame.unpersist()
    return rechecked, recounted


def _counts(frame: DataFrame) -> dict[Verdict, int]:
    """How many rows have each verdict (one aggregation; computes and keeps ``frame``)."""
    found: Counter[Verdict] = Counter()
    for row in frame.groupBy(VERDICT_COLUMN).count().collect():
        found[Verdict(row[0])] = int(row[1])
    return dict(found)
