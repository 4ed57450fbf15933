"""Rows fitted to the sink table's column types before they are written.

A Delta sink table keeps the types its first batch gave it. A later row whose value
does not fit (``'abc'`` for a double column, a bigint past an int column's range, a null
in a column that is not nullable) would fail the whole commit, and with it every replay
of the batch. :func:`fit_rows` casts each column to the table's type and leaves out the
rows that do not fit, each with the column and the value: those are dead-lettered.
"""

from __future__ import annotations

from collections.abc import Collection

import pyarrow as pa
import pyarrow.compute as pc

_CAST_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError)
_CHUNK = 1024  # rows cast one by one only within a chunk that failed as a whole


def fit_rows(
    rows: pa.Table, table_types: pa.Schema | None, *, supplied: Collection[str] = ()
) -> tuple[pa.Table, dict[int, str]]:
    """``rows`` with every column the table has cast to its type, without the rows that do
    not fit; and those rows (positions in ``rows``) with why. Columns the table lacks are
    left as they are (the write adds them); a column named in another case is the table's
    (Delta's names are case-insensitive); a table column the rows lack, other than those
    the caller ``supplied``, is null, as Delta writes it, or a misfit where it may not be."""
    if table_types is None or rows.num_rows == 0:
        return rows, {}
    misfits: dict[int, str] = {}
    rows = _named_as_the_table(rows, table_types)
    for wanted in table_types:
        if wanted.name in supplied or wanted.name in rows.column_names:
            continue
        if not wanted.nullable:
            why = f"column {wanted.name!r}: missing, and the sink table's column is not nullable"
            misfits.update(dict.fromkeys(range(rows.num_rows), why))
        rows = rows.append_column(wanted, pa.nulls(rows.num_rows, wanted.type))
    columns: list[pa.ChunkedArray] = []
    for name in rows.column_names:
        column = rows.column(name)
        index = table_types.get_field_index(name)
        if index < 0:
            columns.append(column)
            continue
        wanted = table_types.field(index)
        if column.type != wanted.type:
            column = _cast(column, wanted.type, name, misfits)
        if not wanted.nullable and column.null_count:
            for i in pc.indices_nonzero(pc.is_null(column)).to_pylist():
                misfits.setdefault(
                    i, f"column {name!r}: null, and the sink table's column is not nullable"
                )
        columns.append(column)
    fitted = pa.table(columns, schema=_schema(rows.schema, table_types))
    if not misfits:
        return fitted, {}
    keep = pa.array([i not in misfits for i in range(rows.num_rows)], pa.bool_())
    return fitted.filter(keep), misfits


def _named_as_the_table(rows: pa.Table, table_types: pa.Schema) -> pa.Table:
    """``rows`` with a column the table names in another case renamed to the table's name."""
    by_lower = {name.lower(): name for name in table_types.names}
    names = [
        name if table_types.get_field_index(name) >= 0 else by_lower.get(name.lower(), name)
        for name in rows.column_names
    ]
    return rows if names == rows.column_names else rows.rename_columns(names)


def _schema(given: pa.Schema, table_types: pa.Schema) -> pa.Schema:
    fields = []
    for field in given:
        index = table_types.get_field_index(field.name)
        fields.append(field if index < 0 else field.with_type(table_types.field(index).type))
    return pa.schema(fields)


def _cast(
    column: pa.ChunkedArray, kind: pa.DataType, name: str, misfits: dict[int, str]
) -> pa.ChunkedArray:
    """``column`` as ``kind``; a value that does not fit becomes null and its row a misfit."""
    try:
        return pc.cast(column, kind, safe=True)
    except _CAST_ERRORS:
        pass
    values = column.combine_chunks()
    parts: list[pa.Array] = []
    for start in range(0, len(values), _CHUNK):
        chunk = values.slice(start, _CHUNK)
        try:
            parts.append(pc.cast(chunk, kind, safe=True))
            continue
        except _CAST_ERRORS:
            pass
        cast_values = []
        for offset in range(len(chunk)):
            one = chunk.slice(offset, 1)
            try:
                cast_values.append(pc.cast(one, kind, safe=True)[0].as_py())
            except _CAST_ERRORS:
                misfits.setdefault(
                    start + offset,
                    f"column {name!r}: {one[0].as_py()!r} does not fit the sink table's {kind}",
                )
                cast_values.append(None)
        parts.append(pa.array(cast_values, kind))
    return pa.chunked_array(parts, kind)
