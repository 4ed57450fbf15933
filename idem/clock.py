"""Time as an injected dependency, so a test of a 2-hour delay never sleeps."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Wall time in milliseconds since the epoch, and a way to wait.

    Leases and the dedup window do not run on this clock in production: with the
    system clock (:data:`SYSTEM_CLOCK`, every default) the Redis scripts that decide
    them read Redis's own clock (``TIME``), and the stamps and generation names
    the caller needs come from its estimate of that clock (see
    :meth:`idem.hotstore.RedisHotStore.now_ms`). A process whose clock is stepped
    therefore takes over no live lease and re-admits no completed key. Any other
    clock is a test hook: its instant is passed to the scripts, which decide by
    it, so a test can expire a lease or end a window without waiting. Delays,
    timeouts and the ledger's own horizons still follow this clock.
    """

    def now_ms(self) -> int:
        """The current time in epoch milliseconds."""
        ...

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""
        ...


class SystemClock:
    """The real clock."""

    def now_ms(self) -> int:
        """The current wall time in epoch milliseconds."""
        return time.time_ns() // 1_000_000

    def sleep(self, seconds: float) -> None:
        """Sleep for real."""
        if seconds > 0:
            time.sleep(seconds)


class ManualClock:
    """A clock that moves only when told to; ``sleep`` advances it instantly."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        """The clock's current reading."""
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        with self._lock:
            self._now += round(seconds * 1000)

    def sleep(self, seconds: float) -> None:
        """Advance instead of sleeping."""
        self.advance(max(seconds, 0.0))


SYSTEM_CLOCK = SystemClock()
