"""A commit's data files written by idem itself, streaming, into the table's partitions.

delta-rs' writer keeps each partition's file in memory until it closes it (at
its target size, or at the end of the input). A ledger is partitioned by
``bucket`` and ``completed_date``, so a big batch spread over every bucket would
be held almost whole by the committing process. Rows staged as files
(:class:`idem.ledger.staged.StagedRows`) are therefore written here instead:
one Parquet writer per partition, the rows of every partition buffered up to
one shared bound and flushed as row groups, each file closed at a target size.
Files go where Delta puts them (``bucket=<b>/completed_date=<d>/part-....parquet``,
the partition columns in the path, not in the file), and each comes back as an
:class:`~deltalake.transaction.AddAction` with the statistics Delta readers
prune by (``numRecords``, ``minValues``, ``maxValues``, ``nullCount``): a key
lookup or a MERGE restricted to recent rows skips the files whose ranges miss.

The caller commits the actions (one transaction). Files whose commit never
lands are in no version of the table: readers never see them, and ``vacuum``
removes them; the caller deletes those it knows it will not commit.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake.fs import DeltaStorageHandler
from deltalake.transaction import AddAction

from idem.ledger import _log

log = logging.getLogger(__name__)

BUFFER_BYTES = 32 * 1024 * 1024
"""Rows held, over every partition, before the largest partition's are written out."""

TARGET_FILE_BYTES = 128 * 1024 * 1024
"""A partition's file is closed, and the next one begun, once it is this big."""

MAX_STRING_STAT = 64
"""Longer strings get no min/max (a file's range on them would say little, and cost a lot)."""


def table_filesystem(
    uri: str, storage_options: dict[str, str] | None
) -> tuple[pafs.FileSystem, str]:
    """The filesystem of the table at ``uri`` and the table's root on it.

    A local table is written through the local filesystem (files stream to disk);
    an object store through delta-rs' own storage handler, with the same options
    (credentials) as the table.
    """
    if _log.is_local(uri):
        return pafs.LocalFileSystem(), _log.local_path(uri).rstrip("/")
    return pafs.PyFileSystem(DeltaStorageHandler(uri, storage_options)), ""


@dataclass
class _Stats:
    """What a file's ``stats`` record: its rows, and each column's range and nulls."""

    rows: int = 0
    mins: dict[str, Any] = field(default_factory=dict)
    maxes: dict[str, Any] = field(default_factory=dict)
    nulls: dict[str, int] = field(default_factory=dict)
    unranged: set[str] = field(default_factory=set)

    def add(self, rows: pa.Table) -> None:
        self.rows += rows.num_rows
        for name, column in zip(rows.column_names, rows.columns, strict=True):
            if not _plain_type(column.type):
                continue
            self.nulls[name] = self.nulls.get(name, 0) + column.null_count
            if name in self.unranged or not _ranged_type(column.type):
                continue
            low, high = _range(column)
            if low is None or high is None:
                if column.null_count < len(column):  # values without a usable range
                    self.unranged.add(name)
                    self.mins.pop(name, None)
                    self.maxes.pop(name, None)
                continue
            self.mins[name] = low if name not in self.mins else min(self.mins[name], low)
            self.maxes[name] = high if name not in self.maxes else max(self.maxes[name], high)

    def json(self) -> str:
        """The ``stats`` string of the file's add action."""
        return json.dumps(
            {
                "numRecords": self.rows,
                "minValues": {k: _stat_value(v, up=False) for k, v in self.mins.items()},
                "maxValues": {k: _stat_value(v, up=True) for k, v in self.maxes.items()},
                "nullCount": self.nulls,
            }
        )


def _plain_type(kind: pa.DataType) -> bool:
    return not pa.types.is_nested(kind)


def _ranged_type(kind: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(kind)
        or pa.types.is_floating(kind)
        or pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_date32(kind)
        or pa.types.is_timestamp(kind)
    )


def _range(column: pa.ChunkedArray) -> tuple[Any, Any]:
    """The column's min and max as Python values; ``(None, None)`` when it has none usable."""
    if column.null_count == len(column):
        return None, None
    found = pc.min_max(column)
    low, high = found["min"].as_py(), found["max"].as_py()
    if isinstance(low, float) and not (math.isfinite(low) and math.isfinite(high)):
        return None, None  # NaN or an infinity: JSON has no such number
    if isinstance(low, str) and max(len(low), len(high)) > MAX_STRING_STAT:
        return None, None
    return low, high


def _stat_value(value: Any, *, up: bool) -> Any:
    """``value`` as Delta writes it in stats: times at millisecond precision, rounded
    outwards so the range still holds every value."""
    if isinstance(value, dt.datetime):
        value = value.astimezone(dt.UTC)
        ms = value.replace(microsecond=value.microsecond // 1000 * 1000)
        if up and ms != value:
            ms += dt.timedelta(milliseconds=1)
        return ms.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms.microsecond // 1000:03d}Z"
    if isinstance(value, dt.date):
        return value.isoformat()
    return value


def _partition_value(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dt.date):
        return value.isoformat()
    return str(value)


class _PartitionFile:
    """One partition's file being written: its buffer, its writer, its stats."""

    def __init__(self, writer: PartitionedWriter, values: dict[str, str | None]) -> None:
        self._owner = writer
        self.values = values
        self.buffered: list[pa.Table] = []
        self.buffered_bytes = 0
        self._writer: pq.ParquetWriter | None = None
        self._stream: Any = None
        self._path = ""
        self._stats = _Stats()

    def flush(self) -> None:
        """Write the buffered rows as one row group (opening a file if none is open)."""
        if not self.buffered:
            return
        rows = pa.concat_tables(self.buffered)
        self.buffered, self.buffered_bytes = [], 0
        if self._writer is None:
            self._open()
        assert self._writer is not None
        self._writer.write_table(rows, row_group_size=rows.num_rows)
        self._stats.add(rows)
        if self._stream.tell() >= self._owner.target_file_bytes:
            self.close()

    def _open(self) -> None:
        owner = self._owner
        directory = "/".join(
            f"{k}={'__HIVE_DEFAULT_PARTITION__' if v is None else v}"
            for k, v in self.values.items()
        )
        name = f"part-{len(owner.actions):05d}-{uuid.uuid4()}-c000.snappy.parquet"
        self._path = f"{directory}/{name}"
        full = f"{owner.root}/{self._path}" if owner.root else self._path
        if owner.root:
            owner.filesystem.create_dir(f"{owner.root}/{directory}", recursive=True)
        self._stream = owner.filesystem.open_output_stream(full)
        owner.written.append(full)
        self._writer = pq.ParquetWriter(
            self._stream,
            owner.file_schema,
            compression="snappy",
            use_dictionary=owner.dictionary_columns,
        )
        self._stats = _Stats()

    def close(self) -> None:
        """Close the open file (if any) and record its add action."""
        if self._writer is None:
            return
        self._writer.close()
        size = int(self._stream.tell())
        self._stream.close()
        self._writer, self._stream = None, None
        owner = self._owner
        owner.actions.append(
            AddAction(
                path=self._path,
                size=size,
                partition_values=self.values,
                modification_time=int(time.time() * 1000),
                data_change=True,
                stats=self._stats.json(),
            )
        )


class PartitionedWriter:
    """Writes rows into a Delta table's partition directories as new data files.

    Args:
        filesystem: The table's filesystem (:func:`table_filesystem`).
        root: The table's root on ``filesystem`` (``""``: the filesystem is the table's).
        schema: The rows' schema, partition columns included.
        partition_by: The table's partition columns, outermost first.
        undictionaried: Columns written without a dictionary (their values are
            nearly all different).
        buffer_bytes: Rows held over every partition before the largest buffer is
            written (default :data:`BUFFER_BYTES`).
        target_file_bytes: The size at which a partition's file is closed (default
            :data:`TARGET_FILE_BYTES`).

    :meth:`write` each batch, then :meth:`finish` for the add actions; on an error,
    :meth:`discard` deletes what was written.
    """

    def __init__(
        self,
        filesystem: pafs.FileSystem,
        root: str,
        schema: pa.Schema,
        partition_by: Sequence[str],
        *,
        undictionaried: Iterable[str] = (),
        buffer_bytes: int | None = None,
        target_file_bytes: int | None = None,
    ) -> None:
        self.filesystem = filesystem
        self.root = root.rstrip("/")
        self.partition_by = list(partition_by)
        self.file_schema = pa.schema([f for f in schema if f.name not in self.partition_by])
        plain = set(undictionaried)
        self.dictionary_columns = [n for n in self.file_schema.names if n not in plain]
        self.buffer_bytes = BUFFER_BYTES if buffer_bytes is None else buffer_bytes
        self.target_file_bytes = (
            TARGET_FILE_BYTES if target_file_bytes is None else target_file_bytes
        )
        self.actions: list[AddAction] = []
        self.written: list[str] = []
        self.rows = 0
        self._partitions: dict[tuple[Any, ...], _PartitionFile] = {}
        self._buffered = 0

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        """Route ``batch``'s rows to their partitions' buffers, writing out as the bound asks."""
        rows = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
        if rows.num_rows == 0:
            return
        self.rows += rows.num_rows
        groups = rows.group_by(self.partition_by, use_threads=False).aggregate([])
        data = rows.select(self.file_schema.names)
        for i in range(groups.num_rows):
            values = tuple(groups.column(name)[i].as_py() for name in self.partition_by)
            mask = _partition_mask(rows, self.partition_by, values)
            part = data.filter(mask) if groups.num_rows > 1 else data
            partition = self._partitions.get(values)
            if partition is None:
                named = {
                    n: _partition_value(v) for n, v in zip(self.partition_by, values, strict=True)
                }
                partition = self._partitions[values] = _PartitionFile(self, named)
            partition.buffered.append(part)
            partition.buffered_bytes += part.nbytes
            self._buffered += part.nbytes
        while self._buffered > self.buffer_bytes:
            largest = max(self._partitions.values(), key=lambda p: p.buffered_bytes)
            self._buffered -= largest.buffered_bytes
            largest.flush()

    def finish(self) -> list[AddAction]:
        """Write what is buffered, close every file; the add actions of the files written."""
        for partition in self._partitions.values():
            partition.flush()
            partition.close()
        self._buffered = 0
        return list(self.actions)

    def discard(self) -> None:
        """Delete every file written (they were never committed)."""
        for partition in self._partitions.values():
            partition.buffered = []
            with contextlib.suppress(OSError, pa.ArrowException):
                partition.close()
        delete_files(self.filesystem, self.written)


def delete_files(filesystem: pafs.FileSystem, paths: Iterable[str]) -> None:
    """Delete files that no version of the table names (best effort: ``vacuum`` removes
    what is left)."""
    for path in paths:
        try:
            filesystem.delete_file(path)
        except OSError as exc:
            log.warning("ledger: cannot remove uncommitted data file %s: %s", path, exc)


def _partition_mask(rows: pa.Table, names: Sequence[str], values: tuple[Any, ...]) -> pa.Array:
    mask: Any = None
    for name, value in zip(names, values, strict=True):
        column = rows.column(name)
        test = (
            pc.is_null(column) if value is None else pc.equal(column, pa.scalar(value, column.type))
        )
        mask = test if mask is None else pc.and_(mask, test)
    return mask


def write_partitioned(
    filesystem: pafs.FileSystem,
    root: str,
    schema: pa.Schema,
    batches: Iterable[pa.RecordBatch],
    partition_by: Sequence[str],
    *,
    undictionaried: Iterable[str] = (),
) -> tuple[list[AddAction], list[str], int]:
    """Write every batch into the table's partitions: ``(add actions, files written, rows)``.

    On an error the files written so far are deleted and the error is raised.
    """
    writer = PartitionedWriter(
        filesystem, root, schema, partition_by, undictionaried=undictionaried
    )
    try:
        for batch in batches:
            writer.write(batch)
        actions = writer.finish()
    except BaseException:
        writer.discard()
        raise
    return actions, list(writer.written), writer.rows
