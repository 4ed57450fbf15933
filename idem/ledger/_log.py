"""Direct reads of a Delta table's transaction log and data files.

delta-rs answers "what is the table now"; the dedup layer also needs "what did
versions ``(v, current]`` add" and "is there a version after ``v``" without
loading the whole table state. Both are plain reads of ``_delta_log/<n>.json``
(the Delta protocol), so they are done here: with the OS for local tables and
through delta-rs' object-store handler for the rest.

Data files are read without pyarrow's dataset layer over a Python filesystem
(``DeltaTable.to_pyarrow_dataset``), which can abort the interpreter at exit
(delta-rs #2184, arrow #34314).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake.fs import DeltaStorageHandler
from pyarrow.fs import FileSelector, FileType

LOG_DIR = "_delta_log"


def commit_name(version: int) -> str:
    """``_delta_log/00000000000000000042.json``."""
    return f"{LOG_DIR}/{version:020d}.json"


def is_local(uri: str) -> bool:
    """True for plain paths and ``file://`` URIs."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")


def local_path(uri: str) -> str:
    """The absolute filesystem path of a local table URI."""
    if uri.startswith("file://"):
        uri = unquote(urlparse(uri).path)
    return str(Path(uri).absolute())


@dataclass(frozen=True)
class AddedFile:
    """One ``add`` action of a commit."""

    path: str
    partition_values: dict[str, str | None]
    data_change: bool


@dataclass(frozen=True)
class CommitEntry:
    """The actions of one commit that the ledger cares about.

    ``transactions`` maps each ``txn`` action's ``appId`` to its version;
    ``user_metadata`` and ``metrics`` come from ``commitInfo`` (``userMetadata``,
    ``operationMetrics``; delta-spark writes both, delta-rs neither).
    """

    version: int
    operation: str | None
    added: list[AddedFile]
    removed: list[str]
    transactions: dict[str, int] = field(default_factory=dict)
    user_metadata: str | None = None
    metrics: dict[str, str] = field(default_factory=dict)
    metadata: TableMetadata | None = None


@dataclass(frozen=True)
class TableMetadata:
    """A table's ``metaData`` action: what the ledger checks and its columns."""

    description: str | None
    configuration: dict[str, str]
    schema_string: str | None


class HistoryGone(Exception):
    """A commit or data file needed for an incremental read was cleaned up."""


def parse_commit(version: int, data: bytes) -> CommitEntry:
    """Parse a commit JSON (one action per line)."""
    operation: str | None = None
    added: list[AddedFile] = []
    removed: list[str] = []
    transactions: dict[str, int] = {}
    user_metadata: str | None = None
    metrics: dict[str, str] = {}
    metadata: TableMetadata | None = None
    for line in data.splitlines():
        if not line.strip():
            continue
        action: dict[str, Any] = json.loads(line)
        if "add" in action:
            add = action["add"]
            added.append(
                AddedFile(
                    path=add["path"],
                    partition_values=dict(add.get("partitionValues") or {}),
                    data_change=bool(add.get("dataChange", True)),
                )
            )
        elif "remove" in action:
            removed.append(action["remove"]["path"])
        elif "metaData" in action:
            metadata = _metadata(action["metaData"])
        elif "txn" in action:
            transactions[str(action["txn"]["appId"])] = int(action["txn"]["version"])
        elif "commitInfo" in action:
            info = action["commitInfo"]
            operation = info.get("operation")
            user_metadata = info.get("userMetadata")
            metrics = {str(k): str(v) for k, v in (info.get("operationMetrics") or {}).items()}
    return CommitEntry(
        version=version,
        operation=operation,
        added=added,
        removed=removed,
        transactions=transactions,
        user_metadata=user_metadata,
        metrics=metrics,
        metadata=metadata,
    )


def _metadata(action: dict[str, Any]) -> TableMetadata:
    configuration = action.get("configuration") or {}
    if isinstance(configuration, list):  # a map column of a checkpoint: (key, value) pairs
        configuration = dict(configuration)
    return TableMetadata(
        description=action.get("description"),
        configuration={str(k): str(v) for k, v in configuration.items()},
        schema_string=action.get("schemaString"),
    )


def latest_metadata(store: LogStore, version: int) -> TableMetadata | None:
    """The table's ``metaData`` as of ``version``: the newest commit back to the last
    checkpoint that carries one, else the checkpoint's (``None``: not found this way,
    e.g. a multi-part checkpoint)."""
    checkpoint = checkpoint_hint(store)
    floor = checkpoint if 0 <= checkpoint <= version else -1
    for past in range(version, floor, -1):
        try:
            entry = parse_commit(past, store.read_bytes(commit_name(past)))
        except FileNotFoundError:
            break
        if entry.metadata is not None:
            return entry.metadata
    if floor < 0:
        return None
    try:
        actions = store.read_parquet(f"{LOG_DIR}/{floor:020d}.checkpoint.parquet", ["metaData"])
    except FileNotFoundError:
        return None
    for found in actions.column("metaData").to_pylist():
        if found:
            return _metadata(found)
    return None


class LogStore(Protocol):
    """The few storage calls the log reader needs, relative to the table root."""

    def exists(self, relative: str) -> bool:
        """Whether the file exists."""
        ...

    def read_bytes(self, relative: str) -> bytes:
        """The whole file; ``FileNotFoundError`` when it is missing."""
        ...

    def list_log(self) -> list[str]:
        """File names in ``_delta_log`` (empty when there is none)."""
        ...

    def read_parquet(self, relative: str, columns: Sequence[str]) -> pa.Table:
        """Some columns of a data file; ``FileNotFoundError`` when it is missing."""
        ...


class LocalLogStore:
    """A table on the local filesystem: ``stat`` and ``open``, nothing else."""

    def __init__(self, root: str) -> None:
        self.root = Path(root)

    def _full(self, relative: str) -> Path:
        if relative.startswith("file://"):
            return Path(local_path(relative))
        return self.root / unquote(relative)

    def exists(self, relative: str) -> bool:
        """Whether the file exists (one ``stat``)."""
        return self._full(relative).exists()

    def read_bytes(self, relative: str) -> bytes:
        """The whole file."""
        return self._full(relative).read_bytes()

    def list_log(self) -> list[str]:
        """File names in ``_delta_log``."""
        try:
            return [entry.name for entry in (self.root / LOG_DIR).iterdir()]
        except FileNotFoundError:
            return []

    def read_parquet(self, relative: str, columns: Sequence[str]) -> pa.Table:
        """Some columns of a data file (``ParquetFile``: no dataset layer, ~2x faster
        than ``read_table`` for the small files of one commit)."""
        with pq.ParquetFile(str(self._full(relative))) as data:
            return data.read(columns=list(columns))


class ObjectLogStore:
    """A table on an object store, through delta-rs' storage handler (same credentials)."""

    def __init__(self, uri: str, storage_options: dict[str, str] | None) -> None:
        self._handler = DeltaStorageHandler(uri, storage_options)

    def exists(self, relative: str) -> bool:
        """Whether the object exists (one HEAD)."""
        info = self._handler.get_file_info([unquote(relative)])[0]
        return bool(info.type != FileType.NotFound)

    def read_bytes(self, relative: str) -> bytes:
        """The whole object."""
        relative = unquote(relative)
        if not self.exists(relative):
            raise FileNotFoundError(relative)
        data: bytes = self._handler.open_input_file(relative).read()
        return data

    def list_log(self) -> list[str]:
        """Object names under ``_delta_log/``."""
        infos = self._handler.get_file_info_selector(
            FileSelector(LOG_DIR, allow_not_found=True, recursive=False)
        )
        return [info.base_name for info in infos]

    def read_parquet(self, relative: str, columns: Sequence[str]) -> pa.Table:
        """Some columns of a data file, fetched whole into memory then decoded."""
        return pq.read_table(pa.BufferReader(self.read_bytes(relative)), columns=list(columns))


def open_log_store(uri: str, storage_options: dict[str, str] | None) -> LogStore:
    """The right store for a table URI."""
    if is_local(uri):
        return LocalLogStore(local_path(uri))
    return ObjectLogStore(uri, storage_options)


def checkpoint_hint(store: LogStore) -> int:
    """The version of ``_delta_log/_last_checkpoint``, or ``-1`` without one."""
    try:
        data = store.read_bytes(f"{LOG_DIR}/_last_checkpoint")
    except (FileNotFoundError, OSError):
        return -1
    try:
        return int(json.loads(data)["version"])
    except (ValueError, KeyError, TypeError):
        return -1


def latest_commit_listed(names: Iterable[str]) -> int:
    """The highest commit version among ``_delta_log`` file names, ``-1`` if none."""
    versions = [int(name[:20]) for name in names if name.endswith(".json") and name[:20].isdigit()]
    return max(versions, default=-1)


REVERIFY_AFTER_MS = 60_000
"""A remembered table version older than this is checked to still be in the log."""


class LogVersion:
    """A table's current version from its log alone: one existence check of the next
    commit file per call in the steady state (plus one per commit since the last call).

    Thread-safe. ``now_ms`` is the clock that ages the remembered version.
    """

    def __init__(self, store: LogStore, now_ms: Callable[[], int], uri: str) -> None:
        self._store = store
        self._now_ms = now_ms
        self._uri = uri
        self._lock = threading.Lock()
        self._known = -1
        self._read_ms = now_ms()

    def read(self) -> int:
        """The latest version, ``-1`` without a table; :class:`OSError` when the log is
        unreadable."""
        with self._lock:
            version = self._known
            # Log cleanup may have removed the commits after the one remembered (a
            # process idle past the log retention): walking on from it would stop
            # there for good. Its own file tells.
            stale = version >= 0 and self._now_ms() - self._read_ms > REVERIFY_AFTER_MS
            if stale and not self._store.exists(commit_name(version)):
                version = -1
            if version < 0:
                version = max(version, checkpoint_hint(self._store))
            while self._store.exists(commit_name(version + 1)):
                version += 1
            if version < 0:
                # History cleaned without a _last_checkpoint file: list once.
                version = latest_commit_listed(self._store.list_log())
            self._known = version
            self._read_ms = self._now_ms()
            return version

    def saw(self, version: int) -> None:
        """``version`` exists (this process just committed it)."""
        with self._lock:
            self._known = max(self._known, version)
