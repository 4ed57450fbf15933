"""The default ledger engine: delta-rs (``deltalake``), in-process, no JVM.

Index mode (the default) commits a batch as a *checked append*: the claim's
Redis index had every ledger version up to ``match_after_version``, so only
keys that later versions added can collide with the batch. Those are read from
just the files the later versions added, the colliding rows are dropped, and
the rest is appended at exactly the next version (no commit retry): if another
writer took that version, its keys are checked too and the append tries again.
Delta's put-if-absent commit makes the check and the commit one atomic step, so
two writers that both claimed a key (a Redis failover) insert it once. The cost
is O(what was committed since the claim), not O(rows in the lease horizon):
measured 0.10-0.13 s for 100k keys whatever the window holds, where the MERGE
below grew from 0.10 to 0.55 s as 0 to 400k rows entered the horizon.

Strict mode, a claim whose later versions were cleaned from the log, and
claims more than ``_MAX_CHECKED_VERSIONS`` behind use one insert-only MERGE
on ``(bucket, key)`` whose ON clause also requires ``t.completed_at >=
match_since`` (and the matching ``completed_date`` partitions). delta-rs prunes
the target by those target-only literal conjuncts, by partition values and by
each file's ``completed_at`` statistics, so the MERGE reads only the files of
recent batches. Measured (``bench/ledger_probe.py``, 2 cores, 100k new keys,
median of 5): 0.12-0.15 s into a 100k-key ledger, 0.13-0.135 s into 10M keys,
against 7-16 s for the plain MERGE at 10M; each 100k keys already inside the
horizon add ~0.05-0.15 s (delta-rs reads every column of the files it cannot
skip). Concurrent MERGEs conflict on the recent files they both read.

``version`` probes for the next commit file (~6 us locally) instead of
loading table state; ``keys_added_since`` reads the commit JSONs of the missed
versions and only the files they added.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import (
    ColumnProperties,
    CommitProperties,
    DeltaTable,
    Schema,
    Transaction,
    WriterProperties,
    write_deltalake,
)
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from deltalake.transaction import AddAction, RemoveAction, create_table_with_add_actions
from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_random_exponential,
)

from idem.clock import SYSTEM_CLOCK, Clock
from idem.errors import ConfigError, LedgerConflict, LedgerError
from idem.ledger import _files, _log, _sql
from idem.ledger._added import AddedKeys, keys_not_added, read_commit, read_index_file
from idem.ledger.base import ChangedKeys, CommitResult, CompactResult, LedgerWindow
from idem.ledger.schema import (
    INDEX_SCHEMA,
    LEDGER_SCHEMA,
    PARTITION_COLUMNS,
    LedgerIdentity,
    check_ledger_table,
    conform,
    conformed_column,
    date_of_ms,
    datetime_of_ms,
    describe_ledger,
    first_per_key,
    recorded_writer,
    require_columns,
    to_index_rows,
)
from idem.ledger.staged import StagedRows

T = TypeVar("T")

log = logging.getLogger(__name__)

DEFAULT_MAX_ATTEMPTS = 8
"""Commit attempts against concurrent writers before :class:`LedgerConflict`."""

_APPEND_RACES = 16
"""Appends that lose the race for a version before the commit backs off (then retries)."""

REVERIFY_AFTER_MS = _log.REVERIFY_AFTER_MS
"""A remembered table version older than this is checked to still be in the log."""
_MAX_CHECKED_VERSIONS = 64
"""More versions than this since the claim: MERGE on the recent rows instead of reading them."""

_UNIQUE_COLUMNS = ("key", "msg_id", "origin_msg_id", "fingerprint")
WRITER_PROPERTIES = WriterProperties(
    column_properties=dict.fromkeys(_UNIQUE_COLUMNS, ColumnProperties(dictionary_enabled=False))
)
"""How the ledger's files are written: no dictionary for the columns whose values are
(nearly) all different. The Parquet writer would build a dictionary for them and give
it up again; skipping that halves the write of a 100k-row batch (``bench/spark_batch.py``)."""

ENGINE = "delta-rs"
"""What this engine records in the table's ``idem.engine`` property."""


def recorded_identity(
    uri: str, *, storage_options: dict[str, str] | None = None
) -> LedgerIdentity | None:
    """The group and bucket count the ledger at ``uri`` was created with (``None``: no
    table there, or one older than that record)."""
    try:
        table = DeltaTable(uri, storage_options=storage_options)
    except TableNotFoundError:
        return None
    return LedgerIdentity.of(table.metadata().description)


def recorded_engine(uri: str, *, storage_options: dict[str, str] | None = None) -> str | None:
    """The engine that writes the ledger at ``uri`` (its ``idem.engine`` property; ``None``:
    no table there, or one that does not record it)."""
    try:
        table = DeltaTable(uri, storage_options=storage_options)
    except TableNotFoundError:
        return None
    metadata = table.metadata()
    return recorded_writer(metadata.description, metadata.configuration)


class DeltaLedger:
    """The ledger table at ``path``, written and read with delta-rs.

    ``dedup_window_ms`` bounds strict-mode matching (``match_since_ms=None``);
    without it strict mode matches the whole table. One instance may be shared
    by threads (its table handle is locked); separate instances, like separate
    processes, coordinate through Delta's optimistic concurrency.
    """

    def __init__(
        self,
        path: str,
        *,
        storage_options: dict[str, str] | None = None,
        clock: Clock = SYSTEM_CLOCK,
        dedup_window_ms: int | None = None,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        streamed_exec: bool = False,
        identity: LedgerIdentity | None = None,
    ) -> None:
        if max_attempts < 1:
            raise LedgerError(f"max_attempts: {max_attempts} must be at least 1")
        self._uri = _log.local_path(path) if _log.is_local(path) else path
        self._storage_options = storage_options
        self._clock = clock
        self._dedup_window_ms = dedup_window_ms
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._streamed_exec = streamed_exec
        self._store = _log.open_log_store(self._uri, storage_options)
        self._table: DeltaTable | None = None
        self._table_lock = threading.RLock()
        self._log = _log.LogVersion(self._store, self._clock.now_ms, self._uri)
        self._added = AddedKeys(self._read_commit, self._read_index_file)
        self._identity = identity

    @property
    def path(self) -> str:
        """The table's location (absolute for local tables)."""
        return self._uri

    def __repr__(self) -> str:
        return f"DeltaLedger({self._uri!r})"

    # -- version ---------------------------------------------------------------

    def version(self) -> int:
        """The current table version, ``-1`` when there is no table.

        One existence check of the next commit file per call in the steady
        state (plus one per commit made since the last call). The first call that
        finds a table also checks whose it is (:class:`LedgerIdentity`), before any
        of its keys can count as completed.
        """
        version = self._log_version()
        if version >= 0 and self._identity is not None and self._table is None:
            with self._table_lock:
                self._latest()
        return version

    def _log_version(self) -> int:
        try:
            return self._log.read()
        except OSError as exc:
            raise LedgerError(f"ledger {self._uri}: cannot read the log: {exc}") from exc

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
        covered every version up to it) the rows are matched against the keys
        the later versions added and appended at the next version with no
        commit retry, so a concurrent writer's commit forces a new check
        (:meth:`_append_checked`). Otherwise, or when those versions are
        cleaned from the log or too many, it is an insert-only MERGE on
        ``(bucket, key)`` restricted to rows completed at or after
        ``match_since_ms`` (``None``: the dedup window, i.e. strict mode).
        ``completed_at`` is the commit time (rows without it get the ledger
        clock's now). Columns the ledger does not know are added to the table
        (a Delta sink that is its own ledger). Conflicts with concurrent writers
        are retried (bounded, exponential, jittered) and then raise
        :class:`LedgerConflict`.

        ``rows`` may be :class:`StagedRows`: the checks read their ledger columns,
        and the rows to insert are read from the staged files batch by batch and
        written as the table's data files by idem (:mod:`idem.ledger._files`), a
        bounded buffer at a time, then committed as one version; the rows' other
        columns are never all in this process's memory at once. In place of the
        MERGE, their keys are looked up in the recent rows and the rest appended
        as the checked append does. (Staged rows that bring columns the table
        lacks are streamed to delta-rs' writer instead, which evolves the schema.)
        Every staged row is stamped with the same ``completed_at``, and a key may
        appear once.
        """
        if not app_id:
            raise LedgerError("app_id: must be a non-empty string")
        if txn_version < 0:
            raise LedgerError(f"txn_version: {txn_version} must be >= 0")
        if self._already_committed(app_id, txn_version):  # a replay costs ~1 ms
            return CommitResult(version=None, inserted=0, replayed=True, attempts=0)
        now = self._clock.now_ms()
        batch_duplicates: list[str] = []
        if isinstance(rows, StagedRows):
            source = _Source.streaming(rows, now_ms=now)
        else:
            table, batch_duplicates = first_per_key(conform(rows, now_ms=now))
            source = _Source.in_memory(table)
        since = match_since_ms
        if since is None and self._dedup_window_ms is not None:
            since = now - self._dedup_window_ms
        attempts = 0

        def attempt() -> CommitResult:
            nonlocal attempts
            attempts += 1
            if match_after_version is not None and match_since_ms is not None:
                checked = self._append_checked(source, app_id, txn_version, match_after_version)
                if checked is not None:
                    return checked
            return self._commit_once(source, app_id, txn_version, since)

        result = self._retrying(attempt, what=f"commit {app_id}/{txn_version}")
        return CommitResult(
            version=result.version,
            inserted=result.inserted,
            already_present=result.already_present,
            replayed=result.replayed,
            batch_duplicates=batch_duplicates,
            attempts=attempts,
            scan_time_ms=result.scan_time_ms,
        )

    def _already_committed(self, app_id: str, txn_version: int) -> bool:
        try:
            with self._table_lock:
                table = self._latest()
                done = None if table is None else table.transaction_version(app_id)
        except DeltaError as exc:
            raise LedgerError(f"ledger {self._uri}: cannot read the table: {exc}") from exc
        return done is not None and done >= txn_version

    def _commit_once(
        self, source: _Source, app_id: str, txn_version: int, since_ms: int | None
    ) -> CommitResult:
        with self._table_lock:
            table = self._latest()
            if table is None:
                if source.num_rows == 0:
                    return CommitResult(version=None, inserted=0)
                return self._create_with(source, app_id, txn_version)
            done = table.transaction_version(app_id)
            if done is not None and done >= txn_version:
                return CommitResult(version=None, inserted=0, replayed=True)
            if source.num_rows == 0:
                return CommitResult(version=None, inserted=0)
            if source.streamed and _same_columns(source.schema, table):
                return self._append_unless_present(source, app_id, txn_version, since_ms)
            # The recency conjuncts touch only the target: delta-rs prunes by them.
            predicate = "t.bucket = s.bucket AND t.key = s.key"
            if since_ms is not None:
                predicate += " AND " + _sql.recent(since_ms, alias="t")
            before = table.version()
            metrics = (
                table.merge(
                    source.data(),
                    predicate,
                    source_alias="s",
                    target_alias="t",
                    # A streamed source is read once, as it comes: never held whole.
                    streamed_exec=self._streamed_exec or source.streamed,
                    merge_schema=not _same_columns(source.schema, table),
                    writer_properties=WRITER_PROPERTIES,
                    commit_properties=CommitProperties(
                        app_transactions=[Transaction(app_id, txn_version)]
                    ),
                )
                .when_not_matched_insert_all()
                .execute()
            )
            inserted = int(metrics.get("num_target_rows_inserted", 0))
            if table.version() == before:
                # delta-rs commits nothing when a MERGE changes nothing; record the
                # batch's txn anyway (a blind append of no rows) so a replay is seen.
                write_deltalake(
                    table,
                    source.schema.empty_table(),
                    mode="append",
                    commit_properties=CommitProperties(
                        app_transactions=[Transaction(app_id, txn_version)]
                    ),
                )
            # Written through the table object, it stands at our own commit's version, not
            # at a later writer's (whose keys Redis would then be told it indexed).
            version = table.version()
        self._saw_version(version)
        already: list[str] = []
        if inserted == 0:
            already = source.keys.to_pylist()
        elif inserted < source.num_rows:
            already = self._already_present(source.keys, version)
        return CommitResult(
            version=version,
            inserted=inserted,
            already_present=already,
            scan_time_ms=_int_or_none(metrics.get("scan_time_ms")),
        )

    def _append_unless_present(
        self, source: _Source, app_id: str, txn_version: int, since_ms: int | None
    ) -> CommitResult:
        """What the MERGE does, for staged rows, without handing delta-rs their stream.

        The keys the ledger holds (completed since ``since_ms``) are looked up at one
        version, the ledger columns joined against the recent files as the MERGE's
        ON clause would; the other rows are then appended as the checked append
        does from that version, so a writer committing meanwhile is checked too.
        """
        with _sql.probe_table(source.keys.combine_chunks()) as probe:
            version, rows = self._query(_sql.probe_sql("fingerprint", since_ms), probe=probe)
        held = None if rows is None else rows.column("key").combine_chunks()
        result = self._append_checked(source, app_id, txn_version, version, held=held)
        if result is None:  # too many versions came meanwhile: look again
            raise CommitFailedError(f"ledger {self._uri}: moved past version {version}")
        return result

    def _append_checked(
        self,
        source: _Source,
        app_id: str,
        txn_version: int,
        after_version: int,
        *,
        held: pa.Array | None = None,
    ) -> CommitResult | None:
        """Append the rows no version after ``after_version`` added, at exactly the next version.

        Versions up to ``after_version`` are covered by the claim (Redis indexed
        them before it answered "new"), so only the keys later versions added can
        collide: they are read from just those versions' files. The append
        commits with no retry, so when another writer took the version it
        aimed at, the new versions are checked too and it tries again; Delta's
        put-if-absent commit makes check-then-commit atomic. ``None`` when
        the versions to check are gone from the log or more than
        ``_MAX_CHECKED_VERSIONS`` (the caller MERGEs instead) or there is no table.
        ``held``: keys known to be in the ledger already (never written).
        """
        checked = after_version
        seen: list[pa.Array] = [] if held is None or len(held) == 0 else [held]
        files: _StagedFiles | None = None  # staged rows written for an earlier attempt
        try:
            for _ in range(_APPEND_RACES):
                with self._table_lock:
                    table = self._latest()
                    if table is None:
                        return None
                    done = table.transaction_version(app_id)
                    if done is not None and done >= txn_version:
                        return CommitResult(version=None, inserted=0, replayed=True)
                    target = table.version()
                    if target - checked > _MAX_CHECKED_VERSIONS:
                        return None
                    if target > checked:
                        changed = self.keys_added_since(checked)
                        if changed is None or changed.version < target:
                            return None  # cannot read what came since: the caller MERGEs
                        since_keys = changed.keys.column("key").combine_chunks()
                        seen.append(since_keys)
                        checked = changed.version
                        if files is not None and files.holds_any(since_keys):
                            # A racing writer committed keys these files hold: write anew.
                            files.discard()
                            files = None
                    keys = source.keys
                    added = pa.concat_arrays(seen) if seen else None
                    present = (
                        pc.is_in(keys, value_set=added)
                        if added is not None
                        else pa.repeat(False, source.num_rows)
                    )
                    # Nothing since the claim (the usual case): no copy of the rows.
                    fresh = source.index.filter(pc.invert(present)) if seen else source.index
                    if files is None and source.streamed and _same_columns(source.schema, table):
                        files = self._write_staged(source, added, fresh)
                    try:
                        version = self._append(
                            table,
                            source,
                            files,
                            added=added,
                            fresh=fresh,
                            app_id=app_id,
                            txn_version=txn_version,
                        )
                    except CommitFailedError:
                        continue  # another writer took the version: check what it added
                    except BaseException:
                        # Whether the commit landed is not known: the files stay (once
                        # no version names them, vacuum removes them).
                        files = None
                        raise
                    files = None  # committed: they are the table's now
                self._added.remember_own(version, fresh)
                self._saw_version(version)
                already: list[str] = keys.filter(present).to_pylist()
                return CommitResult(
                    version=version, inserted=fresh.num_rows, already_present=already
                )
        finally:
            if files is not None:  # written, never committed
                files.discard()
        raise CommitFailedError(f"{_APPEND_RACES} appends in a row lost the race for a version")

    def _append(
        self,
        table: DeltaTable,
        source: _Source,
        files: _StagedFiles | None,
        *,
        added: pa.Array | None,
        fresh: pa.Table,
        app_id: str,
        txn_version: int,
    ) -> int:
        """Append ``files`` (else the rows) at the table's next version and return it, or
        raise :class:`CommitFailedError`."""
        if files is not None:
            # One try, no retry: the version read plus one (the handle is not moved to it).
            next_version = table.version() + 1
            files.commit_to(table, app_id, txn_version)
            return next_version
        # In memory the index is the rows; staged rows bringing new columns are
        # streamed to delta-rs, which evolves the table's schema with them.
        write_deltalake(
            table,
            source.data(excluding=added) if source.streamed else fresh,
            mode="append",
            writer_properties=WRITER_PROPERTIES,
            schema_mode=None if _same_columns(source.schema, table) else "merge",
            commit_properties=_commit_properties(app_id, txn_version),
        )
        # Written through the table object, it stands at our own commit's version.
        return table.version()

    def _write_staged(
        self, source: _Source, excluding: pa.Array | None, fresh: pa.Table
    ) -> _StagedFiles:
        """Write the staged rows whose key is not in ``excluding`` as the table's data files."""
        filesystem, root = _files.table_filesystem(self._uri, self._storage_options)
        actions, written, rows = _files.write_partitioned(
            filesystem,
            root,
            source.schema,
            source.stream(excluding),
            PARTITION_COLUMNS,
            undictionaried=_UNIQUE_COLUMNS,
        )
        if rows != fresh.num_rows:
            _files.delete_files(filesystem, written)
            raise LedgerError(
                f"staged rows: the files hold {rows} row(s) to commit where the ledger "
                f"columns name {fresh.num_rows} (were the staged files changed?)"
            )
        return _StagedFiles(
            actions=actions,
            written=written,
            keys=fresh.column("key"),
            schema=source.schema,
            filesystem=filesystem,
        )

    def _already_present(self, keys: pa.ChunkedArray, version: int) -> list[str]:
        """Source keys that our commit at ``version`` did not add (the ledger had them)."""
        try:
            entry = self._read_commit(version)
        except _log.HistoryGone as gone:
            raise LedgerError(f"ledger {self._uri}: {gone} vanished right after commit") from None
        return keys_not_added(self._store, self._uri, entry, keys)

    # -- reading what was missed -------------------------------------------------

    def column_types(self) -> pa.Schema | None:
        """The table's columns as Arrow types (``None`` while there is no table)."""
        table = self._table or self._latest()
        return None if table is None else pa.schema(table.schema().to_arrow())

    def keys_added_since(self, version: int) -> ChangedKeys | None:
        """Keys added by versions ``(version, current]``, from just the files they added.

        Compaction (``OPTIMIZE``) only rewrites keys already added, so its
        files are skipped. ``None`` when a needed commit file was cleaned from
        the log (or a data file vacuumed): the caller rebuilds from :meth:`window`.
        """
        if version < -1:
            raise LedgerError(f"version: {version} must be >= -1")
        current = self.version()
        try:
            keys, files_read = self._added.since(version, current)
        except _log.HistoryGone as gone:
            log.warning(
                "ledger %s: %s is gone; the keys added since version %d cannot be read "
                "incrementally",
                self._uri,
                gone,
                version,
            )
            return None
        return ChangedKeys(since_version=version, version=current, keys=keys, files_read=files_read)

    def _read_commit(self, version: int) -> _log.CommitEntry:
        return read_commit(self._store, self._uri, version)

    def _read_index_file(self, added: _log.AddedFile) -> pa.Table:
        return read_index_file(self._store, self._uri, added)

    # -- window, lookups, audit ------------------------------------------------------

    def window(self, since_ms: int, buckets: Iterable[int] | None = None) -> LedgerWindow:
        """Rows completed at or after ``since_ms``, reading only those days' partitions.

        ``buckets`` restricts the read to those bucket partitions. The result
        says which table version it read (``-1``: no table yet).
        """
        wanted = None if buckets is None else sorted({int(b) for b in buckets})
        if wanted == []:
            return LedgerWindow(self.version(), since_ms, INDEX_SCHEMA.empty_table())
        version, table = self._query(_sql.window_sql(since_ms, wanted))
        if table is None:
            return LedgerWindow(-1, since_ms, INDEX_SCHEMA.empty_table())
        return LedgerWindow(version, since_ms, to_index_rows(table))

    def existing(self, keys: Iterable[str], *, since_ms: int | None) -> dict[str, str]:
        """``key -> fingerprint`` of the keys the ledger holds (completed since ``since_ms``).

        A DataFusion join against a temporary probe table, never an ``IN``
        list. A key held twice answers with its earliest row.
        """
        found = self._probe(keys, since_ms, "fingerprint")
        return {key: value or "" for key, value in found.items()}

    def lookup_results(
        self, keys: Iterable[str], *, since_ms: int | None = None
    ) -> dict[str, str | None]:
        """``key -> result JSON`` of the keys present (``None`` when none was kept)."""
        return self._probe(keys, since_ms, "result")

    def owners(self, keys: Iterable[str], *, since_ms: int | None = None) -> dict[str, str]:
        """``key -> owner`` of the keys present (a replayed batch finds its own commits)."""
        return {k: v or "" for k, v in self._probe(keys, since_ms, "owner").items()}

    def _probe(
        self, keys: Iterable[str], since_ms: int | None, column: str
    ) -> dict[str, str | None]:
        wanted = pa.array(sorted(set(keys)), pa.string())
        if len(wanted) == 0:
            return {}
        try:
            with _sql.probe_table(wanted) as probe:
                _, rows = self._query(_sql.probe_sql(column, since_ms), probe=probe)
        except DeltaError as exc:
            raise LedgerError(f"ledger {self._uri}: key lookup failed: {exc}") from exc
        return {} if rows is None else _sql.earliest_by_key(rows)

    def audit(self, *, since_ms: int | None = None) -> list[tuple[str, int]]:
        """Keys present more than once (a narrow failover hole, or matches outside the window)."""
        _, rows = self._query(_sql.audit_sql(since_ms))
        if rows is None:
            return []
        pairs = zip(rows.column("key").to_pylist(), rows.column("n").to_pylist(), strict=True)
        return sorted((str(key), int(count)) for key, count in pairs)

    def _query(self, sql: str, *, probe: DeltaTable | None = None) -> tuple[int, pa.Table | None]:
        """Run ``sql`` over the current snapshot; ``(version read, rows)``, ``(-1, None)``
        without a table."""
        try:
            with self._table_lock:
                table = self._latest()
                if table is None:
                    return -1, None
                version = table.version()
            return version, _sql.run(table, sql, probe=probe)
        except ConfigError:
            raise
        except Exception as exc:  # DataFusion errors surface as plain Exception
            raise LedgerError(f"ledger {self._uri}: query failed: {exc}") from exc

    # -- maintenance ---------------------------------------------------------------

    def expire(self, older_than_ms: int, *, vacuum_retention_hours: int = 168) -> int:
        """Delete the days that ended at or before ``older_than_ms``, then vacuum.

        Whole ``completed_date`` partitions go (no file rewrite), so rows of
        the day containing ``older_than_ms`` stay. Returns the rows deleted.
        Vacuum removes unreferenced files older than ``vacuum_retention_hours``
        (keep it above the longest reader; the Delta default is 168).
        """
        if vacuum_retention_hours < 0:  # checked before anything is deleted
            raise ConfigError(
                f"vacuum_retention_hours: {vacuum_retention_hours} must be >= 0 (168 keeps "
                "the files readers on versions of the past week still need)"
            )
        cutoff = date_of_ms(older_than_ms).isoformat()

        def attempt() -> int:
            with self._table_lock:
                table = self._latest()
                if table is None:
                    return 0
                metrics = table.delete(f"completed_date < '{cutoff}'")
                table.vacuum(
                    retention_hours=vacuum_retention_hours,
                    dry_run=False,
                    enforce_retention_duration=vacuum_retention_hours >= 168,
                )
                self._saw_version(table.version())
                return int(metrics.get("num_deleted_rows", 0) or 0)

        return self._retrying(attempt, what=f"expire before {cutoff}")

    def compact(self, *, before_ms: int | None = None) -> CompactResult:
        """Merge the small files of the days before ``before_ms`` (default: before today).

        Today's files are left alone: each batch's own file has a narrow
        ``completed_at`` range, which is what lets a commit skip it.
        """
        cutoff = date_of_ms(self._clock.now_ms() if before_ms is None else before_ms)

        def attempt() -> CompactResult:
            with self._table_lock:
                table = self._latest()
                if table is None:
                    return CompactResult(0, 0)
                metrics = table.optimize.compact(
                    partition_filters=[("completed_date", "<", cutoff.isoformat())]
                )
                self._saw_version(table.version())
            return CompactResult(
                files_removed=int(metrics.get("numFilesRemoved", 0) or 0),
                files_added=int(metrics.get("numFilesAdded", 0) or 0),
            )

        return self._retrying(attempt, what="compact")

    # -- plumbing --------------------------------------------------------------------

    def _latest(self) -> DeltaTable | None:
        """The table handle brought up to date, ``None`` while there is no table."""
        if self._table is not None:
            self._table.update_incremental()
            return self._table
        try:
            table = DeltaTable(self._uri, storage_options=self._storage_options)
        except TableNotFoundError:
            return None
        self._check_identity(table)
        self._table = table
        return table

    def _check_identity(self, table: DeltaTable) -> None:
        """Refuse a table another engine writes, another group's ledger, or this group's
        with another bucket count."""
        metadata = table.metadata()
        check_ledger_table(
            self._uri,
            engine=ENGINE,
            description=metadata.description,
            properties=metadata.configuration,
            identity=self._identity,
        )

    def _create_with(self, source: _Source, app_id: str, txn_version: int) -> CommitResult:
        """Create the table with the first batch: one commit, version 0, so an index
        watermark at -1 (no table) moves to 0 with no gap of a data-less version."""
        files = None
        if source.streamed:
            files = self._write_staged(source, None, source.index)
        try:
            if files is not None:
                files.create_table(
                    self._uri,
                    description=describe_ledger(ENGINE, self._identity),
                    storage_options=self._storage_options,
                    commit_properties=_commit_properties(app_id, txn_version),
                )
            else:
                write_deltalake(
                    self._uri,
                    source.data(),
                    mode="error",
                    partition_by=list(PARTITION_COLUMNS),
                    writer_properties=WRITER_PROPERTIES,
                    name="idem_ledger",
                    description=describe_ledger(ENGINE, self._identity),
                    storage_options=self._storage_options,
                    # Losing the race for version 0 must fail, not become a blind append
                    # (delta-rs' own retry would do that): we retry as a MERGE instead.
                    commit_properties=_commit_properties(app_id, txn_version),
                )
        except DeltaError as exc:
            if files is not None:
                files.discard()  # no version 0 of ours names them
            if DeltaTable.is_deltatable(self._uri, self._storage_options):
                # Another writer created it first: go again, as a MERGE this time.
                raise CommitFailedError(f"the ledger was created concurrently: {exc}") from exc
            raise
        self._added.remember_own(0, source.index)  # mode="error" wrote version 0
        # Our commit is version 0 whatever others appended since (reading the table's
        # version now could name theirs).
        self._saw_version(0)
        return CommitResult(version=0, inserted=source.num_rows)

    def _saw_version(self, version: int) -> None:
        self._log.saw(version)

    def _retrying(self, fn: Callable[[], T], *, what: str) -> T:
        retrying = Retrying(
            stop=stop_after_attempt(self._max_attempts),
            wait=wait_random_exponential(multiplier=self._backoff_s, max=self._max_backoff_s),
            retry=retry_if_exception_type(CommitFailedError),
            sleep=self._clock.sleep,
        )
        try:
            return retrying(fn)
        except RetryError as exc:
            cause = exc.last_attempt.exception()
            raise LedgerConflict(
                f"ledger {self._uri}: {what} still conflicted with concurrent writers "
                f"after {self._max_attempts} attempts: {cause}"
            ) from cause
        except LedgerError:
            raise
        except (DeltaError, OSError, pa.ArrowException) as exc:
            raise LedgerError(f"ledger {self._uri}: {what} failed: {exc}") from exc


def _commit_properties(app_id: str, txn_version: int) -> CommitProperties:
    """The batch's txn, and one try at the next version: a lost race is ours to resolve
    (delta-rs' own retry would commit the rows blind)."""
    return CommitProperties(
        max_commit_retries=0, app_transactions=[Transaction(app_id, txn_version)]
    )


@dataclass(frozen=True)
class _StagedFiles:
    """Staged rows written as the table's data files (:mod:`idem.ledger._files`), not yet
    committed: :meth:`commit_to` names them in a version, :meth:`discard` deletes them."""

    actions: list[AddAction]
    written: list[str]
    keys: pa.ChunkedArray
    schema: pa.Schema
    filesystem: pafs.FileSystem

    def holds_any(self, keys: pa.Array) -> bool:
        """Whether any of ``keys`` is among the rows written (``keys`` is the small side:
        the keys another writer added meanwhile)."""
        if len(keys) == 0:
            return False
        return bool(pc.any(pc.is_in(self.keys, value_set=keys)).as_py())

    def commit_to(self, table: DeltaTable, app_id: str, txn_version: int) -> None:
        """Append the files at the table's next version, with the batch's txn, or raise
        :class:`CommitFailedError` when another writer took that version."""
        table.create_write_transaction(
            list[AddAction | RemoveAction](self.actions),
            mode="append",
            schema=table.schema(),
            partition_by=list(PARTITION_COLUMNS),
            commit_properties=_commit_properties(app_id, txn_version),
        )

    def create_table(
        self,
        uri: str,
        *,
        description: str,
        storage_options: dict[str, str] | None,
        commit_properties: CommitProperties,
    ) -> None:
        """Create the table at ``uri`` as version 0 holding the files."""
        create_table_with_add_actions(
            uri,
            Schema.from_arrow(self.schema),
            self.actions,
            mode="error",
            partition_by=list(PARTITION_COLUMNS),
            name="idem_ledger",
            description=description,
            storage_options=storage_options,
            commit_properties=commit_properties,
        )

    def discard(self) -> None:
        """Delete the files (no version names them)."""
        _files.delete_files(self.filesystem, self.written)


def _same_columns(schema: pa.Schema, table: DeltaTable) -> bool:
    """Whether the rows bring no column the table lacks (else the MERGE evolves the schema)."""
    known = {field.name for field in table.schema().fields}
    return all(name in known for name in schema.names)


def _int_or_none(value: Any) -> int | None:
    return None if value is None else int(value)


_STAMPED = ("completed_at", "completed_date")


@dataclass(frozen=True)
class _Source:
    """The rows of one commit: in memory, or streamed from staged files.

    ``index`` holds the conformed ledger columns of every row (for rows in
    memory, the rows themselves); the checks read only it. :meth:`data` is what
    the MERGE or append writes.
    """

    index: pa.Table
    schema: pa.Schema
    staged: StagedRows | None = None
    now_ms: int = 0

    @classmethod
    def in_memory(cls, rows: pa.Table) -> _Source:
        return cls(index=rows, schema=rows.schema)

    @classmethod
    def streaming(cls, staged: StagedRows, *, now_ms: int) -> _Source:
        """``staged`` stamped at its ``completed_at_ms`` (else ``now_ms``), one row per key."""
        at = now_ms if staged.completed_at_ms is None else staged.completed_at_ms
        index = _staged_index(staged.keys, at)
        repeated = _repeated(index.column("key"))
        if repeated:
            raise LedgerError(
                f"staged rows: {repeated} key(s) appear more than once (stage one row per key)"
            )
        schema = _stamped(staged.schema.empty_table(), at).schema
        return cls(index=index, schema=schema, staged=staged, now_ms=at)

    @property
    def streamed(self) -> bool:
        """Whether the rows are read from staged files as they are written."""
        return self.staged is not None

    @property
    def num_rows(self) -> int:
        return int(self.index.num_rows)

    @property
    def keys(self) -> pa.ChunkedArray:
        return self.index.column("key")

    def data(self, excluding: pa.Array | None = None) -> pa.Table | pa.RecordBatchReader:
        """The rows to write, without those whose key is in ``excluding``."""
        if self.staged is None:  # in memory: the index is the rows
            if excluding is None:
                return self.index
            return self.index.filter(pc.invert(pc.is_in(self.keys, value_set=excluding)))
        return pa.RecordBatchReader.from_batches(self.schema, self.stream(excluding))

    def stream(self, excluding: pa.Array | None = None) -> Iterator[pa.RecordBatch]:
        """The staged rows to write, batch by batch, without those whose key is in
        ``excluding`` (staged rows only)."""
        if self.staged is None:
            raise LedgerError("rows in memory are not streamed")
        return self._batches(self.staged, excluding)

    def _batches(self, staged: StagedRows, excluding: pa.Array | None) -> Iterator[pa.RecordBatch]:
        for batch in staged.batches():
            rows = _stamped(pa.Table.from_batches([batch]), self.now_ms)
            if excluding is not None:
                rows = rows.filter(pc.invert(pc.is_in(rows.column("key"), value_set=excluding)))
            yield from rows.cast(self.schema).to_batches()


_REPEAT_CHECK_ROWS = 64 * 1024


def _repeated(keys: pa.ChunkedArray) -> int:
    """How many of ``keys`` repeat another: the sorted keys compared with their neighbours a
    slice at a time (a hash table of every key held several times the keys' size)."""
    order = pc.sort_indices(keys)
    repeated = 0
    for start in range(0, len(keys) - 1, _REPEAT_CHECK_ROWS):
        window = keys.take(order.slice(start, _REPEAT_CHECK_ROWS + 1))
        same = pc.equal(window.slice(1), window.slice(0, len(window) - 1))
        repeated += int(pc.sum(same).as_py() or 0)
    return repeated


_STAGED_INDEX = pa.schema(
    [LEDGER_SCHEMA.field(name) for name in ("bucket", "key", "fingerprint", "completed_at")]
)
"""What a commit of staged rows holds of each: its checks and the keys it added read these."""


def _staged_index(keys: pa.Table, now_ms: int) -> pa.Table:
    """The :data:`_STAGED_INDEX` columns of staged rows' ledger columns ``keys``, every row
    completed at ``now_ms``.

    The other ledger columns are read from the files as the rows are written, so
    none is built here: for a batch of millions of rows each would cost the
    committing process a column's worth of memory.
    """
    require_columns(keys, ("bucket", "key"), what="staged rows")
    at = pa.scalar(datetime_of_ms(now_ms), type=pa.timestamp("us", tz="UTC"))
    if "completed_at" in keys.column_names:
        keys = keys.drop_columns(["completed_at"])  # every row is completed now
    columns = [conformed_column(keys, field, now=at, what="staged rows") for field in _STAGED_INDEX]
    return pa.Table.from_arrays(columns, schema=_STAGED_INDEX)


def _stamped(rows: pa.Table, now_ms: int) -> pa.Table:
    """``rows`` conformed to the ledger's columns, every row completed at ``now_ms``."""
    kept = [n for n in rows.column_names if n not in _STAMPED]
    return conform(rows.select(kept), now_ms=now_ms)
