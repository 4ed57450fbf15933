"""The schedule service: moves due messages from the schedule queues to ``%RETRY%<group>``.

RocketMQ's ``ScheduleMessageService`` checks every level's queue every 100 ms.
Here a service sleeps exactly until the earliest head is due (or until it is
told that an earlier message arrived, over pub/sub), then moves every due
message with one Lua call per batch of up to ``batch_size``. Several services
may run for one group (threads, processes, hosts): each move is one atomic
script, so no message is moved twice. It also brings Redis up to date with the
retry journal every ``sync_interval_ms`` (and rebuilds it when Redis lost it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from idem.clock import SYSTEM_CLOCK, Clock
from idem.errors import IdemError
from idem.retry.faults import REDIS_TRANSIENT
from idem.retry.store import ScheduleStore

log = logging.getLogger(__name__)

SYNC_FAILURES: tuple[type[BaseException], ...] = (IdemError, *REDIS_TRANSIENT)
"""What a background journal sync may fail with and still be retried at the next interval."""

DEFAULT_BATCH_SIZE = 5000
"""Messages moved per Lua call (about 10 ms of Redis time)."""

DEFAULT_MAX_IDLE_MS = 1000
"""Longest wait without looking, in case a wake-up was missed (Redis restart, partition)."""

DEFAULT_SYNC_INTERVAL_MS = 5000
"""How often a running service reads the journal for send-backs Redis missed (a producer
that crashed between its journal commit and Redis). Producers apply their own commits, so
this is a safety net; a lost cursor (FLUSHALL, restart without persistence) is noticed
within a second and rebuilt at once."""

LOST_CURSOR_PROBE_MS = 1000
"""How often a running service checks that Redis still has the journal cursor."""

MAINTENANCE_CHECK_MS = 10_000
"""How often a running service offers to do the group's maintenance (journal compaction;
whether it is due is decided group-wide, see :meth:`RetryEngine.maybe_compact_journal`)."""


class ScheduleService:
    """Delivers scheduled messages of one group when they are due."""

    def __init__(
        self,
        store: ScheduleStore,
        *,
        clock: Clock = SYSTEM_CLOCK,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_idle_ms: int = DEFAULT_MAX_IDLE_MS,
        sync: Callable[[], object] | None = None,
        sync_interval_ms: int = DEFAULT_SYNC_INTERVAL_MS,
        maintenance: Callable[[], object] | None = None,
        name: str | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        self.store = store
        self.clock = clock
        self.batch_size = batch_size
        self.max_idle_ms = max_idle_ms
        self.sync = sync
        self.sync_interval_ms = sync_interval_ms
        self.maintenance = maintenance
        self.name = name or f"idem-schedule-{store.group}"
        self.moved_total = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_sync_ms: int | None = None
        self._last_maintenance_ms: int | None = None
        self._next_due_ms: int | None = None
        self._sync_thread: threading.Thread | None = None

    # -- one step ------------------------------------------------------------------------

    def _maybe_sync(self, now_ms: int) -> None:
        if self.sync is None:
            return
        if self._last_sync_ms is not None and now_ms - self._last_sync_ms < self.sync_interval_ms:
            return
        self._last_sync_ms = now_ms
        try:
            self.sync()
        except SYNC_FAILURES:
            log.warning("%s: journal sync failed; retrying later", self.name, exc_info=True)

    def _maybe_maintain(self, now_ms: int) -> None:
        if self.maintenance is None:
            return
        last = self._last_maintenance_ms
        if last is not None and now_ms - last < MAINTENANCE_CHECK_MS:
            return
        self._last_maintenance_ms = now_ms
        try:
            self.maintenance()
        except SYNC_FAILURES:
            log.warning("%s: journal maintenance failed; retrying later", self.name, exc_info=True)

    def tick(self) -> int:
        """Move every message due now; returns how many were moved.

        Called directly (tests, the Spark source) it also syncs with the journal when
        due; inside :meth:`run` the sync has its own thread so a slow Delta read never
        delays a move.
        """
        now = self.clock.now_ms()
        if self._sync_thread is None:
            self._maybe_sync(now)
        return self._move(now)

    def _move(self, now: int) -> int:
        moved = 0
        while True:
            result = self.store.move_due(now, self.batch_size)
            moved += result.moved
            self._next_due_ms = result.next_due_ms
            if result.moved + result.dropped < self.batch_size:
                break
        self.moved_total += moved
        return moved

    @property
    def next_due_ms(self) -> int | None:
        """The earliest head left after the last tick (``None``: queues empty)."""
        return self._next_due_ms

    # -- running -------------------------------------------------------------------------

    def _wait_ms(self) -> int:
        if self._next_due_ms is None:
            return self.max_idle_ms
        return max(0, min(self._next_due_ms - self.clock.now_ms(), self.max_idle_ms))

    def _sync_loop(self) -> None:
        # delta-rs holds the GIL while it reads, so the journal is read only when needed:
        # every sync_interval_ms, or at once when Redis lost the cursor (one cheap GET).
        probe_s = min(LOST_CURSOR_PROBE_MS, max(self.sync_interval_ms, 10)) / 1000
        while not self._stop.wait(probe_s):
            lost = False
            with contextlib.suppress(*REDIS_TRANSIENT):
                lost = self.store.cursor() is None
            if lost:
                self._last_sync_ms = None
            self._maybe_sync(self.clock.now_ms())
            self._maybe_maintain(self.clock.now_ms())

    def run(self) -> None:
        """Run until :meth:`stop` (or ``KeyboardInterrupt`` in the foreground)."""
        if self.sync is not None:
            self._maybe_sync(self.clock.now_ms())  # catch up (or rebuild) before moving
            self._sync_thread = threading.Thread(
                target=self._sync_loop, name=f"{self.name}-sync", daemon=True
            )
            self._sync_thread.start()
        try:
            self._run()
        finally:
            if self._sync_thread is not None:
                self._sync_thread.join(5)
                self._sync_thread = None

    def _run(self) -> None:
        pubsub: Any = None
        backoff_s = 0.05
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self.store.client.pubsub(  # type: ignore[no-untyped-call]
                        ignore_subscribe_messages=True
                    )
                    pubsub.subscribe(self.store.keys.wake_channel)
                    self._next_due_ms = self.clock.now_ms()  # look once right away
                if self._move(self.clock.now_ms()):
                    continue  # more may have come due while moving
                wait_ms = self._wait_ms()
                if wait_ms > 0:
                    # the wait itself: returns early when an earlier message is published
                    message = pubsub.get_message(timeout=wait_ms / 1000)
                    while message is not None:  # drain the burst of wake-ups
                        message = pubsub.get_message(timeout=0)
                backoff_s = 0.05
            except REDIS_TRANSIENT as exc:
                log.warning(
                    "%s: Redis unavailable (%s); retrying in %.2fs", self.name, exc, backoff_s
                )
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        log.debug("closing pubsub failed", exc_info=True)
                    pubsub = None
                self._stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 1.0)
        if pubsub is not None:
            pubsub.close()

    def start(self) -> ScheduleService:
        """Run in a daemon thread."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it."""
        self._stop.set()
        with contextlib.suppress(*REDIS_TRANSIENT):
            self.store.wake()  # if Redis is away, the loop is in a backoff wait the event ends
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def wake(self) -> None:
        """Look at the queues now (a message with an earlier due time was scheduled)."""
        self.store.wake()

    def __enter__(self) -> ScheduleService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
