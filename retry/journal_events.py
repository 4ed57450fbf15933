"""The rows of the retry journal: events, positions, and what applying them does.

See :mod:`idem.retry.journal` for the journal itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import pyarrow as pa

from idem.retry.store import REPLACED_KEPT_MS, Op


class JournalEventType(StrEnum):
    """What happened to a message of the resend path."""

    SCHEDULED = "SCHEDULED"
    """A send-back: ``msg_id`` waits in ``queue_id`` until ``due_ms`` (replacing ``replaces``)."""
    DEAD = "DEAD"
    """``msg_id`` was dead-lettered (its row is in ``%DLQ%<group>``)."""
    ACKED = "ACKED"
    """``msg_id`` was consumed successfully from the retry topic."""
    BASE = "BASE"
    """A snapshot row (:mod:`idem.retry.journal_base`): ``msg_id`` was live, scheduled as
    the row says, as of the version the base restates. Only rebuilds read it."""


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
        if self.event is JournalEventType.BASE:
            return None
        if self.event is JournalEventType.SCHEDULED:
            return self.replaces if self.replaces and self.replaces != self.msg_id else None
        return self.msg_id

    def ops(self, *, schedule: bool = True) -> list[Op]:
        """The apply.lua steps of this event (``schedule=False``: everything but placing the
        message, which a later event of the same slice removes again)."""
        if self.event is JournalEventType.SCHEDULED:
            if not schedule and not self.removes:
                return []
            return [
                Op(
                    "S" if schedule else "X",
                    self.msg_id,
                    self.origin_msg_id,
                    self.queue_id or "",
                    self.due_ms or 0,
                    self.wire or "",
                    replaces=self.removes or "",
                    at_ms=self.at_ms,
                )
            ]
        if self.removes:
            return [Op("R", self.removes, at_ms=self.at_ms)]
        return []

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
    """Msg id -> scheduling event of every message live after ``events`` (journal order).

    As apply.lua decides: a message is replaced once. A send-back of a message replaced
    within :data:`~idem.retry.store.REPLACED_KEPT_MS` (journal time) before it, or one
    placing such a message again, is a late copy and changes nothing.
    """
    live: dict[str, JournalEvent] = {}
    replaced: dict[str, int] = {}

    def late(msg_id: str, at_ms: int) -> bool:
        when = replaced.get(msg_id)
        return when is not None and at_ms - when <= REPLACED_KEPT_MS

    for event in events:
        if event.event is JournalEventType.SCHEDULED:
            gone = event.removes
            if late(event.msg_id, event.at_ms) or (gone is not None and late(gone, event.at_ms)):
                continue
            if gone is not None:
                live.pop(gone, None)
                replaced[gone] = event.at_ms
            live.setdefault(event.msg_id, event)
        elif event.removes:
            live.pop(event.removes, None)
    return live
