"""The dead-letter table ``%DLQ%<group>`` in Delta (partitioned by dead_date).

A message is dead-lettered with an insert-only MERGE on ``(origin_msg_id,
msg_id)``: a dead-letter write repeated after a crash (the batch is replayed,
the same message dies again) finds its row and adds nothing. With
``app_id``/``txn_version`` the replayed commit is skipped before it starts.
Rows are never deleted by idem: a replay marks them ``REPLAYED``, an operator
``DISCARDED``; ``replayed_at``/``replayed_by`` say when and by whom a row left
``DEAD``. Tables written before ``replayed_by`` existed gain the column on
their first status change (reads treat it as null until then).
"""

from __future__ import annotations

import builtins
import datetime as dt
import getpass
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.schema import Field, PrimitiveType
from deltalake.transaction import CommitProperties, Transaction

from idem.clock import SYSTEM_CLOCK, Clock
from idem.errors import ConfigError
from idem.ledger import read_table
from idem.retry.errors import DeadLetterError
from idem.retry.faults import DEFAULT_FAULT_TOLERANCE, FaultTolerance
from idem.retry.message import (
    FailureRecord,
    MessageConst,
    MessageExt,
    dlq_topic,
    failure_history,
    first_failed_at,
)

UTC = dt.UTC
_TS = pa.timestamp("us", tz="UTC")
ERROR_TYPE = pa.struct([("at", _TS), ("type", pa.string()), ("message", pa.string())])

DLQ_SCHEMA = pa.schema(
    [
        ("group", pa.string()),
        ("topic", pa.string()),
        ("key", pa.string()),
        ("msg_id", pa.string()),
        ("origin_msg_id", pa.string()),
        ("body", pa.binary()),
        ("properties", pa.map_(pa.string(), pa.string())),
        ("reconsume_times", pa.int32()),
        ("first_failed_at", _TS),
        ("dead_at", _TS),
        ("last_error", pa.string()),
        ("errors", pa.list_(ERROR_TYPE)),
        ("status", pa.string()),
        ("replayed_at", _TS),
        ("dead_date", pa.date32()),
        ("replayed_by", pa.string()),
    ]
)
"""The ``%DLQ%<group>`` schema (``dead_date`` is the partition column).

``replayed_by`` comes last: it was added later, and a table created before it
gains it at the end, so old and new tables have one column order."""

_ADDED_COLUMNS = {"replayed_by": "string"}
"""Columns (and Delta types) added to ``DLQ_SCHEMA`` after tables were first written."""

DEAD_REASON_PROPERTY = "IDEM_DEAD_REASON"
"""Why the message was dead-lettered (max reconsume times, level -1, bad input...)."""


class DeadLetterStatus(StrEnum):
    """Life of a dead letter."""

    DEAD = "DEAD"
    REPLAYED = "REPLAYED"
    DISCARDED = "DISCARDED"


def current_user() -> str:
    """``user@host`` of this process: who replayed or discarded a dead letter."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _ts(ms: int | None) -> dt.datetime | None:
    return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, tz=UTC)


def _ms(value: dt.datetime | None) -> int | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return int(value.timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One row of ``%DLQ%<group>``."""

    group: str
    topic: str
    key: str | None
    msg_id: str
    origin_msg_id: str
    body: bytes
    properties: Mapping[str, str]
    reconsume_times: int
    first_failed_at_ms: int
    dead_at_ms: int
    last_error: str | None
    errors: tuple[FailureRecord, ...] = ()
    status: DeadLetterStatus = DeadLetterStatus.DEAD
    replayed_at_ms: int | None = None
    """When the row left ``DEAD`` (replayed or discarded)."""
    reason: str = field(default="", compare=False)
    replayed_by: str | None = None
    """Who replayed or discarded the row (``user@host`` or the operator's ``--by``)."""

    @classmethod
    def of(cls, group: str, message: MessageExt, *, reason: str, dead_at_ms: int) -> DeadLetter:
        """The dead letter of ``message`` (its failure history already recorded on it)."""
        errors = failure_history(message)
        last = errors[-1] if errors else None
        props = dict(message.properties)
        props[DEAD_REASON_PROPERTY] = reason
        if message.tags is not None:
            # the table has no tags column: RocketMQ keeps the tag as this property (idem's
            # producer too), and a replay must reach a listener that routes on it with it
            props[MessageConst.PROPERTY_TAGS] = message.tags
        props.setdefault(MessageConst.PROPERTY_ORIGIN_MESSAGE_ID, message.origin_msg_id)
        props.setdefault(MessageConst.PROPERTY_RETRY_TOPIC, message.retry_topic_origin)
        return cls(
            group=group,
            topic=message.retry_topic_origin,
            key=message.keys,
            msg_id=message.msg_id,
            origin_msg_id=message.origin_msg_id,
            body=message.body,
            properties=props,
            reconsume_times=message.reconsume_times,
            first_failed_at_ms=first_failed_at(message, dead_at_ms),
            dead_at_ms=dead_at_ms,
            last_error=None if last is None else f"{last.type}: {last.message}",
            errors=errors,
            reason=reason,
        )

    def to_message(self) -> MessageExt:
        """The message to replay: original topic, key, tag, body and properties, origin id
        kept."""
        props = {k: v for k, v in self.properties.items() if k != DEAD_REASON_PROPERTY}
        return MessageExt(
            topic=self.topic,
            msg_id=self.msg_id,
            body=self.body,
            keys=self.key,
            tags=self.properties.get(MessageConst.PROPERTY_TAGS),  # RocketMQ's getTags()
            reconsume_times=self.reconsume_times,
            properties=props,
        )

    def to_row(self) -> dict[str, Any]:
        """The row as ``DLQ_SCHEMA`` expects it."""
        dead_at = _ts(self.dead_at_ms)
        assert dead_at is not None
        return {
            "group": self.group,
            "topic": self.topic,
            "key": self.key,
            "msg_id": self.msg_id,
            "origin_msg_id": self.origin_msg_id,
            "body": self.body,
            "properties": list(self.properties.items()),
            "reconsume_times": self.reconsume_times,
            "first_failed_at": _ts(self.first_failed_at_ms),
            "dead_at": dead_at,
            "last_error": self.last_error,
            "errors": [
                {"at": _ts(e.at_ms), "type": e.type, "message": e.message} for e in self.errors
            ],
            "status": str(self.status),
            "replayed_at": _ts(self.replayed_at_ms),
            "dead_date": dead_at.date(),
            "replayed_by": self.replayed_by,
        }

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> DeadLetter:
        """Inverse of :meth:`to_row`."""
        props = dict(row["properties"] or [])
        return cls(
            group=row["group"],
            topic=row["topic"],
            key=row["key"],
            msg_id=row["msg_id"],
            origin_msg_id=row["origin_msg_id"],
            body=row["body"] or b"",
            properties=props,
            reconsume_times=int(row["reconsume_times"]),
            first_failed_at_ms=_ms(row["first_failed_at"]) or 0,
            dead_at_ms=_ms(row["dead_at"]) or 0,
            last_error=row["last_error"],
            errors=tuple(
                FailureRecord(_ms(e["at"]) or 0, e["type"], e["message"])
                for e in row["errors"] or []
            ),
            status=DeadLetterStatus(row["status"]),
            replayed_at_ms=_ms(row["replayed_at"]),
            reason=props.get(DEAD_REASON_PROPERTY, ""),
            replayed_by=row.get("replayed_by"),  # absent in tables made before the column
        )


@dataclass(frozen=True, slots=True)
class DeadLetterId:
    """Who a dead letter is, without its body: what :meth:`DeadLetterTable.dead_among`
    answers."""

    COLUMNS = ("msg_id", "origin_msg_id", "key", "reconsume_times", "status")

    msg_id: str
    origin_msg_id: str
    key: str | None
    reconsume_times: int


class DeadLetterTable:
    """``%DLQ%<group>`` at ``path``: write (idempotent), list, show, mark replayed/discarded."""

    def __init__(
        self,
        path: str,
        group: str,
        *,
        clock: Clock = SYSTEM_CLOCK,
        storage_options: Mapping[str, str] | None = None,
        faults: FaultTolerance = DEFAULT_FAULT_TOLERANCE,
    ) -> None:
        self.path = path
        self.group = group
        self.clock = clock
        self.storage_options = dict(storage_options) if storage_options else None
        self.faults = faults

    @property
    def name(self) -> str:
        """The table's name, ``%DLQ%<group>``."""
        return dlq_topic(self.group)

    def exists(self) -> bool:
        """Whether the table is there (it is created by the group's first dead letter)."""
        return bool(DeltaTable.is_deltatable(self.path, storage_options=self.storage_options))

    def _open(self) -> DeltaTable:
        """The existing table at ``path``, refused if it is another group's."""
        table = DeltaTable(self.path, storage_options=self.storage_options)
        name = table.metadata().name
        if name and name != self.name:
            raise ConfigError(
                f"dlq_path: the table at {self.path} is {name!r}, not {self.name!r}; "
                "give each group its own dead-letter table"
            )
        return table

    def _table(self, *, create: bool) -> DeltaTable | None:
        if self.exists():
            return self._open()
        if not create:
            return None
        try:
            return DeltaTable.create(
                self.path,
                schema=DLQ_SCHEMA,
                partition_by=["dead_date"],
                name=self.name,
                description=f"dead letters of consumer group {self.group}",
                storage_options=self.storage_options,
            )
        except Exception:  # another writer created it first: use theirs
            if DeltaTable.is_deltatable(self.path, storage_options=self.storage_options):
                return self._open()
            raise

    def write(
        self,
        letters: Sequence[DeadLetter],
        *,
        app_id: str | None = None,
        txn_version: int | None = None,
    ) -> int:
        """Insert the letters not already present, and make a ``REPLAYED`` row of a message
        that died again after its replay ``DEAD`` again; returns the rows added or reopened."""
        if not letters:
            return 0
        # One row per message even when a batch names it twice.
        unique = list({(d.origin_msg_id, d.msg_id): d for d in letters}.values())
        source = pa.Table.from_pylist([d.to_row() for d in unique], schema=DLQ_SCHEMA)

        def merge() -> int:
            table = self._table(create=True)
            assert table is not None
            _add_missing_columns(table)
            props = _commit_properties(app_id, txn_version)
            if app_id is not None and txn_version is not None:
                done = table.transaction_version(app_id)
                if done is not None and done >= txn_version:
                    # A replayed batch: the MERGE below adds only the letters the first
                    # attempt did not write (a replay may dead-letter other rows).
                    props = None
            metrics = (
                table.merge(
                    source,
                    predicate="t.origin_msg_id = s.origin_msg_id AND t.msg_id = s.msg_id",
                    source_alias="s",
                    target_alias="t",
                    commit_properties=props,
                )
                # A message replayed from here that died again walks the same msg ids, so
                # it matches its REPLAYED row: that row is DEAD again, with this death's
                # details (else it would sit there as "replayed", out of every listing).
                .when_matched_update(
                    updates={column: f"s.{column}" for column in _REOPENED_COLUMNS},
                    predicate=(
                        f"t.status = '{DeadLetterStatus.REPLAYED}' AND t.replayed_at IS NOT NULL"
                        " AND s.dead_at > t.replayed_at"
                    ),
                )
                .when_not_matched_insert_all()
                .execute()
            )
            added = metrics.get("num_target_rows_inserted", 0)
            return int(added) + int(metrics.get("num_target_rows_updated", 0))

        return self.faults.delta(
            merge, what=f"write to {self.name} at {self.path}", wrap=DeadLetterError
        )

    def _read(self) -> pa.Table:
        table = self._table(create=False)
        if table is None:
            return DLQ_SCHEMA.empty_table()

        def read() -> pa.Table:
            rows = read_table(table)
            for name in _ADDED_COLUMNS:  # a table written before the column existed
                if name not in rows.column_names:
                    rows = rows.append_column(
                        name, pa.nulls(rows.num_rows, DLQ_SCHEMA.field(name).type)
                    )
            return rows.select(DLQ_SCHEMA.names).cast(DLQ_SCHEMA)

        return self.faults.delta(
            read, what=f"read {self.name} at {self.path}", wrap=DeadLetterError
        )

    def list(
        self, *, status: DeadLetterStatus | None = None, limit: int | None = None
    ) -> builtins.list[DeadLetter]:
        """Dead letters, newest first, optionally of one status."""
        rows = [DeadLetter.from_row(r) for r in self._read().to_pylist()]
        if status is not None:
            rows = [r for r in rows if r.status is DeadLetterStatus(status)]
        rows.sort(key=lambda r: (r.dead_at_ms, r.origin_msg_id), reverse=True)
        return rows if limit is None else rows[:limit]

    def dead_among(self, msg_ids: Iterable[str]) -> builtins.list[DeadLetterId]:
        """The ``DEAD`` rows whose ``msg_id`` is one of ``msg_ids``, as their ids.

        Reads four columns of the table, never the bodies, and builds an object only for
        the rows found: what a process checks at its start, however many letters the
        table holds.
        """
        wanted = pa.array(sorted(set(msg_ids)), pa.string())
        table = self._table(create=False)
        if table is None or len(wanted) == 0:
            return []

        def read() -> pa.Table:
            rows = read_table(table, DeadLetterId.COLUMNS)
            dead = pc.and_(
                pc.equal(rows.column("status").cast(pa.string()), str(DeadLetterStatus.DEAD)),
                pc.is_in(rows.column("msg_id").cast(pa.string()), value_set=wanted),
            )
            return rows.filter(dead)

        rows = self.faults.delta(
            read, what=f"read {self.name} at {self.path}", wrap=DeadLetterError
        )
        return [
            DeadLetterId(r["msg_id"], r["origin_msg_id"], r["key"], int(r["reconsume_times"]))
            for r in rows.to_pylist()
        ]

    def show(self, msg_id: str) -> builtins.list[DeadLetter]:
        """The rows whose ``origin_msg_id`` or ``msg_id`` is ``msg_id``."""
        return [r for r in self.list() if msg_id in (r.origin_msg_id, r.msg_id)]

    def count(self, status: DeadLetterStatus | None = None) -> int:
        """How many rows (of one status)."""
        return len(self.list(status=status))

    def counts(self) -> dict[tuple[str, str], int]:
        """Rows by (original topic, status), read from those two columns only."""
        table = self._table(create=False)
        if table is None:
            return {}

        def read() -> pa.Table:
            return (
                read_table(table, ["topic", "status"])
                .group_by(["topic", "status"])
                .aggregate([([], "count_all")])
            )

        rows = self.faults.delta(
            read, what=f"count {self.name} at {self.path}", wrap=DeadLetterError
        )
        return {(str(r["topic"]), str(r["status"])): int(r["count_all"]) for r in rows.to_pylist()}

    def _set_status(
        self,
        letters: Iterable[DeadLetter | tuple[str, str]],
        status: DeadLetterStatus,
        at_ms: int | None,
        by: str | None,
    ) -> int:
        ids = {(x.origin_msg_id, x.msg_id) if isinstance(x, DeadLetter) else x for x in letters}
        table = self._table(create=False)
        if not ids or table is None:
            return 0
        when = _ts(self.clock.now_ms() if at_ms is None else at_ms)
        source = pa.table(
            {
                "origin_msg_id": pa.array([i[0] for i in ids], pa.string()),
                "msg_id": pa.array([i[1] for i in ids], pa.string()),
                "status": pa.array([str(status)] * len(ids), pa.string()),
                "replayed_at": pa.array([when] * len(ids), _TS),
                "replayed_by": pa.array([by or current_user()] * len(ids), pa.string()),
            }
        )

        def update() -> int:
            _add_missing_columns(table)
            metrics = (
                table.merge(
                    source,
                    predicate=(
                        "t.origin_msg_id = s.origin_msg_id AND t.msg_id = s.msg_id "
                        "AND t.status = 'DEAD'"
                    ),
                    source_alias="s",
                    target_alias="t",
                )
                .when_matched_update(
                    updates={
                        "status": "s.status",
                        "replayed_at": "s.replayed_at",
                        "replayed_by": "s.replayed_by",
                    }
                )
                .execute()
            )
            return int(metrics.get("num_target_rows_updated", 0))

        return self.faults.delta(
            update, what=f"update {self.name} at {self.path}", wrap=DeadLetterError
        )

    def mark_replayed(
        self,
        letters: Iterable[DeadLetter | tuple[str, str]],
        *,
        at_ms: int | None = None,
        by: str | None = None,
    ) -> int:
        """Mark ``DEAD`` rows ``REPLAYED`` with when and by whom (default: this
        ``user@host``); returns rows changed."""
        return self._set_status(letters, DeadLetterStatus.REPLAYED, at_ms, by)

    def mark_discarded(
        self,
        letters: Iterable[DeadLetter | tuple[str, str]],
        *,
        at_ms: int | None = None,
        by: str | None = None,
    ) -> int:
        """Mark ``DEAD`` rows ``DISCARDED`` with when and by whom; returns rows changed."""
        return self._set_status(letters, DeadLetterStatus.DISCARDED, at_ms, by)


_REOPENED_COLUMNS = (
    "status",
    "body",
    "properties",
    "reconsume_times",
    "dead_at",
    "dead_date",
    "last_error",
    "errors",
)
"""What a second death after a replay rewrites in the letter's row (who replayed it stays)."""


def _add_missing_columns(table: DeltaTable) -> None:
    """Give a table made by an older idem the columns added since (``replayed_by``)."""
    known = {f.name for f in table.schema().fields}
    missing = [name for name in _ADDED_COLUMNS if name not in known]
    if missing:
        table.alter.add_columns(
            [Field(name, PrimitiveType(_ADDED_COLUMNS[name]), nullable=True) for name in missing]
        )


def _commit_properties(app_id: str | None, txn_version: int | None) -> CommitProperties | None:
    if app_id is None or txn_version is None:
        return None
    return CommitProperties(app_transactions=[Transaction(app_id=app_id, version=txn_version)])
