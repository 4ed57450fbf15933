"""What recent ledger versions added, remembered between reads.

Two readers ask for the keys of the same recent versions again and again: the
checked append (each commit of a writer checks the versions committed since its
claim) and the Redis catch-up (each instance's claim loads the versions it
missed). With several writers on one ledger that was one parquet read per
bucket file per version per ask, most of it under the group's commit lock.

Commit files and data files never change once written, so both are kept here
(bounded); and a version this process appended itself is known without reading
anything: it holds exactly the rows that were appended.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from idem.errors import LedgerError
from idem.ledger import _log
from idem.ledger.schema import INDEX_SCHEMA, to_index_rows

SKIPPED_OPERATIONS = frozenset({"OPTIMIZE", "VACUUM START", "VACUUM END"})
"""Operations that add no keys (compaction rewrites keys already added)."""

_INDEX_COLUMNS = ("bucket", "key", "fingerprint", "completed_at")
_INDEX_FILE_COLUMNS = ("key", "fingerprint", "completed_at")

DEFAULT_MAX_ROWS = 500_000
"""Index rows kept of the data files read, and as many of own appends (~50 MB each)."""

DEFAULT_MAX_VERSIONS = 256
"""Commit entries kept, counted back from the newest version asked for."""


class AddedKeys:
    """The index rows each recent version added, from memory when possible.

    ``read_commit(version)`` and ``read_file(added)`` read the log and one data
    file (as :data:`~idem.ledger.schema.INDEX_SCHEMA`); both may raise, and
    :meth:`since` lets their errors through.
    """

    def __init__(
        self,
        read_commit: Callable[[int], _log.CommitEntry],
        read_file: Callable[[_log.AddedFile], pa.Table],
        *,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_versions: int = DEFAULT_MAX_VERSIONS,
    ) -> None:
        self._read_commit = read_commit
        self._read_file = read_file
        self.max_rows = max_rows
        self.max_versions = max_versions
        self._lock = threading.Lock()
        self._entries: dict[int, _log.CommitEntry] = {}
        self._own: OrderedDict[int, pa.Table] = OrderedDict()
        self._own_rows = 0
        self._files: OrderedDict[str, pa.Table] = OrderedDict()
        self._file_rows = 0

    def remember_own(self, version: int, rows: pa.Table) -> None:
        """``version`` is this process's append of exactly ``rows`` (ledger columns)."""
        kept = rows.select(list(_INDEX_COLUMNS))  # drops payload columns, copies nothing
        with self._lock:
            if version in self._own:
                return
            self._own[version] = kept
            self._own_rows += kept.num_rows
            while self._own_rows > self.max_rows and len(self._own) > 1:
                _, dropped = self._own.popitem(last=False)
                self._own_rows -= dropped.num_rows

    def since(self, version: int, current: int) -> tuple[pa.Table, int]:
        """Index rows added by versions ``(version, current]``, and the data files read."""
        owned: dict[int, pa.Table] = {}
        entries: list[_log.CommitEntry] = []
        for v in range(version + 1, current + 1):
            with self._lock:
                own = self._own.get(v)
            if own is not None:
                owned[v] = own
            else:
                entries.append(self._entry(v))
        removes = any(e.removed for e in entries if e.operation not in SKIPPED_OPERATIONS)
        if removes:
            # A file added in the range may be removed again later in it (expire):
            # follow the log's file arithmetic exactly, own versions included.
            entries = [self._entry(v) for v in range(version + 1, current + 1)]
            owned = {}
        files: dict[str, _log.AddedFile] = {}
        for entry in entries:
            if entry.operation in SKIPPED_OPERATIONS:
                continue
            for removed in entry.removed:
                files.pop(removed, None)
            for added in entry.added:
                if added.data_change:
                    files[added.path] = added
        tables = [self._own_index_rows(v, rows) for v, rows in owned.items()]
        read = 0
        for added in files.values():
            table, was_read = self._file(added)
            tables.append(table)
            read += was_read
        self._forget_before(current - self.max_versions)
        keys = pa.concat_tables(tables) if tables else INDEX_SCHEMA.empty_table()
        return keys, read

    def _own_index_rows(self, version: int, rows: pa.Table) -> pa.Table:
        if rows.schema.equals(INDEX_SCHEMA):
            return rows
        converted = to_index_rows(rows)
        with self._lock:
            if version in self._own:
                self._own[version] = converted
        return converted

    def _entry(self, version: int) -> _log.CommitEntry:
        with self._lock:
            entry = self._entries.get(version)
        if entry is None:
            entry = self._read_commit(version)
            with self._lock:
                self._entries[version] = entry
        return entry

    def _file(self, added: _log.AddedFile) -> tuple[pa.Table, bool]:
        with self._lock:
            table = self._files.get(added.path)
            if table is not None:
                self._files.move_to_end(added.path)
                return table, False
        table = self._read_file(added)
        with self._lock:
            if added.path not in self._files:
                self._files[added.path] = table
                self._file_rows += table.num_rows
            while self._file_rows > self.max_rows and len(self._files) > 1:
                _, dropped = self._files.popitem(last=False)
                self._file_rows -= dropped.num_rows
        return table, True

    def _forget_before(self, version: int) -> None:
        with self._lock:
            for old in [v for v in self._entries if v <= version]:
                del self._entries[old]


def read_commit(store: _log.LogStore, uri: str, version: int) -> _log.CommitEntry:
    """Commit ``version`` of the table at ``uri``; :class:`~idem.ledger._log.HistoryGone`
    when its file was cleaned up, :class:`LedgerError` when it cannot be read."""
    try:
        data = store.read_bytes(_log.commit_name(version))
    except FileNotFoundError:
        raise _log.HistoryGone(f"commit {version}") from None
    except OSError as exc:
        raise LedgerError(f"ledger {uri}: cannot read commit {version}: {exc}") from exc
    return _log.parse_commit(version, data)


def read_index_file(store: _log.LogStore, uri: str, added: _log.AddedFile) -> pa.Table:
    """The index rows of one data file (bucket from its partition value);
    :class:`~idem.ledger._log.HistoryGone` when it was vacuumed."""
    try:
        data = store.read_parquet(added.path, _INDEX_FILE_COLUMNS)
    except FileNotFoundError:
        raise _log.HistoryGone(f"data file {added.path}") from None
    except (OSError, pa.ArrowException) as exc:
        raise LedgerError(f"ledger {uri}: cannot read {added.path}: {exc}") from exc
    bucket = added.partition_values.get("bucket")
    if bucket is None:
        raise LedgerError(f"ledger {uri}: file {added.path} has no bucket partition")
    column = pa.array([int(bucket)] * data.num_rows, pa.int32())
    return to_index_rows(data.append_column("bucket", column))


def keys_not_added(
    store: _log.LogStore, uri: str, entry: _log.CommitEntry, offered: pa.ChunkedArray
) -> list[str]:
    """The ``offered`` keys that commit ``entry`` did not add (the ledger had them)."""
    try:
        files = [store.read_parquet(f.path, ["key"]) for f in entry.added if f.data_change]
    except FileNotFoundError as gone:
        raise LedgerError(f"ledger {uri}: {gone} vanished right after commit") from None
    except (OSError, pa.ArrowException) as exc:
        raise LedgerError(f"ledger {uri}: cannot read commit {entry.version}: {exc}") from exc
    inserted = pa.chunked_array(
        [chunk.cast(pa.string()) for table in files for chunk in table.column("key").chunks],
        type=pa.string(),
    )
    mask = pc.invert(pc.is_in(offered, value_set=inserted.combine_chunks()))
    return offered.filter(mask).to_pylist()  # type: ignore[no-any-return]
