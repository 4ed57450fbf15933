"""The ledger's read queries, as DataFusion SQL over delta-rs' ``QueryBuilder``.

Every value interpolated into SQL here is a date, a timestamp or an integer
formatted by this module; keys never are: a key lookup joins a temporary
probe table instead (one ``IN (...)`` with 100k literals crashes deltalake
1.6.6). Filters on ``completed_date`` prune partitions and filters
on ``completed_at`` prune files by their statistics.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder, write_deltalake

from idem.ledger.schema import date_of_ms, sql_timestamp


def recent(since_ms: int | None, *, alias: str = "") -> str:
    """``completed_date >= D AND completed_at >= T`` (empty for no bound)."""
    if since_ms is None:
        return ""
    prefix = f"{alias}." if alias else ""
    return (
        f"{prefix}completed_date >= '{date_of_ms(since_ms).isoformat()}'"
        f" AND {prefix}completed_at >= {sql_timestamp(since_ms)}"
    )


def window_sql(since_ms: int, buckets: Iterable[int] | None) -> str:
    """The index columns of rows completed since ``since_ms`` (in ``buckets``)."""
    where = recent(since_ms)
    if buckets is not None:
        where += f" AND bucket IN ({', '.join(str(int(b)) for b in sorted(set(buckets)))})"
    return f"SELECT bucket, key, fingerprint, completed_at FROM ledger WHERE {where}"  # noqa: S608


def probe_sql(column: str, since_ms: int | None) -> str:
    """``key, <column> AS value, completed_at`` of the ledger rows whose key is in ``probe``."""
    where = recent(since_ms, alias="l")
    return (
        f"SELECT l.key, l.{column} AS value, l.completed_at FROM ledger l "  # noqa: S608
        f"JOIN probe p ON l.key = p.key{' WHERE ' + where if where else ''}"
    )


def audit_sql(since_ms: int | None) -> str:
    """Keys held more than once, with their counts."""
    where = recent(since_ms)
    return (
        f"SELECT key, count(*) AS n FROM ledger{' WHERE ' + where if where else ''} "  # noqa: S608
        "GROUP BY bucket, key HAVING count(*) > 1"
    )


def run(ledger: DeltaTable, sql: str, *, probe: DeltaTable | None = None) -> pa.Table:
    """Run ``sql`` with ``ledger`` (and ``probe``) registered; strings come back as ``string``."""
    builder = QueryBuilder().register("ledger", ledger)
    if probe is not None:
        builder.register("probe", probe)
    return plain_strings(pa.table(builder.execute(sql).read_all()))


@contextmanager
def probe_table(keys: pa.Array) -> Iterator[DeltaTable]:
    """A throw-away local Delta table of ``keys`` to join against (~20 ms for 100k keys)."""
    directory = tempfile.mkdtemp(prefix="idem-probe-")
    try:
        write_deltalake(directory, pa.table({"key": keys}))
        yield DeltaTable(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def earliest_by_key(rows: pa.Table) -> dict[str, str | None]:
    """``key -> value`` from ``key, value, completed_at`` rows; a repeated key keeps its first."""
    if rows.num_rows == 0:
        return {}
    newest_first = rows.sort_by([("completed_at", "descending")])
    # Later assignments win, so walking newest first leaves the earliest row's value.
    return dict(
        zip(
            newest_first.column("key").to_pylist(),
            newest_first.column("value").cast(pa.string()).to_pylist(),
            strict=True,
        )
    )


def read_table(table: DeltaTable, columns: Sequence[str] | None = None) -> pa.Table:
    """The whole of ``table`` (only ``columns``), read by DataFusion.

    Not ``DeltaTable.to_pyarrow_table``: its pyarrow dataset over a Python
    filesystem can abort the interpreter at exit (delta-rs #2184, arrow #34314).
    """
    projection = ", ".join(f'"{c}"' for c in columns) if columns else "*"
    return run(table, f"SELECT {projection} FROM ledger")  # noqa: S608 (names from idem itself)


def plain_strings(table: pa.Table) -> pa.Table:
    """DataFusion answers ``string_view``/``binary_view``; idem speaks the plain types."""
    fields = [_plain(f) for f in table.schema]
    return table.cast(pa.schema(fields))


def _plain(f: pa.Field) -> pa.Field:
    if pa.types.is_string_view(f.type):
        return pa.field(f.name, pa.string(), f.nullable)
    if pa.types.is_binary_view(f.type):
        return pa.field(f.name, pa.binary(), f.nullable)
    return f
