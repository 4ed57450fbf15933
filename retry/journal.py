"""The Delta retry journal: the log of truth of the resend path; Redis is rebuilt from it.

Every send-back (``SCHEDULED``), dead-letter (``DEAD``) and acknowledgement
(``ACKED``) is appended here — one commit per batch, with ``txnAppId`` /
``txnVersion`` when the caller has them — *before* it is applied to Redis. The
Redis side keeps a cursor: the next journal position (commit version, row) it
has applied, moved in the same Lua call as the effects. :meth:`RetryJournal.sync`
applies whatever the cursor has not seen, in journal order; a missing cursor
(``FLUSHALL``, a restart without persistence) means "apply everything from
version 0", which is the rebuild. Losing Redis costs time, never a message.

The table has Delta's change data feed enabled, so the rows of a range of
versions are read without scanning the table (``load_cdf``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import CommitProperties, Transaction

from idem.retry.errors import JournalError
from idem.retry.faults import DEFAULT_FAULT_TOLERANCE, FaultTolerance
from idem.retry.store import APPLY_CHUNK, ApplyResult, Op, ScheduleStore


class JournalEventType(StrEnum):
    """What happened to a message of the resend path."""

    SCHEDULED = "SCHEDULED"
    """A send-back: ``msg_id`` waits in ``queue_id`` until ``due_ms`` (replacing ``replaces``)."""
    DEAD = "DEAD"
    """``msg_id`` was dead-lettered (its row is in ``%DLQ%<group>``)."""
    ACKED = "ACKED"
    """``msg_id`` was consumed successfully from the retry topic."""


JOURNAL_SCHEMA = pa.schema(
    [
        ("group", pa.string()),
        ("seq", pa.int32()),
        ("event", pa.string()),
        ("msg_id", pa.string()),
        ("origin_msg_id", pa.string()),
        ("key", pa.string()),
        ("reconsume_times", pa.int32()),
        ("delay_level", pa.int32()),
        ("queue_id", pa.string()),
        ("due_ms", pa.int64()),
        ("replaces", pa.string()),
        ("wire", pa.string()),
        ("at_ms", pa.int64()),
        ("app_id", pa.string()),
        ("txn_version", pa.int64()),
    ]
)
"""One row per event; ``seq`` orders the rows of one commit."""


@dataclass(frozen=True, slots=True)
class JournalEvent:
    """One row of the journal."""

    event: JournalEventType
    msg_id: str
    origin_msg_id: str
    key: str | None = None
    reconsume_times: int = 0
    delay_level: int = 0
    queue_id: str | None = None
    due_ms: int | None = None
    replaces: str | None = None
    wire: str | None = None
    at_ms: int = 0

    @property
    def removes(self) -> str | None:
        """The msg id this event takes out of Redis, if any."""
        if self.event is JournalEventType.SCHEDULED:
            return self.replaces if self.replaces and self.replaces != self.msg_id else None
        return self.msg_id

    def ops(self, *, schedule: bool = True) -> list[Op]:
        """The apply.lua steps of this event (``schedule=False`` keeps only the removal)."""
        out: list[Op] = []
        if self.removes:
            out.append(Op("R", self.removes))
        if schedule and self.event is JournalEventType.SCHEDULED:
            out.append(
                Op(
                    "S",
                    self.msg_id,
                    self.origin_msg_id,
                    self.queue_id or "",
                    self.due_ms or 0,
                    self.wire or "",
                )
            )
        return out

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> JournalEvent:
        """From a journal row."""
        return cls(
            event=JournalEventType(row["event"]),
            msg_id=row["msg_id"],
            origin_msg_id=row["origin_msg_id"],
            key=row["key"],
            reconsume_times=int(row["reconsume_times"] or 0),
            delay_level=int(row["delay_level"] or 0),
            queue_id=row["queue_id"],
            due_ms=row["due_ms"],
            replaces=row["replaces"],
            wire=row["wire"],
            at_ms=int(row["at_ms"] or 0),
        )


@dataclass(frozen=True, order=True, slots=True)
class JournalPosition:
    """A place in the journal: commit ``version``, row ``seq`` inside it."""

    version: int
    seq: int

    def __str__(self) -> str:
        return f"{self.version}:{self.seq}"

    @classmethod
    def parse(cls, text: str | None) -> JournalPosition | None:
        """Parse ``"<version>:<seq>"``; ``None`` or garbage gives ``None``."""
        if not text:
            return None
        version, _, seq = text.partition(":")
        if not (version.isdigit() and seq.isdigit()):
            return None
        return cls(int(version), int(seq))


START = JournalPosition(0, 0)

JOURNAL_CONFIGURATION = {
    "delta.enableChangeDataFeed": "true",
    # Redis is rebuilt by replaying the log from version 0: keep every commit file.
    "delta.logRetentionDuration": "interval 36500 days",
    "delta.enableExpiredLogCleanup": "false",
}
"""Table properties of the journal, set when it is created."""


def plan(events: Sequence[tuple[JournalPosition, JournalEvent]]) -> list[list[Op]]:
    """The apply.lua steps of ``events`` (in journal order), one list per event.

    A message scheduled and then removed later in the same slice is not scheduled
    at all: replaying it would hand a consumer a message that was already done.
    """
    last_removal: dict[str, int] = {}
    for index, (_pos, event) in enumerate(events):
        if event.removes:
            last_removal[event.removes] = index
    return [
        event.ops(schedule=last_removal.get(event.msg_id, -1) <= index)
        for index, (_pos, event) in enumerate(events)
    ]


def live_messages(events: Iterable[JournalEvent]) -> dict[str, JournalEvent]:
    """Msg id -> scheduling event of every message live after ``events`` (journal order)."""
    live: dict[str, JournalEvent] = {}
    for event in events:
        if event.removes:
            live.pop(event.removes, None)
        if event.event is JournalEventType.SCHEDULED:
            live.setdefault(event.msg_id, event)
    return live


class RetryJournal:
    """The retry journal of one group at ``path`` (a Delta table, change data feed on)."""

    def __init__(
        self,
        path: str,
        group: str,
        *,
        storage_options: Mapping[str, str] | None = None,
        faults: FaultTolerance = DEFAULT_FAULT_TOLERANCE,
    ) -> None:
        self.path = path
        self.group = group
        self.storage_options = dict(storage_options) if storage_options else None
        self.faults = faults
        self._table: DeltaTable | None = None
        self._lock = threading.RLock()

    # -- writing -------------------------------------------------------------------------

    def append(
        self,
        events: Sequence[JournalEvent],
        *,
        app_id: str | None = None,
        txn_version: int | None = None,
    ) -> int | None:
        """Append ``events`` as one commit and return its version.

        ``None`` when ``(app_id, txn_version)`` is already committed (a replayed batch)
        or there is nothing to append.
        """
        if not events:
            return None
        rows = [
            {
                "group": self.group,
                "seq": seq,
                "event": str(e.event),
                "msg_id": e.msg_id,
                "origin_msg_id": e.origin_msg_id,
                "key": e.key,
                "reconsume_times": e.reconsume_times,
                "delay_level": e.delay_level,
                "queue_id": e.queue_id,
                "due_ms": e.due_ms,
                "replaces": e.replaces,
                "wire": e.wire,
                "at_ms": e.at_ms,
                "app_id": app_id,
                "txn_version": txn_version,
            }
            for seq, e in enumerate(events)
        ]
        data = pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA)
        props = None
        if app_id is not None and txn_version is not None:
            props = CommitProperties(
                app_transactions=[Transaction(app_id=app_id, version=txn_version)]
            )

        def write() -> int | None:
            with self._lock:
                if props is not None and self.committed(app_id or "", txn_version or 0):
                    return None
                table = self._load() or self._create()
                # writing through the table object leaves it at exactly our commit's version
                write_deltalake(table, data, mode="append", commit_properties=props)
                return table.version()

        return self.faults.delta(write, what="retry journal append", wrap=JournalError)

    def _create(self) -> DeltaTable:
        DeltaTable.create(
            self.path,
            schema=JOURNAL_SCHEMA,
            mode="ignore",  # another writer may have created it a moment ago
            name=f"retry journal of {self.group}",
            configuration=JOURNAL_CONFIGURATION,
            storage_options=self.storage_options,
        )
        table = self._load()
        assert table is not None
        return table

    # -- reading -------------------------------------------------------------------------

    def _load(self) -> DeltaTable | None:
        if self._table is None:
            if not DeltaTable.is_deltatable(self.path, storage_options=self.storage_options):
                return None
            self._table = DeltaTable(self.path, storage_options=self.storage_options)
        else:
            self._table.update_incremental()
        return self._table

    def committed(self, app_id: str, txn_version: int) -> bool:
        """Whether a commit with ``(app_id, >= txn_version)`` is in the journal."""
        with self._lock:
            table = self._load()
            done = None if table is None else table.transaction_version(app_id)
            return done is not None and done >= txn_version

    def latest_version(self) -> int | None:
        """The newest commit version (``None``: no journal yet)."""
        with self._lock:
            table = self._load()
            return None if table is None else table.version()

    def read_since(
        self, position: JournalPosition
    ) -> tuple[list[tuple[JournalPosition, JournalEvent]], JournalPosition]:
        """Events at or after ``position`` in journal order, and the position after them."""

        def read() -> tuple[list[tuple[JournalPosition, JournalEvent]], JournalPosition]:
            with self._lock:
                table = self._load()
                if table is None:
                    return [], position
                latest = table.version()
                if position.version > latest:
                    return [], position
                reader = table.load_cdf(starting_version=position.version, ending_version=latest)
                rows = pa.table(reader).to_pylist()
            events = sorted(
                (
                    (
                        JournalPosition(int(r["_commit_version"]), int(r["seq"])),
                        JournalEvent.from_row(r),
                    )
                    for r in rows
                    if r["_change_type"] == "insert"
                ),
                key=lambda item: item[0],
            )
            return [e for e in events if e[0] >= position], JournalPosition(latest + 1, 0)

        return self.faults.delta(read, what="retry journal read", wrap=JournalError)

    def events(self) -> list[JournalEvent]:
        """Every event, in journal order."""
        return [event for _pos, event in self.read_since(START)[0]]

    # -- bringing Redis up to date -------------------------------------------------------

    def sync(
        self,
        store: ScheduleStore,
        *,
        own: tuple[int, Sequence[JournalEvent]] | None = None,
    ) -> ApplyResult:
        """Apply to ``store`` every event its cursor has not seen, in journal order.

        Safe with several callers at once: each slice is applied by whoever moves the
        cursor first; the others see the cursor moved and read on from there. ``own``
        is ``(version, events)`` of the commit the caller just made: when the cursor
        stands right before it, its events are applied without reading them back.
        """
        total = ApplyResult()
        while True:
            raw = store.cursor()
            start = JournalPosition.parse(raw) or START
            if own is not None and raw is not None and start == JournalPosition(own[0], 0):
                events = [(JournalPosition(own[0], seq), e) for seq, e in enumerate(own[1])]
                end = JournalPosition(own[0] + 1, 0)
            else:
                events, end = self.read_since(start)
                if not events and raw is not None and start >= end:
                    return total
            own = None
            steps = plan(events)
            expect: str | None = raw
            conflict = False
            chunk: list[Op] = []
            for index in range(len(events) + 1):
                at_end = index == len(events)
                if not at_end:
                    chunk += steps[index]
                if at_end or (len(chunk) >= APPLY_CHUNK and index + 1 < len(events)):
                    new = str(end if at_end else events[index + 1][0])
                    result = store.apply(chunk, expect=expect, new=new)
                    if isinstance(result, str):
                        conflict = True
                        break
                    total += result
                    expect, chunk = new, []
            if not conflict:
                return total

    def rebuild(self, store: ScheduleStore, *, purge: bool = True) -> ApplyResult:
        """Rebuild the group's Redis side from the journal alone (``purge``: clear it first)."""
        if purge:
            store.purge()
        else:
            store.client.delete(store.keys.cursor)
        return self.sync(store)
