"""A rebuild of the Redis index from the delta-spark ledger, run on the executors.

When a claim finds buckets whose watermark is gone (Redis flushed or restarted
empty, a new Redis) it loads the ledger's dedup window into them. On the
delta-spark engine that window can hold tens of millions of keys; here it is
read as a DataFrame, partitioned by bucket so that every key of a bucket meets
in one task, and each task loads its buckets into Redis
(``index_completed``: one load per bucket, whose watermark moves only once all
of the bucket is in). The driver receives one small report per task.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from idem.clock import SYSTEM_CLOCK, Clock, SystemClock
from idem.config import IdemConfig
from idem.indexer import RebuiltWindow, index_rows_by_bucket
from idem.ledger.schema import to_index_rows
from idem.spark.verdicts import task_store

if TYPE_CHECKING:
    from idem.ledger import Ledger
    from idem.ledger.spark_engine import SparkDeltaLedger

LOAD_RESULT = pa.schema([pa.field("buckets", pa.list_(pa.int32())), pa.field("keys", pa.int64())])
"""What each load task reports to the driver (one row per task that had rows)."""


@dataclass(frozen=True)
class WindowLoadTask:
    """The load of one task's buckets into Redis; ``mapInArrow`` calls it on an executor.

    Args:
        config: The group's settings (Redis URL, buckets, window).
        version: The ledger version the rows were read at.
        marks: Each bucket's ``from_version`` (``None``: a rebuild), as pairs.
        now_ms: The instant of the window checks when the driver's clock is a test
            clock; ``None`` (the system clock): Redis's clock decides them.
    """

    config: IdemConfig
    version: int
    marks: tuple[tuple[int, int | None], ...]
    now_ms: int | None

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Load the task's rows, bucket by bucket; one result row (called once per task)."""
        received = [b for b in batches if b.num_rows]
        if not received:
            return
        rows = to_index_rows(pa.Table.from_batches(received))
        marks = dict(self.marks)
        by_bucket = index_rows_by_bucket(rows, marks)
        store = task_store(self.config, self.now_ms)
        for bucket, (keys, prints, ats) in sorted(by_bucket.items()):
            store.index_completed(
                bucket, keys, prints, ats, to_version=self.version, from_version=marks[bucket]
            )
        yield pa.record_batch(
            [
                pa.array([sorted(by_bucket)], pa.list_(pa.int32())),
                pa.array([rows.num_rows], pa.int64()),
            ],
            schema=LOAD_RESULT,
        )


@dataclass(frozen=True)
class ExecutorWindowLoad:
    """:class:`~idem.indexer.WindowLoad` on the executors, for the delta-spark ledger.

    Args:
        ledger: The group's delta-spark ledger (its session runs the load).
        config: The group's settings.
        clock: The driver's clock (a test clock's instant is handed to the tasks).
    """

    ledger: SparkDeltaLedger
    config: IdemConfig
    clock: Clock = SYSTEM_CLOCK

    def __call__(self, marks: Mapping[int, int | None], since_ms: int) -> RebuiltWindow:
        """Load the window of the buckets in ``marks`` from the executors; called by a
        claim's catch-up (see :class:`~idem.indexer.WindowLoad`)."""
        from pyspark.sql import types as st  # noqa: PLC0415 -- pyspark is loaded by now

        version, frame = self.ledger.window_frame(since_ms, marks)
        if frame is None:
            return RebuiltWindow(version, 0, frozenset())
        task = WindowLoadTask(
            self.config,
            version,
            tuple(sorted(marks.items())),
            None if isinstance(self.clock, SystemClock) else self.clock.now_ms(),
        )
        schema = st.StructType(
            [
                st.StructField("buckets", st.ArrayType(st.IntegerType())),
                st.StructField("keys", st.LongType()),
            ]
        )
        spread = frame.repartition(len(marks), "bucket")
        reports = spread.mapInArrow(task, schema).collect()
        loaded = frozenset(b for r in reports for b in r["buckets"])
        return RebuiltWindow(version, sum(int(r["keys"]) for r in reports), loaded)


def executor_window_load(
    ledger: Ledger, config: IdemConfig, clock: Clock = SYSTEM_CLOCK
) -> ExecutorWindowLoad | None:
    """The executors' window load for a delta-spark ``ledger``; ``None`` for delta-rs,
    whose window the driver loads itself (it holds only the ledger columns)."""
    from idem.ledger.spark_engine import SparkDeltaLedger  # noqa: PLC0415 -- needs delta-spark

    if not isinstance(ledger, SparkDeltaLedger):
        return None
    return ExecutorWindowLoad(ledger, config, clock)
