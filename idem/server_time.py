"""Redis's clock as this process sees it: the time leases and the dedup window run on.

The Lua scripts read Redis's ``TIME`` for every lease and dedup-window decision,
so a process whose own clock is stepped or runs ahead cannot take over a live
lease or see a completed key as new. The caller still has to name the
generation hashes a script may touch before it runs (a Redis Cluster routes and
checks the declared keys), and it stamps ``completed_at`` on what it commits:
both come from :class:`ServerClock`, Redis's ``TIME`` read now and then and
carried forward on the monotonic clock, which a step of the wall clock does not
move.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import redis

from idem.errors import StoreUnavailable
from idem.redis_cluster import RedisClient

RESYNC_NS = 10_000_000_000
"""How long a reading of Redis's ``TIME`` is carried forward before it is read again."""
SLACK_MS = 2_000
"""How far a script's ``TIME`` may be from this process's estimate of it: the
generation names declared for a call cover the estimate plus or minus this."""


@dataclass(frozen=True)
class Instant:
    """When a script call runs, as far as its caller can tell.

    ``ms`` is the caller's estimate (epoch milliseconds), the script's instant lies
    within ``ms ± slack_ms``, and ``arg`` is the ``now_ms`` argument the script is
    given: empty for Redis's clock, else the exact instant of a test clock.
    """

    ms: int
    slack_ms: int
    arg: str

    @property
    def low(self) -> int:
        """The earliest the script's instant can be."""
        return self.ms - self.slack_ms

    @property
    def high(self) -> int:
        """The latest the script's instant can be."""
        return self.ms + self.slack_ms


class ServerClock:
    """Redis's clock, estimated: ``TIME`` read at most every :data:`RESYNC_NS`, then
    advanced on ``time.monotonic_ns``. Thread-safe.

    Only the first reading must succeed: when a later one fails (Redis is down
    for a moment) the last one is carried on, which the monotonic clock keeps
    within milliseconds, so a commit whose ledger write needs no Redis is not
    held up by it.

    On a Redis Cluster ``TIME`` is read from one node: the nodes' clocks are
    expected to agree within :data:`SLACK_MS` (NTP does much better).
    """

    def __init__(self, client: RedisClient, group: str) -> None:
        self._client = client
        self._group = group
        self._lock = threading.Lock()
        self._base_ms: int | None = None
        self._base_ns = 0
        self._next_ns: int | None = None  # when to read TIME again (None: at once)

    def now_ms(self) -> int:
        """Redis's current time in epoch milliseconds (raises :class:`StoreUnavailable`
        when Redis cannot be asked)."""
        with self._lock:
            mono = time.monotonic_ns()
            if self._next_ns is None or mono >= self._next_ns:
                try:
                    self._sync()
                except StoreUnavailable:
                    if self._base_ms is None:
                        raise
                    self._next_ns = mono + RESYNC_NS  # not on every call while Redis is down
                mono = time.monotonic_ns()
            assert self._base_ms is not None
            return self._base_ms + (mono - self._base_ns) // 1_000_000

    def forget(self) -> None:
        """Read ``TIME`` again on the next :meth:`now_ms` (a script found Redis's clock
        outside the estimate: the server's clock was stepped)."""
        with self._lock:
            self._next_ns = None

    def _sync(self) -> None:
        before = time.monotonic_ns()
        try:
            seconds, micros = self._client.time()
        except redis.RedisError as exc:
            raise StoreUnavailable(
                f"Redis TIME for group {self._group!r} failed: {exc} (read before a call: "
                "nothing was sent)"
            ) from exc
        after = time.monotonic_ns()
        self._base_ms = int(seconds) * 1000 + int(micros) // 1000
        self._base_ns = (before + after) // 2
        self._next_ns = after + RESYNC_NS
