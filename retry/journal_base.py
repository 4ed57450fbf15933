"""Snapshots of the retry journal, so that rebuilding Redis does not replay all history.

The journal only grows: every send-back, acknowledgement and dead letter is a
row, and a Redis that lost its cursor used to replay them all from version 0.
``idem retry compact`` appends a *base*: one ``BASE`` row per message that is
live (scheduled or retrying, not yet acknowledged or dead) as of version ``L``,
in one commit whose commit info says ``idem.journal.base_of = L``. A rebuild
then applies the newest base and the events of versions after ``L`` only
(events committed between reading ``L`` and writing the base included);
incremental syncs skip ``BASE`` rows, which restate what Redis has already.

While a base is being applied the Redis cursor reads ``base:<version>:<row>``,
so a rebuild interrupted half-way resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from idem.retry.journal_events import JournalEvent, JournalEventType, JournalPosition

BASE_OF = "idem.journal.base_of"
"""Commit-info key of a base commit: the journal version the base restates."""
BASE_ROWS = "idem.journal.base_rows"
"""Commit-info key of a base commit: how many ``BASE`` rows it holds (a read of the base
that finds another number fails rather than rebuild from part of it)."""

_CURSOR_PREFIX = "base:"

HISTORY_WINDOWS = (100, 1_000, 10_000, None)
"""How many newest commits to look through for a base, in turn (``None``: all)."""


@dataclass(frozen=True, slots=True)
class JournalBase:
    """The newest base of a journal: its commit ``version``, the version it ``covers``,
    and the live messages as the scheduling events that rebuild them."""

    version: int
    covers: int
    live: tuple[JournalEvent, ...]

    @property
    def resumes_at(self) -> JournalPosition:
        """Where the events after the base begin."""
        return JournalPosition(self.covers + 1, 0)


def base_rows(live: list[JournalEvent], at_ms: int) -> list[JournalEvent]:
    """``BASE`` rows restating ``live`` scheduling events."""
    return [replace(event, event=JournalEventType.BASE, at_ms=at_ms) for event in live]


def as_scheduled(row: JournalEvent) -> JournalEvent:
    """The scheduling event a ``BASE`` row stands for (it replaces nothing: Redis is empty)."""
    return replace(row, event=JournalEventType.SCHEDULED, replaces=None)


def cursor_in_base(version: int, row: int) -> str:
    """The cursor while a base is applied: row ``row`` of base ``version`` is next."""
    return f"{_CURSOR_PREFIX}{version}:{row}"


def parse_base_cursor(raw: str | None) -> tuple[int, int] | None:
    """``(base version, next row)`` of a cursor written by :func:`cursor_in_base`."""
    if not raw or not raw.startswith(_CURSOR_PREFIX):
        return None
    version, _, row = raw[len(_CURSOR_PREFIX) :].partition(":")
    if not (version.isdigit() and row.isdigit()):
        return None
    return int(version), int(row)
