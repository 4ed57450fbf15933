"""The ledger engine interface, its results, and how an engine is chosen.

The Delta ledger is the log of truth of the dedup layer; Redis is an index
over it. An engine is anything that can do the few things below on a Delta
table: tell its version cheaply, commit a batch exactly once (insert-only
MERGE carrying ``txnAppId``/``txnVersion``), hand back the keys that versions
added, read the dedup window, and answer "which of these keys exist".
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import pyarrow as pa

from idem.clock import SYSTEM_CLOCK, Clock
from idem.config import IdemConfig, LedgerEngine
from idem.errors import ConfigError
from idem.ledger.schema import LedgerIdentity
from idem.ledger.staged import StagedRows

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DELTA_SPARK_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
"""What ``spark.sql.extensions`` must name for the delta-spark engine."""
DELTA_SPARK_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
"""What ``spark.sql.catalog.spark_catalog`` should be for the delta-spark engine."""
DELTA_SPARK_CLASS = "io.delta.tables.DeltaTable"
"""A class of Delta's jars: when it loads, they are on the session's classpath."""


@dataclass(frozen=True)
class CommitResult:
    """What one ``commit`` did.

    ``version`` is the table version written, ``None`` when nothing was
    committed (a replay, or no rows). ``already_present`` lists keys the
    ledger already held within the match window: slipped duplicates (the sink
    ran for them although they were done). ``batch_duplicates`` are keys that
    appeared more than once in the rows themselves (the first row was kept).
    """

    version: int | None
    inserted: int
    already_present: list[str] = field(default_factory=list)
    replayed: bool = False
    batch_duplicates: list[str] = field(default_factory=list)
    attempts: int = 1
    scan_time_ms: int | None = None


@dataclass(frozen=True)
class ChangedKeys:
    """The keys added by versions ``(since_version, version]`` (``keys`` as INDEX_SCHEMA)."""

    since_version: int
    version: int
    keys: pa.Table
    files_read: int = 0


@dataclass(frozen=True)
class LedgerWindow:
    """The keys completed at or after ``since_ms`` as of ``version`` (``keys`` as INDEX_SCHEMA).

    ``version`` is ``-1`` when there is no table yet.
    """

    version: int
    since_ms: int
    keys: pa.Table


@dataclass(frozen=True)
class CompactResult:
    """What ``compact`` rewrote."""

    files_removed: int
    files_added: int


@runtime_checkable
class Ledger(Protocol):
    """One Delta ledger table, whatever engine writes it."""

    @property
    def path(self) -> str:
        """The table's location."""
        ...

    def version(self) -> int:
        """The current table version, ``-1`` when the table does not exist. Cheap."""
        ...

    def commit(
        self,
        rows: pa.Table | StagedRows,
        *,
        app_id: str,
        txn_version: int,
        match_since_ms: int | None,
        match_after_version: int | None = None,
    ) -> CommitResult:
        """Insert the rows whose ``(bucket, key)`` is not in the ledger since ``match_since_ms``.

        ``None`` means strict mode: match against the whole dedup window.
        ``match_after_version`` (index mode) says the claim's Redis index had
        every version up to it; an engine may then match only the keys later
        versions added instead of the rows since ``match_since_ms``. A
        batch whose ``(app_id, txn_version)`` is already committed is a replay
        and commits nothing. Rows without ``completed_at`` get the ledger
        clock's now; columns the ledger does not know are written too (a sink
        table that is its own ledger). :class:`StagedRows` are rows kept in
        files (one per key), stamped with their ``completed_at_ms``.
        """
        ...

    def column_types(self) -> pa.Schema | None:
        """The table's columns as Arrow types (``None``: no table yet, or not known)."""
        ...

    def keys_added_since(self, version: int) -> ChangedKeys | None:
        """Keys added by versions after ``version``, reading only those versions' files.

        ``None`` when those versions (or their files) were cleaned up: the
        caller must rebuild from :meth:`window` instead.
        """
        ...

    def window(self, since_ms: int, buckets: Iterable[int] | None = None) -> LedgerWindow:
        """Rows completed at or after ``since_ms`` (only the given buckets), for a Redis rebuild."""
        ...

    def existing(self, keys: Iterable[str], *, since_ms: int | None) -> dict[str, str]:
        """``key -> fingerprint`` of the keys the ledger holds, completed since ``since_ms``."""
        ...

    def lookup_results(
        self, keys: Iterable[str], *, since_ms: int | None = None
    ) -> dict[str, str | None]:
        """``key -> result JSON`` (``None`` when no result was kept) of the keys present."""
        ...

    def owners(self, keys: Iterable[str], *, since_ms: int | None = None) -> dict[str, str]:
        """``key -> owner`` (who committed it) of the keys present."""
        ...

    def audit(self, *, since_ms: int | None = None) -> list[tuple[str, int]]:
        """Keys present more than once, with their counts, sorted by key."""
        ...

    def expire(self, older_than_ms: int, *, vacuum_retention_hours: int = 168) -> int:
        """Delete the days that ended before ``older_than_ms``; return the rows deleted."""
        ...

    def compact(self, *, before_ms: int | None = None) -> CompactResult:
        """Merge small files of the days before ``before_ms`` (default: before today)."""
        ...


def spark_delta_session() -> SparkSession | None:
    """The active Spark session, if it was checked to run the delta-spark engine.

    That is: ``spark.sql.extensions`` names Delta's extension, the delta-spark
    package is importable, and Delta's JVM classes load in that session (probed
    once per SparkContext). Never imports pyspark itself: when nothing imported
    it, there is no session.
    """
    if "pyspark" not in sys.modules:
        return None
    from pyspark.sql import SparkSession  # noqa: PLC0415 -- only once pyspark is loaded

    session = SparkSession.getActiveSession()
    if session is None or delta_spark_missing(session):
        return None
    return session


def delta_spark_missing(session: SparkSession) -> str | None:
    """What ``session`` lacks to run the delta-spark engine, and how to get it (``None``:
    nothing)."""
    extensions = session.conf.get("spark.sql.extensions", "") or ""
    if DELTA_SPARK_EXTENSION not in extensions:
        return (
            f"spark.sql.extensions does not name {DELTA_SPARK_EXTENSION} (set it, and "
            f"spark.sql.catalog.spark_catalog={DELTA_SPARK_CATALOG}, when the session is built)"
        )
    if importlib.util.find_spec("delta") is None:
        return (
            "the delta-spark package is not installed "
            "(pip install 'idem-exactly-once[spark-delta]')"
        )
    if not _delta_jvm_classes_load(session):
        return (
            "Delta's jars are not on the session's classpath (deploy/jars/fetch.sh fetches "
            "them; pass them with --jars, or use --packages io.delta:delta-spark_2.13)"
        )
    return None


_JVM_PROBES: dict[str, bool] = {}
_JVM_PROBES_LOCK = threading.Lock()


def _delta_jvm_classes_load(session: SparkSession) -> bool:
    """Whether Delta's classes load in the session's JVM; asked once per SparkContext."""
    context = session.sparkContext
    key = f"{context.applicationId}@{context.startTime}"
    with _JVM_PROBES_LOCK:
        known = _JVM_PROBES.get(key)
        if known is None:
            from py4j.java_gateway import JavaClass  # noqa: PLC0415 -- comes with pyspark

            jvm = session._jvm
            known = isinstance(getattr(jvm, DELTA_SPARK_CLASS), JavaClass)
            _JVM_PROBES[key] = known
    return known


def open_ledger(
    config: IdemConfig,
    engine: LedgerEngine | str | None = None,
    *,
    clock: Clock = SYSTEM_CLOCK,
    storage_options: dict[str, str] | None = None,
    **engine_options: Any,
) -> Ledger:
    """The ledger of ``config.group`` at ``config.resolved_ledger_path``.

    ``engine`` (``auto``, ``delta-rs``, ``delta-spark``) overrides
    ``config.engine``. Here ``auto`` is delta-rs, which needs no JVM jars: a
    consumer or ``@idempotent`` keeps its ledger in its own process even where a
    Spark session runs beside it. The Spark glue resolves ``auto`` itself, to
    delta-spark on a session checked to run it (``idem.spark.ledger_engine``).
    ``delta-spark`` without such a session (:func:`spark_delta_session`) is a
    :class:`ConfigError` naming what is missing. A table written by the other
    engine is refused when it is opened.
    """
    try:
        chosen = LedgerEngine(config.engine if engine is None else engine)
    except ValueError:
        allowed = ", ".join(e.value for e in LedgerEngine)
        raise ConfigError(f"engine: {engine!r} is not one of {allowed}") from None
    identity = LedgerIdentity(config.group, config.buckets)
    # Strict mode matches against the whole window; index mode passes the lease horizon.
    window_ms = config.dedup_window_ms
    if chosen is LedgerEngine.DELTA_SPARK:
        session = spark_delta_session()
        if session is not None:
            from idem.ledger.spark_engine import SparkDeltaLedger  # noqa: PLC0415 -- needs JVM

            return SparkDeltaLedger(
                session,
                config.resolved_ledger_path,
                clock=clock,
                dedup_window_ms=window_ms,
                identity=identity,
                **engine_options,
            )
        raise ConfigError(f"engine: delta-spark needs {_missing_for_delta_spark()}")
    from idem.ledger.deltars import DeltaLedger  # noqa: PLC0415 -- deltars imports this module

    return DeltaLedger(
        config.resolved_ledger_path,
        storage_options=storage_options,
        clock=clock,
        dedup_window_ms=window_ms,
        identity=identity,
        **engine_options,
    )


def _missing_for_delta_spark() -> str:
    """Why there is no session to run delta-spark in, and how to get one."""
    if "pyspark" in sys.modules:
        from pyspark.sql import SparkSession  # noqa: PLC0415 -- only once pyspark is loaded

        session = SparkSession.getActiveSession()
        if session is not None:
            return f"a Spark session with Delta, but {delta_spark_missing(session)}"
    return (
        "an active Spark session with Delta (pip install 'idem-exactly-once[spark-delta]'; "
        "Delta's jars from deploy/jars/fetch.sh on the classpath; spark.sql.extensions="
        f"{DELTA_SPARK_EXTENSION}); use engine delta-rs otherwise"
    )
