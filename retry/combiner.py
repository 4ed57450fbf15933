"""Concurrent calls of one process combined into one: the send-backs of a push consumer.

A push consumer runs consume requests on several threads, and each request whose
messages failed sends them back: one retry-journal commit (a Delta commit, tens of
milliseconds) and one Redis apply per call, however few messages it carries. While one
send-back is under way, the send-backs that arrive meanwhile gather in the next group;
the first of them (the group's leader) makes one call for all of their items as soon
as the previous call is done, and every member gets its own items' results, or the
error that ended the call. Nothing waits for a group to fill: a call alone is made at
once, and under load the groups grow by themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Group(Generic[T, R]):
    """The items gathered for one call, and its outcome once made."""

    items: list[T] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    results: Sequence[R] = ()
    error: BaseException | None = None


class CallCombiner(Generic[T, R]):
    """Combines concurrent calls into one call each time the previous one is done."""

    def __init__(self) -> None:
        self._calling = threading.Lock()
        self._lock = threading.Lock()
        self._open: _Group[T, R] | None = None

    def call(self, items: Sequence[T], run: Callable[[list[T]], Sequence[R]]) -> list[R]:
        """Run ``items`` together with the items of concurrent callers; return the results
        of this caller's items, in their order (raise the call's error).

        ``run`` takes a group's items in the order they joined and returns one result per
        item, in that order. It is called by the group's leader only, one call at a time,
        and must not call back into this combiner.
        """
        with self._lock:
            group = self._open
            leader = group is None
            if group is None:
                group = self._open = _Group()
            start = len(group.items)
            group.items.extend(items)
        if leader:
            with self._calling:
                with self._lock:
                    self._open = None  # closed: later calls gather for the next group
                try:
                    group.results = run(group.items)
                    if len(group.results) != len(group.items):
                        raise RuntimeError(
                            f"{len(group.results)} results for {len(group.items)} items"
                        )
                except BaseException as exc:
                    group.error = exc
                    raise
                finally:
                    group.done.set()
        else:
            group.done.wait()
            if group.error is not None:
                raise group.error
        return list(group.results[start : start + len(items)])
