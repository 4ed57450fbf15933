"""The ledger table's schema, and how a batch's rows are made to fit it.

One row per completed key: ``(group, bucket, key)`` plus where the message came
from, who completed it, the payload fingerprint and when. The table is
partitioned by ``bucket`` and ``completed_date`` so a Redis rebuild reads only
the dedup window's partitions, and every batch writes its own files so the
``completed_at`` statistics of a file are narrow enough to skip it.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from idem.arrow_text import repeat_text
from idem.errors import ConfigError, LedgerError

PARTITION_COLUMNS: tuple[str, ...] = ("bucket", "completed_date")
"""Ledger partition columns, outermost first."""

LEDGER_SCHEMA = pa.schema(
    [
        pa.field("group", pa.string(), nullable=False),
        pa.field("bucket", pa.int32(), nullable=False),
        pa.field("key", pa.string(), nullable=False),
        pa.field("msg_id", pa.string()),
        pa.field("origin_msg_id", pa.string()),
        pa.field("topic", pa.string()),
        pa.field("queue_id", pa.int32()),
        pa.field("queue_offset", pa.int64()),
        pa.field("batch_id", pa.int64()),
        pa.field("owner", pa.string()),
        pa.field("fingerprint", pa.string(), nullable=False),
        pa.field("completed_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("completed_date", pa.date32(), nullable=False),
        pa.field("result", pa.string()),
    ]
)
"""Arrow schema of the ledger. ``result`` is the JSON result kept for ``@idempotent`` replay."""

REQUIRED_COLUMNS: frozenset[str] = frozenset({"group", "bucket", "key"})
"""Columns a batch must bring; ``fingerprint`` defaults to ``""`` and the times to now."""

INDEX_SCHEMA = pa.schema(
    [
        pa.field("bucket", pa.int32(), nullable=False),
        pa.field("key", pa.string(), nullable=False),
        pa.field("fingerprint", pa.string(), nullable=False),
        pa.field("completed_at_ms", pa.int64(), nullable=False),
    ]
)
"""What the Redis index needs of a ledger row (times in epoch milliseconds)."""

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def date_of_ms(epoch_ms: int) -> dt.date:
    """The UTC date of an epoch-millisecond instant (the ``completed_date`` partition)."""
    return (_EPOCH + dt.timedelta(milliseconds=epoch_ms)).date()


def datetime_of_ms(epoch_ms: int) -> dt.datetime:
    """An aware UTC datetime of an epoch-millisecond instant."""
    return _EPOCH + dt.timedelta(milliseconds=epoch_ms)


def sql_timestamp(epoch_ms: int) -> str:
    """A SQL timestamp literal (UTC, microseconds) for DataFusion predicates."""
    return f"'{datetime_of_ms(epoch_ms).strftime('%Y-%m-%dT%H:%M:%S.%fZ')}'"


def conform(rows: pa.Table, *, now_ms: int) -> pa.Table:
    """``rows`` cast to :data:`LEDGER_SCHEMA`, in its column order.

    Columns the ledger does not know (a Delta sink table that is its own
    ledger carries the user's columns) follow, unchanged. Missing nullable
    columns become nulls, a missing ``fingerprint`` becomes ``""``, a missing
    (or null) ``completed_at`` becomes ``now_ms``, and ``completed_date`` is
    always derived from ``completed_at`` so the partition can never disagree
    with the time. Raises :class:`LedgerError` naming the
    column when a required one is missing or null, or a value cannot be cast.
    """
    require_columns(rows, REQUIRED_COLUMNS)
    now = pa.scalar(datetime_of_ms(now_ms), type=pa.timestamp("us", tz="UTC"))
    columns = [
        conformed_column(rows, field, now=now)
        for field in LEDGER_SCHEMA
        if field.name != "completed_date"
    ]
    completed_at = columns[LEDGER_SCHEMA.get_field_index("completed_at")]
    date_index = LEDGER_SCHEMA.get_field_index("completed_date")
    columns.insert(date_index, pc.cast(completed_at, pa.date32()))
    table = pa.Table.from_arrays(columns, schema=LEDGER_SCHEMA)
    for name in rows.column_names:
        if name not in LEDGER_SCHEMA.names:
            table = table.append_column(rows.schema.field(name), rows.column(name))
    return table


def require_columns(rows: pa.Table, required: Iterable[str], *, what: str = "rows") -> None:
    """Raise :class:`LedgerError` naming the ``required`` columns ``rows`` lacks."""
    missing = sorted(set(required) - set(rows.column_names))
    if missing:
        raise LedgerError(f"{what}: missing required column(s) {', '.join(missing)}")


def conformed_column(
    rows: pa.Table, field: pa.Field, *, now: pa.Scalar, what: str = "rows"
) -> pa.ChunkedArray | pa.Array:
    """The ledger column ``field`` of ``rows`` as :func:`conform` makes it: cast to its
    type (nulls when absent), a null ``fingerprint`` ``""``, a null ``completed_at``
    ``now``. Raises :class:`LedgerError` naming the column when a value cannot be cast
    or the column may not hold the nulls left."""
    column: pa.ChunkedArray | pa.Array
    if field.name in rows.column_names:
        column = _cast(rows.column(field.name), field, what)
    elif field.name == "fingerprint":
        column = repeat_text("", rows.num_rows)
    else:
        column = pa.nulls(rows.num_rows, field.type)
    if field.name == "completed_at":
        column = pc.fill_null(column, now)
    elif field.name == "fingerprint" and column.null_count:
        column = pc.fill_null(column, "")
    if not field.nullable and column.null_count:
        raise LedgerError(f"{what}: column {field.name!r} holds {column.null_count} null(s)")
    return column


def _cast(column: pa.ChunkedArray, field: pa.Field, what: str) -> pa.ChunkedArray:
    if column.type == field.type:
        return column
    try:
        if pa.types.is_timestamp(field.type) and pa.types.is_integer(column.type):
            # Integer times are epoch milliseconds throughout idem.
            return pc.cast(pc.multiply(pc.cast(column, pa.int64()), 1000), field.type)
        return pc.cast(column, field.type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise LedgerError(
            f"{what}: column {field.name!r} of type {column.type} cannot become {field.type}: {exc}"
        ) from exc


def make_rows(
    *,
    group: str,
    keys: Sequence[str],
    buckets: Sequence[int],
    fingerprints: Sequence[str] | None = None,
    owner: str | None = None,
    batch_id: int | None = None,
    columns: Mapping[str, Sequence[object]] | None = None,
) -> pa.Table:
    """Rows for ``keys`` (one per key, same order), ready for ``commit``.

    ``columns`` carries any other ledger column (``msg_id``, ``topic``,
    ``result``...) as one value per key. ``completed_at`` is left out: the
    ledger stamps it at commit (``conform(rows, now_ms=...)`` stamps it for a
    raw write).
    """
    n = len(keys)
    if len(buckets) != n:
        raise LedgerError(f"buckets: {len(buckets)} values for {n} keys")
    if fingerprints is not None and len(fingerprints) != n:
        raise LedgerError(f"fingerprints: {len(fingerprints)} values for {n} keys")
    data: dict[str, pa.Array] = {
        "group": pa.array([group] * n, pa.string()),
        "bucket": pa.array(buckets, pa.int32()),
        "key": pa.array(keys, pa.string()),
        "fingerprint": pa.array(list(fingerprints) if fingerprints else [""] * n, pa.string()),
        "owner": pa.array([owner] * n, pa.string()),
        "batch_id": pa.array([batch_id] * n, pa.int64()),
    }
    for name, values in (columns or {}).items():
        if name not in LEDGER_SCHEMA.names:
            raise LedgerError(f"columns: {name!r} is not a ledger column")
        if len(values) != n:
            raise LedgerError(f"columns[{name!r}]: {len(values)} values for {n} keys")
        data[name] = pa.array(list(values), LEDGER_SCHEMA.field(name).type)
    return pa.table(data)


def to_index_rows(table: pa.Table) -> pa.Table:
    """``bucket, key, fingerprint, completed_at`` rows as :data:`INDEX_SCHEMA`."""
    completed = table.column("completed_at")
    if pa.types.is_timestamp(completed.type) and completed.type.unit != "us":
        completed = pc.cast(completed, pa.timestamp("us", tz="UTC"))  # Spark writes INT96 (ns)
    micros = _as(completed, pa.int64())
    return pa.Table.from_arrays(
        [
            _as(table.column("bucket"), pa.int32()),
            _as(table.column("key"), pa.string()),
            _as(table.column("fingerprint"), pa.string()),
            pc.divide(micros, 1000),
        ],
        schema=INDEX_SCHEMA,
    )


def _as(column: pa.ChunkedArray, kind: pa.DataType) -> pa.ChunkedArray:
    """``column`` cast to ``kind`` (a call to Arrow only when the type differs)."""
    return column if column.type == kind else pc.cast(column, kind)


def first_per_key(rows: pa.Table) -> tuple[pa.Table, list[str]]:
    """The first row of each ``(bucket, key)``, and the keys that repeated."""
    if rows.num_rows < 2:
        return rows, []
    if len(pc.unique(rows.column("key"))) == rows.num_rows:
        return rows, []  # the usual case, ~4x cheaper than the grouping below
    keyed = rows.select(["bucket", "key"]).append_column(
        "__row", pa.array(range(rows.num_rows), pa.int64())
    )
    firsts = keyed.group_by(["bucket", "key"], use_threads=False).aggregate([("__row", "min")])
    if firsts.num_rows == rows.num_rows:
        return rows, []
    keep = pc.sort_indices(firsts.column("__row_min"))
    indices = pc.take(firsts.column("__row_min"), keep)
    mask = pc.invert(pc.is_in(keyed.column("__row"), value_set=indices.combine_chunks()))
    repeated = keyed.column("key").filter(mask).to_pylist()
    return rows.take(indices), list(dict.fromkeys(repeated))


@dataclass(frozen=True, slots=True)
class LedgerIdentity:
    """Whose ledger a table is: one group, with one bucket count, for its whole life.

    Written into the table's description when the ledger is created, and checked
    whenever it is opened: another group's rows would suppress this group's keys
    (the checks match on bucket and key), and another bucket count would put a
    key in another bucket than its first copy.
    """

    group: str
    buckets: int

    @classmethod
    def of(cls, description: str | None) -> LedgerIdentity | None:
        """The identity a table description records (``None``: an older ledger's)."""
        found = _IDENTITY.search(description or "")
        if found is None:
            return None
        return cls(json.loads(found.group("group")), int(found.group("buckets")))


_IDENTITY = re.compile(r'\[group=(?P<group>"(?:[^"\\]|\\.)*") buckets=(?P<buckets>\d+)\]$')


ENGINE_PROPERTY = "idem.engine"
"""The table property naming the engine that writes the ledger (``delta-rs``, ``delta-spark``).

delta-spark sets it; delta-rs cannot create a table with a property outside Delta's own
in the same commit, so the engine is also in the table description, which both set."""

_ENGINE_NOTE = re.compile(r"\(written by (?P<engine>[a-z-]+)\)")


def describe_ledger(engine: str, identity: LedgerIdentity | None) -> str:
    """The description a new ledger table gets: its writer engine and identity."""
    text = f"idem dedup ledger (written by {engine}): one row per completed business key"
    if identity is None:
        return text
    return f"{text} [group={json.dumps(identity.group)} buckets={identity.buckets}]"


def recorded_writer(description: str | None, properties: Mapping[str, str | None]) -> str | None:
    """The engine a table records as its writer (``None``: it records none)."""
    writer = properties.get(ENGINE_PROPERTY)
    if writer:
        return writer
    found = _ENGINE_NOTE.search(description or "")
    return None if found is None else found.group("engine")


def check_ledger_table(
    uri: str,
    *,
    engine: str,
    description: str | None,
    properties: Mapping[str, str | None],
    identity: LedgerIdentity | None,
) -> None:
    """Refuse a table written by another engine, another group's ledger, or this group's
    with another bucket count (what the table's description and properties record).

    A table that records no engine or no identity (made before they were recorded) is
    accepted.
    """
    writer = recorded_writer(description, properties)
    if writer and writer != engine:
        raise ConfigError(
            f"engine: the ledger at {uri} is written by {writer}, not {engine}; one table "
            f"has one writer engine: open it with engine={writer!r} (IDEM_ENGINE={writer})"
        )
    found = LedgerIdentity.of(description)
    if identity is None or found is None:  # not asked, or a ledger older than the record
        return
    if found.group != identity.group:
        raise ConfigError(
            f"ledger_path: the ledger at {uri} belongs to group {found.group!r}, "
            f"not {identity.group!r}; give each group its own ledger (groups must never "
            "suppress each other's keys)"
        )
    if found.buckets != identity.buckets:
        raise ConfigError(
            f"buckets: the ledger at {uri} was written with {found.buckets} buckets, "
            f"not {identity.buckets}; a group's bucket count is fixed once its ledger exists"
        )
