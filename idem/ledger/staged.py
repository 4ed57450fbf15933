"""Rows a ledger commit reads as a stream: their ledger columns in memory, all columns in files.

A Delta sink that is its own ledger commits the user's columns with the ledger's.
When those rows are too many for one process's memory, the writers (Spark's
executors) stage them as Parquet files and the committing process holds only
the ledger columns (key, bucket, fingerprint, message ids): :class:`StagedRows`.
The commit reads the files batch by batch as it writes the rows out, and
decides with the ledger columns alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from idem.errors import LedgerError

_STAMPED = ("completed_at", "completed_date")
"""The columns a commit stamps (the date is derived from the instant)."""

Opener = Callable[[], pa.RecordBatchReader]
"""Opens a fresh reader over every staged row (called once per commit attempt)."""


@dataclass(frozen=True)
class StagedRows:
    """Rows of a commit kept in files, their ledger columns in memory.

    Args:
        keys: The ledger columns the commit decides with, one row per staged row,
            in any order: ``bucket`` and ``key``, and ``fingerprint`` (absent:
            ``""``); never the user's payload. Other columns are ignored: the
            files hold every ledger column the table gets. Each key appears once
            (a commit refuses repeated keys: it could not tell which of the staged
            copies is the first).
        schema: The schema of the staged rows (ledger columns and the user's).
        open: Opens a reader over every staged row, every column; it must yield
            the same rows each time it is called.
        completed_at_ms: The instant every row is stamped with when committed
            (``completed_at`` and ``completed_date``, whatever the files hold);
            ``None``: the ledger clock's now.
        only_keys: When set, the rows of just these keys are read.
    """

    keys: pa.Table
    schema: pa.Schema
    open: Opener
    completed_at_ms: int | None = None
    only_keys: pa.Array | None = None

    @property
    def num_rows(self) -> int:
        """How many rows are staged (counted from the ledger columns)."""
        return int(self.keys.num_rows)

    def only(self, keys: Sequence[str]) -> StagedRows:
        """The staged rows of ``keys`` alone (their files are read and filtered)."""
        wanted = pa.array(list(keys), pa.string())
        if self.only_keys is not None:
            wanted = wanted.filter(pc.is_in(wanted, value_set=self.only_keys))
        kept = self.keys.filter(pc.is_in(self.keys.column("key"), value_set=wanted))
        return dataclasses.replace(self, keys=kept, only_keys=wanted)

    def with_ledger_columns(self, keys: pa.Table, *, completed_at_ms: int) -> StagedRows:
        """The same staged rows, described by ``keys`` and stamped ``completed_at_ms``."""
        if keys.num_rows != self.num_rows:
            raise LedgerError(f"staged rows: {keys.num_rows} ledger rows for {self.num_rows}")
        return dataclasses.replace(self, keys=keys, completed_at_ms=completed_at_ms)

    def batches(self) -> Iterator[pa.RecordBatch]:
        """Every staged row (or those of :attr:`only_keys`), batch by batch."""
        with self.open() as reader:
            for read in reader:
                batch = read
                if self.only_keys is not None:
                    batch = read.filter(pc.is_in(read.column("key"), value_set=self.only_keys))
                if batch.num_rows:
                    yield batch

    def read_all(self) -> pa.Table:
        """Every staged row in memory, stamped :attr:`completed_at_ms` when it is set (for an
        engine that cannot stream them)."""
        rows = pa.Table.from_batches(list(self.batches()), schema=self.schema)
        if self.completed_at_ms is None:
            return rows
        rows = rows.select([n for n in rows.column_names if n not in _STAMPED])
        at = pa.scalar(self.completed_at_ms * 1000, pa.timestamp("us", tz="UTC"))
        return rows.append_column("completed_at", pa.repeat(at, rows.num_rows))


_READ_BATCH_ROWS = 64 * 1024
_READ_BUFFER_BYTES = 1024 * 1024


def parquet_opener(
    files: Sequence[str], schema: pa.Schema, filesystem: pafs.FileSystem | None = None
) -> Opener:
    """An :data:`Opener` reading the Parquet ``files`` (paths on ``filesystem``) with ``schema``.

    The files are read one after another, one row group at a time, on the calling
    thread: a dataset scanner reads ahead over files and row groups, which held
    most of a big batch in memory before the commit could write it out.
    """
    listed = list(files)

    def batches() -> Iterator[pa.RecordBatch]:
        for path in listed:
            with pq.ParquetFile(
                path, filesystem=filesystem, pre_buffer=False, buffer_size=_READ_BUFFER_BYTES
            ) as data:
                for batch in data.iter_batches(batch_size=_READ_BATCH_ROWS, use_threads=False):
                    yield batch if batch.schema == schema else _conformed(batch, schema)

    def open_files() -> pa.RecordBatchReader:
        return pa.RecordBatchReader.from_batches(schema, batches())

    return open_files


def _conformed(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """``batch`` with ``schema``'s columns, in its order and types (missing ones null)."""
    columns = [
        batch.column(f.name).cast(f.type)
        if f.name in batch.schema.names
        else pa.nulls(batch.num_rows, f.type)
        for f in schema
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema)
