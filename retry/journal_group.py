"""Group commit of the retry journal: concurrent send-backs of one process share a commit.

A push consumer sends failed messages back from several consume threads at once, and
each send-back is a Delta commit of a few rows: tens of milliseconds, most of it the
commit itself. While one commit is being written, the send-backs that arrive meanwhile
gather in the next group; the first of them (the group's leader) writes them all as one
commit as soon as the previous commit is done, and every member gets that commit's
outcome: its version and every event it holds, or the error that ended it. No one waits
for a group to fill: a send-back alone is committed at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

E = TypeVar("E")
R = TypeVar("R")


@dataclass
class _Group(Generic[E, R]):
    """The events gathered for one commit, and its outcome once written."""

    events: list[E] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    result: R | None = None
    error: BaseException | None = None


class CommitGroups(Generic[E, R]):
    """Gathers concurrent appends into one commit each time the writer is free.

    ``writer_lock`` is the lock every commit of the journal holds while it writes: a
    group's leader takes it, and appends arriving while it waits join its group.
    """

    def __init__(self, writer_lock: threading.RLock) -> None:
        self._writer = writer_lock
        self._lock = threading.Lock()
        self._open: _Group[E, R] | None = None

    def append(self, events: Sequence[E], commit: Callable[[list[E]], R]) -> R:
        """Commit ``events`` together with those of concurrent callers; return the outcome
        of the commit that holds them (raise its error).

        ``commit`` writes a group's events as one commit, in the order given; it is
        called by the leader only, holding the writer lock, and must not call back here.
        """
        with self._lock:
            group = self._open
            leader = group is None
            if group is None:
                group = self._open = _Group()
            group.events.extend(events)
        if not leader:
            group.done.wait()
            if group.error is not None:
                raise group.error
            assert group.result is not None
            return group.result
        with self._writer:
            with self._lock:
                self._open = None  # closed: later appends gather for the next commit
            try:
                group.result = commit(group.events)
            except BaseException as exc:
                group.error = exc
                raise
            finally:
                group.done.set()
        return group.result
