"""One timer thread per consumer: delayed and periodic tasks (RocketMQ's scheduled executors).

Used for the offset persist (every 5 s), orderly lock renewal (every 20 s),
``submitConsumeRequestLater`` (5 s), an orderly queue's suspension (1 s) and
similar. A task that raises is logged and, if periodic, runs again.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(order=True)
class _Task:
    due: float
    seq: int
    fn: Callable[[], object] = field(compare=False)
    period_s: float | None = field(compare=False, default=None)
    name: str = field(compare=False, default="")


class Scheduler:
    """Runs callables later, once or periodically, on one daemon thread (monotonic time)."""

    def __init__(self, name: str = "idem-timer") -> None:
        self.name = name
        self._heap: list[_Task] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread."""
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def schedule(self, delay_ms: float, fn: Callable[[], object], *, name: str = "") -> None:
        """Run ``fn`` once, ``delay_ms`` from now."""
        self._push(_Task(time.monotonic() + delay_ms / 1000, next(self._seq), fn, None, name))

    def every(
        self,
        period_ms: float,
        fn: Callable[[], object],
        *,
        initial_delay_ms: float | None = None,
        name: str = "",
    ) -> None:
        """Run ``fn`` every ``period_ms`` (first after ``initial_delay_ms``, default one period)."""
        first = period_ms if initial_delay_ms is None else initial_delay_ms
        self._push(
            _Task(time.monotonic() + first / 1000, next(self._seq), fn, period_ms / 1000, name)
        )

    def _push(self, task: _Task) -> None:
        with self._cond:
            if self._stopped:
                return
            heapq.heappush(self._heap, task)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped:
                    now = time.monotonic()
                    if self._heap and self._heap[0].due <= now:
                        break
                    timeout = self._heap[0].due - now if self._heap else None
                    self._cond.wait(timeout)
                if self._stopped:
                    return
                task = heapq.heappop(self._heap)
            try:
                task.fn()
            except Exception:
                log.exception("%s: task %s failed", self.name, task.name or task.fn)
            if task.period_s is not None:
                task.due = max(task.due + task.period_s, time.monotonic())
                task.seq = next(self._seq)
                self._push(task)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop; pending tasks are forgotten."""
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._thread = None
