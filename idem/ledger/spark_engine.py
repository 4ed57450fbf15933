"""The delta-spark ledger engine, for Spark sessions that carry Delta's jars.

Same contract as :class:`~idem.ledger.deltars.DeltaLedger`, written by Spark.
In index mode a batch is a *checked append*, as on delta-rs: the claim's Redis
index covered every version up to the one it read, so only the keys later
versions added are matched against the batch (read from the files they added),
and the rest is written by the executors and committed in one Delta
transaction opened on the version checked up to (:mod:`idem.ledger._spark_txn`);
a commit by another writer since makes Delta refuse it, and the next attempt
checks the new versions too. Its cost follows the batch, not the table. In
strict mode, or when the versions since the claim are gone from the log, too
many, or the batch brings new columns, a batch is one insert-only ``MERGE`` on
``(bucket, key)``, restricted to the recent rows of the target
(``completed_date`` partitions and ``completed_at`` statistics prune the rest).

Exactly-once per batch uses Delta's idempotent writes: the checked append
commits a ``SetTransaction`` of the batch's ``(appId, version)``, and for the
MERGE the session confs ``spark.databricks.delta.write.txnAppId`` /
``txnVersion`` make Delta skip a write whose ``(appId, version)`` it already
committed. Those confs belong to a session, so every MERGE runs in its own
clone of the caller's session (its settings and credentials, its own conf):
two ledgers committing at once, or the application's own Delta writes in
its session, never pick up another write's txn ids. A unique ``userMetadata``
tag finds the MERGE's commit in the log afterwards (none: Delta skipped a replay).

What a commit inserted, the table's version, and the keys later versions
added are read from ``_delta_log`` and the added files directly (on the
driver, through the session's Hadoop filesystem), never by a Spark job.

Delta's jars come from Maven Central (``io.delta:delta-spark_2.13``; a
cluster gets them with ``deploy/jars/fetch.sh`` or ``--packages``); the
Python side is ``pip install 'idem-exactly-once[spark-delta]'``. ``open_ledger``
chooses this engine only for a session checked to run it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from idem.clock import SYSTEM_CLOCK, Clock
from idem.errors import ConfigError, LedgerConflict, LedgerError
from idem.ledger import _log
from idem.ledger._added import AddedKeys, keys_not_added, read_commit, read_index_file
from idem.ledger._hadoop import open_spark_log_store
from idem.ledger._spark_txn import AppendTxn, is_conflict
from idem.ledger.base import ChangedKeys, CommitResult, CompactResult, LedgerWindow
from idem.ledger.schema import (
    ENGINE_PROPERTY,
    INDEX_SCHEMA,
    PARTITION_COLUMNS,
    LedgerIdentity,
    check_ledger_table,
    conform,
    date_of_ms,
    datetime_of_ms,
    describe_ledger,
    first_per_key,
    to_index_rows,
)
from idem.ledger.staged import StagedRows

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

T = TypeVar("T")

ENGINE = "delta-spark"
"""What this engine records as the table's writer."""

_TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"
_USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
_AUTO_MERGE = "spark.databricks.delta.schema.autoMerge.enabled"
_RETENTION_CHECK = "spark.databricks.delta.retentionDurationCheck.enabled"
_DELTA_DEFAULT_RETENTION_HOURS = 168
MAX_CHECKED_VERSIONS = 64
"""More versions than this since the claim: MERGE on the recent rows instead of reading them."""
FIRST_COMMIT_WAIT_S = 60.0
"""How long a writer whose create found another's ``_delta_log`` waits for that
writer's first commit before calling the directory abandoned."""
_FIRST_COMMIT_POLL_S = 0.05
_ALREADY_EXISTS = "TABLE_OR_VIEW_ALREADY_EXISTS"
_LISTING_PARALLELISM = "spark.sql.sources.parallelPartitionDiscovery.parallelism"
_SPARK_DEFAULT_LISTING_PARALLELISM = "10000"


class SparkDeltaLedger:
    """The ledger table at ``path``, written by delta-spark through ``spark``.

    ``dedup_window_ms`` bounds strict-mode matching; ``identity`` (group and
    bucket count) is recorded when the table is created and checked when one is
    found. One instance may be shared by threads; instances coordinate through
    Delta's optimistic concurrency, like separate processes.
    """

    def __init__(
        self,
        spark: SparkSession,
        path: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        dedup_window_ms: int | None = None,
        max_attempts: int = 8,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        identity: LedgerIdentity | None = None,
    ) -> None:
        if max_attempts < 1:
            raise LedgerError(f"max_attempts: {max_attempts} must be at least 1")
        # delta-spark is an optional extra (and needs Delta's jars): imported here only.
        self._delta: Any = importlib.import_module("delta.tables").DeltaTable
        self._spark = spark
        self._path, self._store = open_spark_log_store(spark, path)
        self._clock = clock
        self._dedup_window_ms = dedup_window_ms
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._identity = identity
        self._log = _log.LogVersion(self._store, clock.now_ms, self._path)
        self._added = AddedKeys(self._read_commit, self._read_index_file)
        self._checked = False
        self._check_lock = threading.Lock()
        self._known_metadata: tuple[int, _log.TableMetadata] | None = None

    @property
    def path(self) -> str:
        """The table's location (absolute for local tables)."""
        return self._path

    def __repr__(self) -> str:
        return f"SparkDeltaLedger({self._path!r})"

    # -- version ---------------------------------------------------------------

    def version(self) -> int:
        """The current table version (``-1``: no table), from the log alone: one existence
        check of the next commit file in the steady state. The first call that finds a
        table checks whose it is and which engine writes it."""
        try:
            version = self._log.read()
        except OSError as exc:
            raise LedgerError(f"ledger {self._path}: cannot read the log: {exc}") from exc
        if version >= 0 and not self._checked:
            self._check_table()
        return version

    def _check_table(self) -> None:
        with self._check_lock:
            if self._checked:
                return
            metadata = self._metadata(self._log.read())
            check_ledger_table(
                self._path,
                engine=ENGINE,
                description=metadata.description,
                properties=metadata.configuration,
                identity=self._identity,
            )
            self._checked = True

    def _metadata(self, version: int) -> _log.TableMetadata:
        """The table's metadata at ``version``, from the log (kept until a commit changes
        it); Spark's own snapshot only where the log cannot tell."""
        cached = self._known_metadata
        if cached is not None and cached[0] == version:
            return cached[1]
        found: _log.TableMetadata | None = None
        try:
            if cached is not None and cached[0] < version:
                found = cached[1]
                for later in range(cached[0] + 1, version + 1):
                    entry = self._read_commit(later)
                    found = entry.metadata or found
            else:
                found = _log.latest_metadata(self._store, version)
        except _log.HistoryGone:
            found = _log.latest_metadata(self._store, version)
        except OSError as exc:
            raise LedgerError(f"ledger {self._path}: cannot read the log: {exc}") from exc
        if found is None:
            found = self._spark_metadata()
        self._known_metadata = (version, found)
        return found

    def _spark_metadata(self) -> _log.TableMetadata:
        try:
            table = self._delta.forPath(self._spark, self._path)
            detail = table.detail().select("description", "properties").head()
            schema = table.toDF().schema.json()
        except Exception as exc:  # Py4J / Spark errors have no common base
            raise LedgerError(f"ledger {self._path}: cannot read the table: {exc}") from exc
        properties = {str(k): str(v) for k, v in (detail["properties"] or {}).items()}
        return _log.TableMetadata(detail["description"], properties, schema)

    # -- commit ----------------------------------------------------------------

    def commit(
        self,
        rows: pa.Table | StagedRows,
        *,
        app_id: str,
        txn_version: int,
        match_since_ms: int | None,
        match_after_version: int | None = None,
    ) -> CommitResult:
        """Insert the ``rows`` whose key the ledger lacks, once per ``(app_id, txn_version)``.

        With ``match_after_version`` (index mode: the claim's Redis index
        covered every version up to it) it is a checked append
        (:meth:`_append_checked`). Otherwise, or when that cannot be done, one
        insert-only MERGE on ``(bucket, key)`` restricted to rows completed at
        or after ``match_since_ms`` (``None``: the dedup window, strict mode).
        The first commit creates the table with its rows (version 0). Keys
        offered but not inserted are ``already_present``, read from the very
        commit that skipped them. Columns the ledger does not know are added to
        the table. Conflicts with concurrent writers are retried (bounded,
        jittered) and then raise :class:`LedgerConflict`. :class:`StagedRows`
        are read whole into memory here (a large batch goes through
        :meth:`commit_frame`).
        """
        if isinstance(rows, StagedRows):
            rows = rows.read_all()
        if not app_id:
            raise LedgerError("app_id: must be a non-empty string")
        if txn_version < 0:
            raise LedgerError(f"txn_version: {txn_version} must be >= 0")
        now = self._clock.now_ms()
        source, batch_duplicates = first_per_key(conform(rows, now_ms=now))
        if source.num_rows == 0:
            return CommitResult(version=None, inserted=0)
        since = match_since_ms
        if since is None and self._dedup_window_ms is not None:
            since = now - self._dedup_window_ms
        self.version()  # whose table it is, before anything is written into it
        session = self._write_session(
            {_TXN_APP_ID: app_id, _TXN_VERSION: str(txn_version), _AUTO_MERGE: "true"}
        )
        frame = session.createDataFrame(source)  # the batch's one trip into the JVM
        keys = source.column("key")
        result = self._append_or_merge(
            session,
            frame,
            offered=source.num_rows,
            keys=lambda: keys,
            app_id=app_id,
            txn_version=txn_version,
            since=since,
            after_version=None if match_since_ms is None else match_after_version,
        )
        if result.version is not None:
            added = source
            if result.already_present:
                gone = pa.array(result.already_present, pa.string())
                added = source.filter(pc.invert(pc.is_in(keys, value_set=gone)))
            self._added.remember_own(result.version, added)
        return dataclasses.replace(result, batch_duplicates=batch_duplicates)

    def commit_frame(
        self,
        frame: DataFrame,
        *,
        offered: int,
        app_id: str,
        txn_version: int,
        match_since_ms: int | None,
        match_after_version: int | None = None,
    ) -> CommitResult:
        """:meth:`commit` of rows that are a Spark DataFrame: written by the executors.

        ``frame`` holds one row per key, with the ledger columns typed as
        :data:`~idem.ledger.schema.LEDGER_SCHEMA` (the user's columns may follow);
        ``offered`` is its row count. Nothing of the rows comes to the driver,
        except, when the ledger held some of the keys already, the keys (to name
        those it skipped).
        """
        if not app_id:
            raise LedgerError("app_id: must be a non-empty string")
        if txn_version < 0:
            raise LedgerError(f"txn_version: {txn_version} must be >= 0")
        if offered == 0:
            return CommitResult(version=None, inserted=0)
        since = match_since_ms
        if since is None and self._dedup_window_ms is not None:
            since = self._clock.now_ms() - self._dedup_window_ms
        if self.version() < 0:
            # ``frame`` belongs to the caller's session, not to the write session that
            # carries the txn id: the table is created empty first, and the rows MERGEd.
            self._create(self._spark.createDataFrame([], frame.schema), concurrent_ok=True)
        session = self._write_session(
            {_TXN_APP_ID: app_id, _TXN_VERSION: str(txn_version), _AUTO_MERGE: "true"}
        )
        return self._append_or_merge(
            session,
            frame,
            offered=offered,
            keys=lambda: frame.select("key").toArrow().column("key"),
            app_id=app_id,
            txn_version=txn_version,
            since=since,
            after_version=None if match_since_ms is None else match_after_version,
        )

    def _append_or_merge(
        self,
        session: SparkSession,
        frame: DataFrame,
        *,
        offered: int,
        keys: Callable[[], pa.ChunkedArray],
        app_id: str,
        txn_version: int,
        since: int | None,
        after_version: int | None,
    ) -> CommitResult:
        """The checked append after ``after_version`` where it can be made, else the MERGE."""
        what = f"commit {app_id}/{txn_version}"
        if after_version is not None and self.version() >= 0:
            checked = self._append_checked(
                frame, offered=offered, app_id=app_id, txn_version=txn_version,
                after_version=after_version, what=what,
            )  # fmt: skip
            if checked is not None:
                return checked
        return self._merge(session, frame, offered=offered, keys=keys, since=since, what=what)

    def _append_checked(
        self,
        frame: DataFrame,
        *,
        offered: int,
        app_id: str,
        txn_version: int,
        after_version: int,
        what: str,
    ) -> CommitResult | None:
        """Append the rows of ``frame`` no version after ``after_version`` added.

        Versions up to ``after_version`` are covered by the claim (Redis indexed
        them before it answered "new"), so only keys later versions added can
        collide: they are read from just the files those versions added (on the
        driver, ledger columns only), and the rows holding them are left out by
        a broadcast anti-join on the executors. The rest are written by the
        executors and committed in one Delta transaction opened on the version
        checked up to; a commit by any other writer since makes Delta refuse it,
        and the next attempt checks the new versions too. ``None`` (the caller
        MERGEs) when those versions are gone from the log or more than
        :data:`MAX_CHECKED_VERSIONS`, or when ``frame`` brings columns the table
        lacks or types it does not have (the MERGE evolves the schema).
        """
        checked = after_version
        seen: list[pa.Array] = []
        attempts = 0

        def attempt() -> CommitResult | None:
            nonlocal checked, attempts
            attempts += 1
            txn = AppendTxn(self._spark, self._path)
            if txn.committed_txn(app_id) >= txn_version:
                return CommitResult(version=None, inserted=0, replayed=True, attempts=attempts)
            target = txn.read_version
            if target - checked > MAX_CHECKED_VERSIONS:
                return None
            rows = self._in_table_order(frame, target)
            if rows is None:
                return None
            if target > checked:
                try:
                    added, _ = self._added.since(checked, target)
                except _log.HistoryGone:
                    return None  # cannot read what came since: the caller MERGEs
                if added.num_rows:
                    seen.append(added.column("key").combine_chunks())
                checked = target
            fresh, already = rows, list[str]()
            if seen:
                fresh, already = self._without(rows, pa.concat_arrays(seen))
            try:
                version = txn.commit(
                    fresh,
                    app_id=app_id,
                    txn_version=txn_version,
                    now_ms=self._clock.now_ms(),
                    tag=f"idem:{uuid.uuid4().hex}",
                )
            except Exception as exc:  # Py4J errors: a conflict is one of them
                if is_conflict(exc):
                    raise _Conflict(str(exc)) from exc
                raise LedgerError(f"ledger {self._path}: write failed: {exc}") from exc
            self._log.saw(version)
            return CommitResult(
                version=version,
                inserted=offered - len(already),
                already_present=already,
                attempts=attempts,
            )

        return self._retrying(attempt, what=what)

    def _in_table_order(self, frame: DataFrame, version: int) -> DataFrame | None:
        """``frame``'s columns in the table's order at ``version``; ``None`` unless they
        are the table's columns with the table's types."""
        from pyspark.sql.types import StructType  # noqa: PLC0415 -- pyspark is loaded by now

        schema = self._metadata(version).schema_string
        if schema is None:
            return None
        table = StructType.fromJson(json.loads(schema))
        ours = {field.name: field.dataType for field in frame.schema.fields}
        theirs = {field.name: field.dataType for field in table.fields}
        if ours != theirs:
            return None
        return frame.select(*table.fieldNames())

    def _without(self, rows: DataFrame, added: pa.Array) -> tuple[DataFrame, list[str]]:
        """``rows`` without the ``added`` keys, and which of their keys those were (only
        those come to the driver)."""
        from pyspark.sql import functions as F  # noqa: N812, PLC0415 -- Spark's convention

        probe = self._spark.createDataFrame(pa.table({"key": pc.unique(added)}))
        held = rows.join(F.broadcast(probe), "key", "left_semi").select("key")
        already = [str(k) for k in self._spark_read(held.toArrow).column("key").to_pylist()]
        if not already:
            return rows, []
        fresh = rows.join(F.broadcast(probe), "key", "left_anti").select(*rows.columns)
        return fresh, already

    def _merge(
        self,
        session: SparkSession,
        frame: DataFrame,
        *,
        offered: int,
        keys: Callable[[], pa.ChunkedArray],
        since: int | None,
        what: str,
    ) -> CommitResult:
        """The insert-only MERGE of ``frame`` (``offered`` rows, one per key) in the write
        ``session``; ``keys`` gives the offered keys when some were not inserted."""
        condition = "t.bucket = s.bucket AND t.key = s.key"
        if since is not None:
            condition += " AND " + _recent_sql(since, alias="t")
        attempts = 0

        def attempt() -> _log.CommitEntry | None:
            nonlocal attempts
            attempts += 1
            before = self.version()
            if before < 0:
                return self._tagged(session, before, lambda: self._create(frame), creating=True)
            return self._tagged(
                session,
                before,
                lambda: (
                    self._delta.forPath(session, self._path)
                    .alias("t")
                    .merge(frame.alias("s"), condition)
                    .whenNotMatchedInsertAll()
                    .execute()
                ),
            )

        ours = self._retrying(attempt, what=what)
        if ours is None:  # Delta skipped it: that txn was committed before
            return CommitResult(version=None, inserted=0, replayed=True, attempts=attempts)
        inserted = _inserted(ours)
        already: list[str] = []
        if inserted == 0:
            already = keys().to_pylist()
        elif inserted < offered:
            already = keys_not_added(self._store, self._path, ours, keys())
        return CommitResult(
            version=ours.version, inserted=inserted, already_present=already, attempts=attempts
        )

    def _create(self, frame: DataFrame, *, concurrent_ok: bool = False) -> None:
        """The table, created with the first batch in one commit (version 0);
        ``concurrent_ok``: a table another writer created first will do."""
        name = "delta.`" + self._path.replace("`", "``") + "`"
        try:
            (
                frame.writeTo(name)
                .using("delta")
                .partitionedBy(*PARTITION_COLUMNS)
                .tableProperty(ENGINE_PROPERTY, ENGINE)
                .tableProperty("comment", describe_ledger(ENGINE, self._identity))
                .create()
            )
        except Exception as exc:  # Py4J / Spark errors have no common base
            if not concurrent_ok or not self._created_by_another(exc):
                raise

    def _created_by_another(self, exc: Exception) -> bool:
        """Whether the create that raised ``exc`` lost to another writer's.

        Delta calls the table there as soon as its ``_delta_log`` directory is,
        which the other writer makes before its first commit is written: that
        commit is waited for (in real time, up to :data:`FIRST_COMMIT_WAIT_S`).
        A directory that stays without a commit raises :class:`LedgerError`.
        """
        if self._log.read() >= 0:
            return True
        if _ALREADY_EXISTS not in str(exc):
            return False
        give_up = time.monotonic() + FIRST_COMMIT_WAIT_S
        while time.monotonic() < give_up:
            time.sleep(_FIRST_COMMIT_POLL_S)
            if self._log.read() >= 0:
                return True
        raise LedgerError(
            f"ledger {self._path}: its _delta_log directory holds no commit after "
            f"{FIRST_COMMIT_WAIT_S:.0f} s; a writer that was creating the table stopped "
            "before its first commit: remove that _delta_log directory to create the ledger"
        ) from exc

    def _write_session(self, confs: dict[str, str]) -> SparkSession:
        """A clone of the caller's session with ``confs`` set: its own conf, so the txn
        ids of this write reach no other write."""
        from pyspark.sql import SparkSession  # noqa: PLC0415 -- pyspark is loaded by now

        clone = SparkSession(
            self._spark.sparkContext,
            self._spark._jsparkSession.cloneSession(),
        )
        for name, value in confs.items():
            clone.conf.set(name, value)
        return clone

    def _tagged(
        self,
        session: SparkSession,
        before: int,
        write: Callable[[], object],
        *,
        creating: bool = False,
    ) -> _log.CommitEntry | None:
        """Run ``write`` in ``session`` under a fresh tag; the commit it made after
        ``before`` (``None``: it committed nothing)."""
        tag = f"idem:{uuid.uuid4().hex}"
        session.conf.set(_USER_METADATA, tag)
        try:
            write()
        except Exception as exc:  # Py4J / Spark errors have no common base
            if is_conflict(exc):
                raise _Conflict(str(exc)) from exc
            if creating and self._created_by_another(exc):
                # Another writer created the table first: go again, as a MERGE.
                raise _Conflict(f"the ledger was created concurrently: {exc}") from exc
            raise LedgerError(f"ledger {self._path}: write failed: {exc}") from exc
        return self._find_commit(before, tag)

    def _find_commit(self, before: int, tag: str) -> _log.CommitEntry | None:
        """The commit after ``before`` whose ``userMetadata`` is ``tag``: the log is read
        forward from ``before`` to its end, whatever other writers committed meanwhile."""
        version = before + 1
        while True:
            try:
                entry = self._read_commit(version)
            except _log.HistoryGone:
                return None
            if entry.user_metadata == tag:
                self._log.saw(version)
                return entry
            version += 1

    def _retrying(self, fn: Callable[[], T], *, what: str) -> T:
        last: _Conflict | None = None
        for attempt in range(1, self._max_attempts + 1):
            try:
                return fn()
            except _Conflict as exc:
                last = exc
                if attempt < self._max_attempts:
                    ceiling = min(self._backoff_s * 2**attempt, self._max_backoff_s)
                    self._clock.sleep(random.uniform(0, ceiling))
        raise LedgerConflict(
            f"ledger {self._path}: {what} still conflicted with concurrent writers after "
            f"{self._max_attempts} attempts: {last}"
        ) from last

    # -- reading what was missed -------------------------------------------------

    def column_types(self) -> pa.Schema | None:
        """The table's columns as Arrow types (``None`` while there is no table), from the
        schema its log records."""
        version = self.version()
        if version < 0:
            return None
        from pyspark.sql.pandas.types import to_arrow_schema  # noqa: PLC0415 -- pyspark
        from pyspark.sql.types import StructType  # noqa: PLC0415

        schema = self._metadata(version).schema_string
        if schema is None:
            raise LedgerError(f"ledger {self._path}: the log records no schema")
        return to_arrow_schema(StructType.fromJson(json.loads(schema)), timezone="UTC")

    def keys_added_since(self, version: int) -> ChangedKeys | None:
        """Keys added by versions ``(version, current]``, from just the files they added.

        Compaction only rewrites keys already added, so its files are skipped.
        ``None`` when a needed commit file was cleaned from the log (or a data
        file vacuumed): the caller rebuilds from :meth:`window`. Any other
        failure to read raises :class:`LedgerError`.
        """
        if version < -1:
            raise LedgerError(f"version: {version} must be >= -1")
        current = self.version()
        try:
            keys, files_read = self._added.since(version, current)
        except _log.HistoryGone:
            return None
        return ChangedKeys(since_version=version, version=current, keys=keys, files_read=files_read)

    def _read_commit(self, version: int) -> _log.CommitEntry:
        return read_commit(self._store, self._path, version)

    def _read_index_file(self, added: _log.AddedFile) -> pa.Table:
        return read_index_file(self._store, self._path, added)

    # -- window, lookups, audit ------------------------------------------------------

    def window(self, since_ms: int, buckets: Iterable[int] | None = None) -> LedgerWindow:
        """Rows completed since ``since_ms`` (partition-pruned), with the version read.

        Gathers the rows on the driver; :meth:`window_frame` leaves them on the executors.
        """
        version, frame = self.window_frame(since_ms, buckets)
        if frame is None:
            return LedgerWindow(version, since_ms, INDEX_SCHEMA.empty_table())
        return LedgerWindow(version, since_ms, to_index_rows(self._spark_read(frame.toArrow)))

    def window_frame(
        self, since_ms: int, buckets: Iterable[int] | None = None
    ) -> tuple[int, DataFrame | None]:
        """The version read and, as a DataFrame of ``bucket, key, fingerprint,
        completed_at``, the rows completed since ``since_ms`` in ``buckets`` (default
        all) as of it; ``None`` when there is no table yet or no bucket is wanted."""
        version = self.version()
        wanted = None if buckets is None else sorted({int(b) for b in buckets})
        if version < 0 or wanted == []:
            return version, None
        frame = self._recent(since_ms, version)
        if wanted is not None:
            frame = frame.where(frame.bucket.isin(wanted))
        return version, frame.select("bucket", "key", "fingerprint", "completed_at")

    def _recent(self, since_ms: int | None, version: int | None = None) -> DataFrame:
        reader = self._spark.read.format("delta")
        if version is not None:
            reader = reader.option("versionAsOf", version)
        frame = reader.load(self._path)
        return frame if since_ms is None else frame.where(_recent_sql(since_ms))

    def _spark_read(self, read: Callable[[], T]) -> T:
        try:
            return read()
        except Exception as exc:  # Py4J / Spark errors have no common base
            raise LedgerError(f"ledger {self._path}: query failed: {exc}") from exc

    def _lookup(self, keys: Iterable[str], since_ms: int | None, column: str) -> dict[str, Any]:
        wanted = sorted(set(keys))
        if not wanted or self.version() < 0:
            return {}
        probe = self._spark.createDataFrame(pa.table({"key": pa.array(wanted, pa.string())}))
        joined = self._recent(since_ms).join(probe, "key").select("key", column, "completed_at")
        return _earliest(self._spark_read(joined.toArrow), column)

    def existing(self, keys: Iterable[str], *, since_ms: int | None) -> dict[str, str]:
        """``key -> fingerprint`` of keys present (a Spark join, never an ``IN`` list)."""
        return {k: v or "" for k, v in self._lookup(keys, since_ms, "fingerprint").items()}

    def existing_among(
        self, frame: DataFrame, key_column: str, *, since_ms: int | None
    ) -> dict[str, str]:
        """``key -> fingerprint`` of the keys of ``frame``'s ``key_column`` present: a
        join on the executors; only the keys found come to the driver."""
        from pyspark.sql import functions as F  # noqa: N812, PLC0415 -- Spark's convention

        if self.version() < 0:
            return {}
        probe = frame.select(F.col(key_column).alias("key")).distinct()
        joined = self._recent(since_ms).join(probe, "key", "left_semi")
        rows = self._spark_read(joined.select("key", "fingerprint", "completed_at").toArrow)
        return {k: v or "" for k, v in _earliest(rows, "fingerprint").items()}

    def split_held(
        self, frame: DataFrame, key_column: str, *, since_ms: int | None
    ) -> tuple[DataFrame, DataFrame]:
        """``frame``'s rows whose key the ledger holds, and the others: lazy joins on the
        executors (nothing comes to the driver) with the ledger as of now, so both stay
        the same however often they are read, commits after this call included."""
        from pyspark.sql import functions as F  # noqa: N812, PLC0415 -- Spark's convention

        version = self.version()
        if version < 0:
            return frame.limit(0), frame
        recent = self._recent(since_ms, version=version)
        held = recent.select(F.col("key").alias(key_column)).distinct()
        return (
            frame.join(held, key_column, "left_semi"),
            frame.join(held, key_column, "left_anti"),
        )

    def lookup_results(
        self, keys: Iterable[str], *, since_ms: int | None = None
    ) -> dict[str, str | None]:
        """``key -> result JSON`` of keys present."""
        return self._lookup(keys, since_ms, "result")

    def owners(self, keys: Iterable[str], *, since_ms: int | None = None) -> dict[str, str]:
        """``key -> owner`` of keys present."""
        return {k: v or "" for k, v in self._lookup(keys, since_ms, "owner").items()}

    def audit(self, *, since_ms: int | None = None) -> list[tuple[str, int]]:
        """Keys present more than once, with counts, sorted by key."""
        if self.version() < 0:
            return []
        counts = self._recent(since_ms).groupBy("bucket", "key").count().where("count > 1")
        rows = self._spark_read(counts.collect)
        return sorted((str(r["key"]), int(r["count"])) for r in rows)

    # -- maintenance ---------------------------------------------------------------

    def expire(self, older_than_ms: int, *, vacuum_retention_hours: int = 168) -> int:
        """Delete the days that ended before ``older_than_ms``'s day, then vacuum.

        Whole ``completed_date`` partitions go, so rows of the day containing
        ``older_than_ms`` stay. Returns the rows deleted. Vacuum removes
        unreferenced files older than ``vacuum_retention_hours`` (keep it above
        the longest reader; Delta's default is 168): a shorter one is allowed
        for this vacuum only, never in the caller's session. Vacuum lists the
        table's directories in ``parallelPartitionDiscovery.parallelism`` tasks;
        left at Spark's default (10,000 tasks for a ledger of a few hundred day
        directories) it is set to the cluster's default parallelism for this vacuum.
        """
        if vacuum_retention_hours < 0:  # checked before anything is deleted
            raise ConfigError(
                f"vacuum_retention_hours: {vacuum_retention_hours} must be >= 0 (168 keeps "
                "the files readers on versions of the past week still need)"
            )
        cutoff = date_of_ms(older_than_ms).isoformat()
        confs = {}
        if vacuum_retention_hours < _DELTA_DEFAULT_RETENTION_HOURS:
            confs[_RETENTION_CHECK] = "false"
        if self._spark.conf.get(_LISTING_PARALLELISM) == _SPARK_DEFAULT_LISTING_PARALLELISM:
            confs[_LISTING_PARALLELISM] = str(self._spark.sparkContext.defaultParallelism)
        session = self._write_session(confs)

        def attempt() -> int:
            before = self.version()
            if before < 0:
                return 0
            table = self._delta.forPath(session, self._path)
            ours = self._tagged(
                session, before, lambda: table.delete(f"completed_date < DATE'{cutoff}'")
            )
            self._tagged(session, before, lambda: table.vacuum(float(vacuum_retention_hours)))
            return 0 if ours is None else int(ours.metrics.get("numDeletedRows", 0))

        return self._retrying(attempt, what=f"expire before {cutoff}")

    def compact(self, *, before_ms: int | None = None) -> CompactResult:
        """Merge the small files of the days before ``before_ms`` (default: before today)."""
        cutoff = date_of_ms(self._clock.now_ms() if before_ms is None else before_ms)
        session = self._write_session({})

        def attempt() -> CompactResult:
            before = self.version()
            if before < 0:
                return CompactResult(0, 0)
            result: list[Any] = []
            self._tagged(
                session,
                before,
                lambda: result.append(
                    self._delta.forPath(session, self._path)
                    .optimize()
                    .where(f"completed_date < '{cutoff.isoformat()}'")
                    .executeCompaction()
                    .select("metrics.numFilesRemoved", "metrics.numFilesAdded")
                    .head()
                ),
            )
            return CompactResult(files_removed=int(result[0][0]), files_added=int(result[0][1]))

        return self._retrying(attempt, what="compact")


class _Conflict(Exception):
    """A write lost to a concurrent writer: try again."""


def _earliest(rows: pa.Table, column: str) -> dict[str, Any]:
    """``key -> column`` of each key's earliest row (by ``completed_at``)."""
    found: dict[str, Any] = {}
    newest_first = rows.sort_by([("completed_at", "descending")])
    pairs = zip(
        newest_first.column("key").to_pylist(),
        newest_first.column(column).to_pylist(),
        strict=True,
    )
    for key, value in pairs:
        found[key] = value  # newest first, so the earliest row wins
    return found


def _recent_sql(since_ms: int, *, alias: str = "") -> str:
    """``completed_date >= D AND completed_at >= T`` as Spark SQL (UTC literals)."""
    prefix = f"{alias}." if alias else ""
    return (
        f"{prefix}completed_date >= DATE'{date_of_ms(since_ms).isoformat()}'"
        f" AND {prefix}completed_at >= TIMESTAMP'{datetime_of_ms(since_ms).isoformat()}'"
    )


def _inserted(entry: _log.CommitEntry) -> int:
    """Rows a commit inserted: a MERGE's ``numTargetRowsInserted``, a create's rows."""
    metrics = entry.metrics
    return int(metrics.get("numTargetRowsInserted", metrics.get("numOutputRows", 0)))
