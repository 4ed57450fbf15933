"""A batch's ledger rows staged as Parquet by the executors, for the delta-rs engine's commit.

The delta-rs engine commits from the driver. A Delta sink that is its own ledger
writes the user's columns in that commit, and a function sink's done-records
are a row per key; gathering either on the driver would bound a batch by
``spark.driver.maxResultSize`` and the driver's memory. Instead each task writes
its rows (the ledger columns and, for a Delta sink, the user's, typed as the
table wants them) to one Parquet file and returns only the file's path and row
count; the driver reads back the columns it decides with and the commit streams
the files (:class:`idem.ledger.staged.StagedRows`).

The files go under ``<table>/_idem_staging/<query>/<batch>-<attempt>/``. Inside the
table's directory they share its storage and credentials, and Delta never reads
them: a Delta table is the files its log names, and ``VACUUM`` (delta-rs and Spark
alike) leaves directories whose name starts with ``_`` alone, as it does
``_delta_log``. A batch's directory is removed once its commit is done; the next
batch of the same query removes what a crashed batch left.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from idem.errors import LedgerError
from idem.ledger.staged import StagedRows, parquet_opener

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger(__name__)

STAGING_DIR = "_idem_staging"
"""The directory inside the table's that holds staged batches (Delta skips ``_`` names)."""

_STAGED_SCHEMA = "file string, rows long"
_STAGED = pa.schema([("file", pa.string()), ("rows", pa.int64())])


def query_dir(table: str, app_id: str) -> str:
    """Where the batches of the query committing as ``app_id`` are staged."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", app_id)[:80]
    digest = hashlib.sha256(app_id.encode()).hexdigest()[:12]
    return f"{table.rstrip('/')}/{STAGING_DIR}/{readable}-{digest}"


@dataclass(frozen=True)
class StageTask:
    """Writes one task's rows to one Parquet file in ``directory``; yields its path and rows.

    Called by ``mapInArrow`` on the executors. A retried or speculative task
    writes a file of its own; only the files of the attempts Spark keeps are
    named in the job's result, and only those are read.
    """

    directory: str

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Stage the task's rows (called once per task)."""
        fs, base = pafs.FileSystem.from_uri(self.directory)
        fs.create_dir(base, recursive=True)
        path = f"{base}/part-{uuid.uuid4().hex}.parquet"
        writer: pq.ParquetWriter | None = None
        rows = 0
        try:
            for batch in batches:
                if not batch.num_rows:
                    continue
                if writer is None:
                    writer = pq.ParquetWriter(path, batch.schema, filesystem=fs)
                writer.write_batch(batch)
                rows += batch.num_rows
        finally:
            if writer is not None:
                writer.close()
        if rows:
            yield pa.RecordBatch.from_pydict({"file": [path], "rows": [rows]}, schema=_STAGED)


@dataclass
class Staging:
    """One batch's staged rows: :meth:`stage` them, commit, then :meth:`remove`."""

    table: str
    app_id: str
    batch_id: int

    def __post_init__(self) -> None:
        self._query = query_dir(self.table, self.app_id)
        self._fs, self._query_path = pafs.FileSystem.from_uri(self._query)
        self._batch = f"{self._query}/{self.batch_id}-{uuid.uuid4().hex[:12]}"

    def stage(self, rows: DataFrame, columns: Sequence[str]) -> StagedRows:
        """Write ``rows`` (every column) from the executors; hold their ``columns`` (the
        ledger columns the commit decides with) read back from the files.

        The ledger columns come from the files the executors wrote, not from a
        second collect through the driver's JVM: they describe exactly the rows
        staged, and a batch of millions of rows never has to fit that JVM's heap.
        What earlier batches of the query left (a crash between staging and
        commit) is removed first: one batch of a query runs at a time.
        """
        self._clear(self._query_path)
        staged = rows.mapInArrow(StageTask(self._batch), _STAGED_SCHEMA).collect()
        files = [str(r["file"]) for r in staged]
        count = sum(int(r["rows"]) for r in staged)
        if not files:
            keys = rows.select(*columns).toArrow()  # no rows: nothing to gather
            return StagedRows(keys=keys, schema=pa.schema([]), open=parquet_opener([], keys.schema))
        schema = pq.read_schema(files[0], filesystem=self._fs)
        keys = self._read_columns(files, list(columns))
        if count != keys.num_rows:
            raise LedgerError(f"staging: {count} row(s) written, {keys.num_rows} read back")
        return StagedRows(keys=keys, schema=schema, open=parquet_opener(files, schema, self._fs))

    def _read_columns(self, files: Sequence[str], columns: list[str]) -> pa.Table:
        parts = []
        for path in files:
            with pq.ParquetFile(path, filesystem=self._fs) as data:
                parts.append(data.read(columns=columns, use_threads=False))
        return pa.concat_tables(parts)

    def remove(self) -> None:
        """Remove the batch's files, and the staging directories left empty."""
        _, batch_path = pafs.FileSystem.from_uri(self._batch)
        self._clear(batch_path)
        if not isinstance(self._fs, pafs.LocalFileSystem):
            return  # an object store has no directories to leave behind
        for path in (self._query_path, self._query_path.rsplit("/", 1)[0]):
            try:
                Path(path).rmdir()  # only when empty: another query may be staging there
            except OSError:
                return

    def _clear(self, path: str) -> None:
        try:
            if self._fs.get_file_info(path).type is not pafs.FileType.NotFound:
                self._fs.delete_dir(path)
        except OSError as exc:
            log.warning("staging: cannot remove %s: %s", path, exc)
