"""The schedule service: moves due messages from the schedule queues to ``%RETRY%<group>``.

RocketMQ's ``ScheduleMessageService`` checks every level's queue every 100 ms.
Here a service sleeps exactly until the earliest head is due (or until it is
told that an earlier message arrived, over pub/sub), then moves every due
message with one Lua call per batch of up to ``batch_size``. Several services
may run for one group (threads, processes, hosts): each move is one atomic
script, so no message is moved twice. It also brings Redis up to date with the
retry journal every ``sync_interval_ms`` (and rebuilds it when Redis lost it).

A running service outlives every error Redis answers with, not only an outage:
a full Redis (``OOM`` under the ``noeviction`` policy idem requires), a refused
write (``MISCONF``) or any other error reply is logged and retried after a
bounded backoff, and the service resumes moving once Redis accepts writes
again. Only an error that is not Redis's nor idem's (a bug) ends its thread;
:attr:`ScheduleService.alive` and :attr:`ScheduleService.failure` tell, and
``idem schedule`` exits non-zero on it so that a supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from idem import metrics
from idem.clock import SYSTEM_CLOCK, Clock
from idem.errors import ConfigError, IdemError
from idem.retry.faults import REDIS_TRANSIENT
from idem.retry.store import ScheduleStore

log = logging.getLogger(__name__)

SYNC_FAILURES: tuple[type[BaseException], ...] = (IdemError, redis.exceptions.RedisError)
"""What a background journal sync may fail with and still be retried at the next interval:
idem's own errors and every error of Redis (an outage, or an error reply such as ``OOM``)."""

SERVICE_FAILURES: tuple[type[BaseException], ...] = (IdemError, redis.exceptions.RedisError)
"""What the moving loop outlives (logged, retried after a backoff); anything else ends it."""

INITIAL_BACKOFF_S = 0.05
"""First wait after a failed step of the moving loop; it doubles on every failure in a row."""

MAX_BACKOFF_S = 1.0
"""Longest wait between two attempts of the moving loop while Redis fails, so that due
messages move again within a second once Redis recovers."""

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
        if isinstance(max_idle_ms, bool) or not isinstance(max_idle_ms, int) or max_idle_ms < 1:
            # with nothing due the loop would wait max_idle_ms: 0 or less never waits (a busy
            # loop on Redis), as `idem schedule --max-idle-ms` refuses too
            raise ConfigError(f"max_idle_ms: must be a whole number >= 1, got {max_idle_ms!r}")
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
        self.failure: BaseException | None = None
        """The unexpected error that ended the service's thread (``None``: none did)."""
        self.failing: BaseException | None = None
        """The last error of the moving loop while it fails in a row (``None``: it moves)."""

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
        except Exception:
            # a safety net that is tried again every interval: moving must go on meanwhile
            log.exception("%s: journal sync failed unexpectedly; retrying later", self.name)

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
        except Exception:
            log.exception("%s: journal maintenance failed unexpectedly; retrying later", self.name)

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
            if result.moved:
                metrics.observe(
                    "schedule_lateness_seconds",
                    self.store.group,
                    *(ms / 1000 for ms in result.lateness_ms),
                )
            self._next_due_ms = result.next_due_ms
            if result.moved + result.dropped < self.batch_size:
                break
        self.moved_total += moved
        metrics.count("schedule_moved", self.store.group, moved)
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
            with contextlib.suppress(redis.exceptions.RedisError):
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
        backoff_s = INITIAL_BACKOFF_S
        failures = 0
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self.store.client.pubsub(  # type: ignore[no-untyped-call,unused-ignore]
                        ignore_subscribe_messages=True
                    )
                    pubsub.subscribe(self.store.keys.wake_channel)
                    self._next_due_ms = self.clock.now_ms()  # look once right away
                if self._move(self.clock.now_ms()):
                    self._recovered(failures)
                    failures, backoff_s = 0, INITIAL_BACKOFF_S
                    continue  # more may have come due while moving
                wait_ms = self._wait_ms()
                if wait_ms > 0:
                    # the wait itself: returns early when an earlier message is published
                    message = pubsub.get_message(timeout=wait_ms / 1000)
                    while message is not None:  # drain the burst of wake-ups
                        message = pubsub.get_message(timeout=0)
                self._recovered(failures)
                failures, backoff_s = 0, INITIAL_BACKOFF_S
            except SERVICE_FAILURES as exc:
                if isinstance(exc, redis.exceptions.RedisError):
                    metrics.count("redis_errors", self.store.group, component="schedule")
                self._log_failure(exc, failures, backoff_s)
                self.failing = exc
                failures += 1
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        log.debug("closing pubsub failed", exc_info=True)
                    pubsub = None
                self._stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, MAX_BACKOFF_S)
        if pubsub is not None:
            pubsub.close()

    def _log_failure(self, exc: BaseException, failures: int, backoff_s: float) -> None:
        """An outage is a warning; an error reply (OOM, MISCONF, ...) is an error, with its
        traceback the first time in a row only (it may repeat every second for hours)."""
        if isinstance(exc, REDIS_TRANSIENT):
            log.warning("%s: Redis unavailable (%s); retrying in %.2fs", self.name, exc, backoff_s)
        elif failures == 0:
            log.error(
                "%s: moving due messages failed (%s: %s); retrying every %.2fs or less "
                "until it succeeds",
                self.name,
                type(exc).__name__,
                exc,
                MAX_BACKOFF_S,
                exc_info=exc,
            )
        else:
            log.warning(
                "%s: still failing (%s: %s), attempt %d; retrying in %.2fs",
                self.name,
                type(exc).__name__,
                exc,
                failures + 1,
                backoff_s,
            )

    def _recovered(self, failures: int) -> None:
        self.failing = None
        if failures:
            log.info("%s: moving again after %d failed attempt(s)", self.name, failures)

    def _run_until_stopped(self) -> None:
        try:
            self.run()
        except BaseException as exc:
            self.failure = exc
            log.critical(
                "%s: the schedule service stopped: %s: %s",
                self.name,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )

    @property
    def alive(self) -> bool:
        """Whether the thread :meth:`start` began is still running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> ScheduleService:
        """Run in a daemon thread."""
        if self._thread is not None and self._thread.is_alive():
            if not self._stop.is_set():
                return self
            self._thread.join(5.0)  # stopped without waiting (stop(timeout=0)): let it end
        self._stop.clear()
        self.failure = None
        self._thread = threading.Thread(target=self._run_until_stopped, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it."""
        self._stop.set()
        with contextlib.suppress(redis.exceptions.RedisError):
            self.store.wake()  # if Redis is away, the loop is in a backoff wait the event ends
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None  # else a later stop() waits for it again

    def wake(self) -> None:
        """Look at the queues now (a message with an earlier due time was scheduled)."""
        self.store.wake()

    def __enter__(self) -> ScheduleService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
