"""The delta-spark ledger engine, for clusters whose Spark session has Delta's jars.

Same contract as :class:`~idem.ledger.deltars.DeltaLedger`, written with
``DeltaTable.forPath(...).merge(...)``. Exactly-once per batch uses Delta's
idempotent DML: the session confs ``spark.databricks.delta.write.txnAppId`` /
``txnVersion`` (Delta >= 2.3, delta-io/delta#1555) make Delta skip a MERGE
whose ``(appId, version)`` it already committed. Each commit is tagged in
``userMetadata`` so we can tell a skipped (replayed) batch from ours.

Maven Central is unreachable where idem is built, so this module is exercised
only where a Delta-enabled session exists; it is imported lazily and chosen by
``open_ledger`` only when ``spark.sql.extensions`` names Delta's extension.
"""

from __future__ import annotations

import importlib
import json
import random
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from idem.clock import SYSTEM_CLOCK, Clock
from idem.errors import LedgerConflict, LedgerError
from idem.ledger import _log
from idem.ledger.base import ChangedKeys, CommitResult, CompactResult, LedgerWindow
from idem.ledger.schema import (
    INDEX_SCHEMA,
    PARTITION_COLUMNS,
    conform,
    date_of_ms,
    datetime_of_ms,
    to_index_rows,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"
_USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
_AUTO_MERGE = "spark.databricks.delta.schema.autoMerge.enabled"


class SparkDeltaLedger:
    """The ledger table at ``path``, written by delta-spark through ``spark``."""

    def __init__(
        self,
        spark: SparkSession,
        path: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        dedup_window_ms: int | None = None,
        max_attempts: int = 8,
    ) -> None:
        # delta-spark is an optional extra (and needs Delta's jars): imported here only.
        self._spark = spark
        self._delta: Any = importlib.import_module("delta.tables").DeltaTable
        self._path = path
        self._clock = clock
        self._dedup_window_ms = dedup_window_ms
        self._max_attempts = max_attempts
        # Session confs carry the txn ids: one commit at a time per session.
        self._lock = threading.Lock()

    @property
    def path(self) -> str:
        """The table's location."""
        return self._path

    def _table(self) -> Any:
        return self._delta.forPath(self._spark, self._path)

    def _exists(self) -> bool:
        return bool(self._delta.isDeltaTable(self._spark, self._path))

    def version(self) -> int:
        """The latest version from ``history(1)``; ``-1`` without a table."""
        if not self._exists():
            return -1
        return int(self._table().history(1).select("version").head()[0])

    def commit(
        self,
        rows: pa.Table,
        *,
        app_id: str,
        txn_version: int,
        match_since_ms: int | None,
        match_after_version: int | None = None,
    ) -> CommitResult:
        """Insert-only MERGE on ``(bucket, key)`` restricted to recent rows, once per txn.

        ``match_after_version`` is not used: this engine always MERGEs.
        """
        conflicts = _conflict_exceptions()
        now = self._clock.now_ms()
        table = conform(rows, now_ms=now)
        since = match_since_ms
        if since is None and self._dedup_window_ms is not None:
            since = now - self._dedup_window_ms
        tag = json.dumps({"idem": app_id, "txn": txn_version})
        # PySpark >= 4 takes a pyarrow Table directly.
        source = self._spark.createDataFrame(table).dropDuplicates(["bucket", "key"])
        condition = "t.bucket = s.bucket AND t.key = s.key"
        if since is not None:
            condition += (
                f" AND t.completed_date >= DATE'{date_of_ms(since).isoformat()}'"
                f" AND t.completed_at >= TIMESTAMP'{datetime_of_ms(since).isoformat()}'"
            )
        last_error: BaseException | None = None
        for attempt in range(1, self._max_attempts + 1):
            with self._lock:
                try:
                    self._create_if_missing(source)
                    before = self.version()
                    present = self._present(source, since, before)
                    self._spark.conf.set(_TXN_APP_ID, app_id)
                    self._spark.conf.set(_TXN_VERSION, str(txn_version))
                    self._spark.conf.set(_USER_METADATA, tag)
                    self._spark.conf.set(_AUTO_MERGE, "true")  # a sink table's own columns
                    try:
                        (
                            self._table()
                            .alias("t")
                            .merge(source.alias("s"), condition)
                            .whenNotMatchedInsertAll()
                            .execute()
                        )
                    finally:
                        for name in (_TXN_APP_ID, _TXN_VERSION, _USER_METADATA, _AUTO_MERGE):
                            self._spark.conf.unset(name)
                    ours = self._find_commit(before, tag)
                except conflicts as exc:
                    last_error = exc
                    self._clock.sleep(random.uniform(0, min(0.05 * 2**attempt, 2.0)))
                    continue
                except Exception as exc:  # Py4J / Spark errors have no common base
                    raise LedgerError(f"ledger {self._path}: commit failed: {exc}") from exc
            if ours is None:
                return CommitResult(version=None, inserted=0, replayed=True, attempts=attempt)
            version, inserted = ours
            return CommitResult(
                version=version,
                inserted=inserted,
                already_present=present,
                attempts=attempt,
            )
        raise LedgerConflict(
            f"ledger {self._path}: commit {app_id}/{txn_version} still conflicted after "
            f"{self._max_attempts} attempts: {last_error}"
        ) from last_error

    def _create_if_missing(self, source: DataFrame) -> None:
        if not self._exists():
            source.limit(0).write.format("delta").partitionBy(*PARTITION_COLUMNS).mode(
                "ignore"
            ).save(self._path)

    def _present(self, source: DataFrame, since: int | None, version: int) -> list[str]:
        ledger = self._spark.read.format("delta").option("versionAsOf", version).load(self._path)
        if since is not None:
            ledger = ledger.where(
                f"completed_date >= DATE'{date_of_ms(since).isoformat()}' AND "
                f"completed_at >= TIMESTAMP'{datetime_of_ms(since).isoformat()}'"
            )
        keys = ["bucket", "key"]
        joined = source.select(*keys).join(ledger.select(*keys), keys)
        return [row["key"] for row in joined.distinct().collect()]

    def _find_commit(self, before: int, tag: str) -> tuple[int, int] | None:
        """Our commit after ``before`` (by its tag): ``(version, rows inserted)``."""
        after = self.version()
        if after <= before:
            return None
        history = self._table().history(after - before).where(f"version > {before}")
        for row in history.select("version", "userMetadata", "operationMetrics").collect():
            if row["userMetadata"] == tag:
                metrics = row["operationMetrics"] or {}
                return int(row["version"]), int(metrics.get("numTargetRowsInserted", 0))
        return None

    def column_types(self) -> pa.Schema | None:
        """Not known on this engine: rows that do not fit fail the commit (Spark names it)."""
        return None

    def keys_added_since(self, version: int) -> ChangedKeys | None:
        """Keys added by versions after ``version``: their commit JSONs, then just their files.

        ``None`` when a commit file is gone (log cleanup): rebuild from the window.
        """
        current = self.version()
        root = self._path.rstrip("/")
        files: dict[str, _log.AddedFile] = {}
        for v in range(version + 1, current + 1):
            try:  # Hadoop's FileNotFound arrives wrapped by Py4J: no narrower type to catch
                data = self._spark.sparkContext.wholeTextFiles(f"{root}/{_log.commit_name(v)}")
                text = data.values().first()
            except Exception:
                return None
            entry = _log.parse_commit(v, text.encode())
            if entry.operation == "OPTIMIZE":
                continue
            for removed in entry.removed:
                files.pop(removed, None)
            files.update({a.path: a for a in entry.added if a.data_change})
        if not files:
            return ChangedKeys(version, current, INDEX_SCHEMA.empty_table())
        # Delta lays partitions out Hive-style, so basePath gives back bucket.
        paths = [f"{root}/{p}" for p in files]
        frame = (
            self._spark.read.option("basePath", root)
            .parquet(*paths)
            .select("bucket", "key", "fingerprint", "completed_at")
        )
        return ChangedKeys(version, current, to_index_rows(frame.toArrow()), len(paths))

    def window(self, since_ms: int, buckets: Iterable[int] | None = None) -> LedgerWindow:
        """Rows completed since ``since_ms`` (partition-pruned), with the version read."""
        version = self.version()
        if version < 0:
            return LedgerWindow(-1, since_ms, INDEX_SCHEMA.empty_table())
        frame = self._recent(since_ms, version)
        if buckets is not None:
            frame = frame.where(frame.bucket.isin(sorted({int(b) for b in buckets})))
        rows = frame.select("bucket", "key", "fingerprint", "completed_at").toArrow()
        return LedgerWindow(version, since_ms, to_index_rows(rows))

    def _recent(self, since_ms: int | None, version: int | None = None) -> DataFrame:
        reader = self._spark.read.format("delta")
        if version is not None:
            reader = reader.option("versionAsOf", version)
        frame = reader.load(self._path)
        if since_ms is None:
            return frame
        return frame.where(
            f"completed_date >= DATE'{date_of_ms(since_ms).isoformat()}' AND "
            f"completed_at >= TIMESTAMP'{datetime_of_ms(since_ms).isoformat()}'"
        )

    def _lookup(self, keys: Iterable[str], since_ms: int | None, column: str) -> dict[str, Any]:
        wanted = sorted(set(keys))
        if not wanted or not self._exists():
            return {}
        probe = self._spark.createDataFrame([(k,) for k in wanted], "key string")
        joined = self._recent(since_ms).join(probe, "key").select("key", column, "completed_at")
        found: dict[str, Any] = {}
        for row in joined.orderBy("completed_at", ascending=False).collect():
            found[row["key"]] = row[column]  # newest first, so the earliest row wins
        return found

    def existing(self, keys: Iterable[str], *, since_ms: int | None) -> dict[str, str]:
        """``key -> fingerprint`` of keys present (a Spark join, never an IN list)."""
        return {k: v or "" for k, v in self._lookup(keys, since_ms, "fingerprint").items()}

    def lookup_results(
        self, keys: Iterable[str], *, since_ms: int | None = None
    ) -> dict[str, str | None]:
        """``key -> result JSON`` of keys present."""
        return self._lookup(keys, since_ms, "result")

    def owners(self, keys: Iterable[str], *, since_ms: int | None = None) -> dict[str, str]:
        """``key -> owner`` of keys present."""
        return {k: v or "" for k, v in self._lookup(keys, since_ms, "owner").items()}

    def audit(self, *, since_ms: int | None = None) -> list[tuple[str, int]]:
        """Keys present more than once, with counts."""
        if not self._exists():
            return []
        counts = self._recent(since_ms).groupBy("bucket", "key").count().where("count > 1")
        return sorted((r["key"], int(r["count"])) for r in counts.collect())

    def expire(self, older_than_ms: int, *, vacuum_retention_hours: int = 168) -> int:
        """Delete whole days before ``older_than_ms``'s day, then vacuum."""
        if not self._exists():
            return 0
        table = self._table()
        table.delete(f"completed_date < DATE'{date_of_ms(older_than_ms).isoformat()}'")
        metrics = table.history(1).select("operationMetrics").head()[0] or {}
        table.vacuum(float(vacuum_retention_hours))
        return int(metrics.get("numDeletedRows", 0))

    def compact(self, *, before_ms: int | None = None) -> CompactResult:
        """OPTIMIZE the days before ``before_ms`` (default today)."""
        if not self._exists():
            return CompactResult(0, 0)
        cutoff = date_of_ms(self._clock.now_ms() if before_ms is None else before_ms)
        result = (
            self._table()
            .optimize()
            .where(f"completed_date < '{cutoff.isoformat()}'")
            .executeCompaction()
            .select("metrics.numFilesRemoved", "metrics.numFilesAdded")
            .head()
        )
        return CompactResult(files_removed=int(result[0]), files_added=int(result[1]))


def _conflict_exceptions() -> tuple[type[BaseException], ...]:
    """delta-spark's commit-conflict exceptions (no common base class in every version)."""
    delta_errors = importlib.import_module("delta.exceptions")

    names = (
        "ConcurrentWriteException",
        "ConcurrentAppendException",
        "ConcurrentDeleteReadException",
        "ConcurrentDeleteDeleteException",
        "ConcurrentTransactionException",
        "MetadataChangedException",
        "ProtocolChangedException",
    )
    return tuple(getattr(delta_errors, name) for name in names if hasattr(delta_errors, name))
