"""The ledger rows of a batch's accepted rows, made on the executors.

:class:`LedgerRowsTask` (called by ``mapInArrow``) turns each task's accepted rows
into ledger rows: key, bucket, fingerprint, message ids, the batch and its owner,
the instant of the commit. For a Delta sink it also fits the user's columns to the
sink table's types (:func:`idem.spark.fit.fit_rows`); a row that does not fit
keeps its key and says why in :data:`MISFIT_COLUMN`, and is dead-lettered instead
of committed. Nothing of the rows passes through the driver.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from idem.ledger.schema import LEDGER_SCHEMA
from idem.spark.fit import fit_rows
from idem.spark.row_meta import row_meta
from idem.spark.verdicts import (
    BUCKET_COLUMN,
    FINGERPRINT_TEXT_COLUMN,
    HASH_COLUMN,
    KEY_COLUMN,
    ORDER_COLUMN,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql import types as st

MISFIT_COLUMN = "_idem_misfit"
"""Why a row does not fit the sink table's column types (null: it fits)."""


@dataclass(frozen=True)
class LedgerRowsTask:
    """The ledger rows of one task's accepted rows (see the module).

    Args:
        group: The consumer group.
        owner: The batch's owner token.
        batch_id: The micro-batch id.
        topic: The topic of main-stream rows.
        completed_at_ms: The instant the rows are done (chosen by the driver).
        columns: The user's columns that go into a Delta sink table (empty: none).
        carried: The names those columns have in the rows (see
            :attr:`idem.spark.micro_batch.BatchSetup.renamed`).
        table_types: The sink table's column types (``None``: no table yet).
        fingerprints: Whether the rows carry payload hashes.
    """

    group: str
    owner: str
    batch_id: int
    topic: str
    completed_at_ms: int
    columns: tuple[str, ...] = ()
    carried: tuple[str, ...] = ()
    table_types: pa.Schema | None = None
    fingerprints: bool = True

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Ledger rows of the task's rows (called once per task).

        Each row's ledger row depends on that row alone, so the rows are turned one
        Arrow batch at a time: a task holds one batch, however large its partition.
        """
        for batch in batches:
            if batch.num_rows:
                yield from self._rows(pa.Table.from_batches([batch])).to_batches()

    def _rows(self, table: pa.Table) -> pa.Table:
        """The ledger rows of ``table`` (with the user's columns, fitted, for a Delta sink)."""
        rows = self.ledger_columns(table)
        misfits: dict[int, str] = {}
        if self.columns:
            fitted, misfits = fit_rows(
                table.select(list(self.carried)).rename_columns(list(self.columns)),
                self.table_types,
                supplied=LEDGER_SCHEMA.names,
            )
            if misfits:
                keep = pa.array([i not in misfits for i in range(table.num_rows)])
                rows = pa.concat_tables(
                    [
                        _with_payload(rows.filter(keep), fitted, None),
                        _misfit_rows(rows.filter(pc.invert(keep)), fitted.schema, misfits),
                    ]
                )
            else:
                rows = _with_payload(rows, fitted, None)
        else:
            rows = rows.append_column(MISFIT_COLUMN, pa.nulls(rows.num_rows, pa.string()))
        return rows

    def ledger_columns(self, table: pa.Table) -> pa.Table:
        """The :data:`~idem.ledger.schema.LEDGER_SCHEMA` columns of ``table``'s rows."""
        size = table.num_rows
        meta = row_meta(
            table,
            owner=self.owner,
            topic=self.topic,
            order_column=ORDER_COLUMN,
            hash_column=HASH_COLUMN if self.fingerprints else None,
        )
        at = datetime.fromtimestamp(self.completed_at_ms / 1000, tz=UTC)
        prints = table.column(FINGERPRINT_TEXT_COLUMN)
        columns = {
            "group": pa.repeat(pa.scalar(self.group, pa.string()), size),
            "bucket": table.column(BUCKET_COLUMN).cast(pa.int32()),
            "key": table.column(KEY_COLUMN),
            "msg_id": meta.msg_ids,
            "origin_msg_id": meta.origin_msg_ids,
            "topic": meta.topics,
            "queue_id": pa.nulls(size, pa.int32()),
            "queue_offset": pa.nulls(size, pa.int64()),
            "batch_id": pa.repeat(pa.scalar(self.batch_id, pa.int64()), size),
            "owner": pa.repeat(pa.scalar(self.owner, pa.string()), size),
            "fingerprint": pc.fill_null(prints, ""),
            "completed_at": pa.repeat(pa.scalar(at, pa.timestamp("us", tz="UTC")), size),
            "completed_date": pa.repeat(pa.scalar(at.date(), pa.date32()), size),
            "result": pa.nulls(size, pa.string()),
        }
        return pa.table(columns, schema=LEDGER_SCHEMA)


def _with_payload(rows: pa.Table, fitted: pa.Table, why: str | None) -> pa.Table:
    for field in fitted.schema:
        rows = rows.append_column(field, fitted.column(field.name))
    return rows.append_column(MISFIT_COLUMN, pa.repeat(pa.scalar(why, pa.string()), rows.num_rows))


def _misfit_rows(rows: pa.Table, payload: pa.Schema, misfits: dict[int, str]) -> pa.Table:
    """The ledger columns of the rows that do not fit, their payload null, with why."""
    for field in payload:
        rows = rows.append_column(field.with_nullable(True), pa.nulls(rows.num_rows, field.type))
    reasons = [misfits[i] for i in sorted(misfits)]
    return rows.append_column(MISFIT_COLUMN, pa.array(reasons, pa.string()))


def ledger_schema(
    batch: st.StructType, columns: Sequence[str], table_types: pa.Schema | None
) -> st.StructType:
    """The Spark schema :class:`LedgerRowsTask` emits for rows of schema ``batch``."""
    from pyspark.sql import types as st  # noqa: PLC0415 -- pyspark is loaded by now
    from pyspark.sql.pandas.types import from_arrow_schema, from_arrow_type  # noqa: PLC0415

    fields = list(from_arrow_schema(LEDGER_SCHEMA).fields)
    by_name = {f.name: f for f in batch.fields}
    lower = {} if table_types is None else {n.lower(): n for n in table_types.names}
    present = set()
    for name in columns:
        table_name = lower.get(name.lower())
        if table_name is None or table_types is None:
            fields.append(st.StructField(name, by_name[name].dataType, nullable=True))
        else:
            present.add(table_name)
            kind = from_arrow_type(table_types.field(table_name).type)
            fields.append(st.StructField(table_name, kind, nullable=True))
    # A column of the table the rows lack: fit_rows adds it, null (as Delta writes it).
    for wanted in table_types or ():
        if wanted.name not in present and wanted.name not in LEDGER_SCHEMA.names:
            fields.append(st.StructField(wanted.name, from_arrow_type(wanted.type), nullable=True))
    fields.append(st.StructField(MISFIT_COLUMN, st.StringType(), nullable=True))
    return st.StructType(fields)


def ledger_frame(accepted: DataFrame, task: LedgerRowsTask) -> DataFrame:
    """The ledger rows of ``accepted`` (lazy), one task per partition of the batch."""
    from pyspark.sql import types as st  # noqa: PLC0415 -- pyspark is loaded by now

    carried = dict(zip(task.columns, task.carried, strict=True))
    by_name = {f.name: f for f in accepted.schema.fields}
    batch = st.StructType([st.StructField(n, by_name[carried[n]].dataType) for n in task.columns])
    schema = ledger_schema(batch, task.columns, task.table_types)
    return accepted.mapInArrow(task, schema)
