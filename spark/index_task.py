"""The Redis index update of a committed batch, run on the executors, bucket by bucket
(and the release of an abandoned batch's claims, likewise).

After the ledger commit of a batch (version ``v``), Redis learns that its keys
are COMPLETED. The verdicts of the batch are partitioned by bucket
(:func:`idem.spark.verdicts.verdict_frame`), so each task holds every committed
key of the buckets it has: it marks them completed and moves those buckets'
watermarks to ``v`` (``complete.lua``; a bucket of more than one call moves only
after its last). The driver then moves the watermarks of the buckets the batch
did not touch (:func:`index_committed`). A watermark therefore never covers a
version before every key that version added to its bucket is indexed; a task
that fails leaves its buckets behind, and the next claim loads what they miss
from the ledger.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from idem.config import IdemConfig
from idem.hotstore_types import HotStore
from idem.spark.verdicts import (
    BUCKET_COLUMN,
    FINGERPRINT_TEXT_COLUMN,
    KEY_COLUMN,
    split_by_bucket,
    task_store,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

INDEX_RESULT = pa.schema(
    [
        pa.field("buckets", pa.list_(pa.int32())),
        pa.field("completed", pa.int64()),
        pa.field("fenced", pa.list_(pa.string())),
        pa.field("lagging", pa.list_(pa.int32())),
    ]
)
"""What each index task reports to the driver (one row per task)."""


@dataclass(frozen=True)
class IndexedVersion:
    """How the index update of one committed version went."""

    completed: int
    """Keys that are COMPLETED in Redis now."""
    fenced: tuple[str, ...]
    """Keys another owner held with a live lease: left alone."""
    lagging: frozenset[int]
    """Buckets whose watermark did not move (behind, gone, or fenced): the next claim of
    their keys catches them up from the ledger."""


def _bucket_order(
    batches: Iterable[pa.RecordBatch],
) -> tuple[pa.Table, pa.Array, list[str], dict[int, list[str]]] | None:
    """A task's rows, the order that sorts them by bucket, their keys in that order and
    the keys by bucket (``None``: the task has no rows)."""
    received = [b for b in batches if b.num_rows]
    if not received:
        return None
    table = pa.Table.from_batches(received).combine_chunks()
    buckets = table.column(BUCKET_COLUMN).to_numpy()
    order = np.argsort(buckets, kind="stable")
    keys = table.column(KEY_COLUMN).take(pa.array(order)).to_pylist()
    return table, pa.array(order), keys, split_by_bucket(keys, buckets[order])


@dataclass(frozen=True)
class IndexTask:
    """The index update of one task's buckets; ``mapInArrow`` calls it on an executor.

    Args:
        config: The group's settings (Redis URL, buckets, window).
        owner: The batch's owner token: its claims are the ones completed.
        version: The ledger version holding the keys.
        completed_at_ms: When the keys were completed (the ledger rows' time).
        now_ms: The instant of the update's lease checks when the driver's clock is a
            test clock; ``None`` (the system clock): Redis's clock decides them.
    """

    config: IdemConfig
    owner: str
    version: int
    completed_at_ms: int
    now_ms: int | None

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Index the task's committed keys; one result row (called once per task)."""
        task = _bucket_order(batches)
        if task is None:
            return
        table, order, keys, grouped = task
        prints = pc.fill_null(table.column(FINGERPRINT_TEXT_COLUMN), "").take(order).to_pylist()
        store = task_store(self.config, self.now_ms)
        done = store.complete(
            grouped,
            self.owner,
            dict(zip(keys, prints, strict=True)),
            version=self.version,
            completed_at_ms=self.completed_at_ms,
            buckets=grouped,
        )
        yield pa.record_batch(
            [
                pa.array([sorted(grouped)], pa.list_(pa.int32())),
                pa.array([done.completed], pa.int64()),
                pa.array([done.fenced], pa.list_(pa.string())),
                pa.array([sorted(done.lagging_buckets)], pa.list_(pa.int32())),
            ],
            schema=INDEX_RESULT,
        )


def index_committed(
    committed: DataFrame,
    task: IndexTask,
    store: HotStore,
) -> IndexedVersion:
    """Index the ``committed`` rows (bucket-partitioned, with :data:`KEY_COLUMN`,
    :data:`BUCKET_COLUMN` and :data:`FINGERPRINT_TEXT_COLUMN`) on the executors, then
    move the watermarks of every other bucket from the driver (``store``)."""
    from pyspark.sql import types as st  # noqa: PLC0415 -- pyspark is loaded by now

    schema = st.StructType(
        [
            st.StructField("buckets", st.ArrayType(st.IntegerType())),
            st.StructField("completed", st.LongType()),
            st.StructField("fenced", st.ArrayType(st.StringType())),
            st.StructField("lagging", st.ArrayType(st.IntegerType())),
        ]
    )
    picked = committed.select(KEY_COLUMN, BUCKET_COLUMN, FINGERPRINT_TEXT_COLUMN)
    reports = picked.mapInArrow(task, schema).collect()
    touched = {b for r in reports for b in r["buckets"]}
    rest = [b for b in range(task.config.buckets) if b not in touched]
    lagging = {b for r in reports for b in r["lagging"]}
    completed = sum(r["completed"] for r in reports)
    fenced = tuple(k for r in reports for k in r["fenced"])
    if rest:
        moved = store.complete(
            {}, task.owner, {}, version=task.version, completed_at_ms=task.completed_at_ms,
            buckets=rest,
        )  # fmt: skip
        lagging |= moved.lagging_buckets
    return IndexedVersion(completed, fenced, frozenset(lagging))


@dataclass(frozen=True)
class ReleaseTask:
    """Give back one task's claims of an abandoned batch; ``mapInArrow`` calls it on an
    executor. Keys completed or held by another owner are left alone (``release.lua``).

    Args:
        config: The group's settings (Redis URL, buckets).
        owner: The batch's owner token: only its claims are released.
    """

    config: IdemConfig
    owner: str

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Release the task's keys; one result row with how many were released."""
        task = _bucket_order(batches)
        if task is None:
            return
        grouped = task[3]
        store = task_store(self.config)
        released = store.release(grouped, self.owner)
        yield pa.record_batch([pa.array([released], pa.int64())], names=["released"])


def release_claimed(claimed: DataFrame, task: ReleaseTask) -> int:
    """Release the ``claimed`` rows' keys (:data:`KEY_COLUMN`, :data:`BUCKET_COLUMN`) from
    the executors; how many claims were given back."""
    from pyspark.sql import types as st  # noqa: PLC0415 -- pyspark is loaded by now

    schema = st.StructType([st.StructField("released", st.LongType())])
    reports = claimed.select(KEY_COLUMN, BUCKET_COLUMN).mapInArrow(task, schema).collect()
    return sum(int(r["released"]) for r in reports)
