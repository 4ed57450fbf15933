"""Bounded retries for transient faults inside one attempt (tenacity), in one place.

A Redis connection reset or a Delta commit conflict is retried a few times with
exponential backoff and jitter; after that the failure is wrapped in idem's own
exception (``raise ... from exc``) and the caller falls through to the next path
(client-side resend, then "re-submit after 5 s"). A timeout is an unknown
outcome: every operation retried here is idempotent, so retrying it is safe and
nothing is reported as done until one attempt answered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import redis
from deltalake.exceptions import CommitFailedError, DeltaError
from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from idem.errors import IdemError, StoreUnavailable

T = TypeVar("T")
log = logging.getLogger(__name__)

REDIS_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.MasterDownError,
)
"""Redis failures worth another attempt (the server is away, loading, or failing over)."""

DELTA_TRANSIENT: tuple[type[BaseException], ...] = (CommitFailedError, DeltaError, OSError)
"""Delta failures worth another attempt (commit conflicts, object-store hiccups)."""

RESUBMIT_DELAY_MS = 5000
"""RocketMQ's ``submitConsumeRequestLater``: a send-back that failed every path is re-submitted
locally after 5 s."""


@dataclass(frozen=True, kw_only=True)
class FaultTolerance:
    """How hard each path tries before giving way to the next one."""

    redis_attempts: int = 3
    """Attempts of the primary send-back (journal → Redis) before the client-side resend."""
    fallback_attempts: int = 3
    """Attempts of the client-side resend before the caller is told to re-submit."""
    delta_attempts: int = 5
    """Attempts of a journal / DLQ commit."""
    wait_initial_s: float = 0.05
    wait_max_s: float = 1.0
    resubmit_delay_ms: int = RESUBMIT_DELAY_MS

    def call(
        self,
        fn: Callable[[], T],
        *,
        attempts: int,
        transient: tuple[type[BaseException], ...],
        wrap: type[IdemError],
        what: str,
    ) -> T:
        """Run ``fn`` with bounded retries on ``transient``; wrap the last failure in ``wrap``."""
        retrying = Retrying(
            stop=stop_after_attempt(max(attempts, 1)),
            wait=wait_exponential_jitter(
                multiplier=self.wait_initial_s, max=self.wait_max_s, jitter=self.wait_initial_s
            ),
            retry=retry_if_exception_type(transient),
            reraise=True,
            before_sleep=lambda rs: log.debug(
                "%s failed (attempt %d), retrying: %s",
                what,
                rs.attempt_number,
                rs.outcome.exception() if rs.outcome else None,
            ),
        )
        try:
            return retrying(fn)
        except transient as exc:
            raise wrap(f"{what} failed after {attempts} attempt(s): {exc}") from exc

    def redis(self, fn: Callable[[], T], *, what: str, attempts: int | None = None) -> T:
        """``fn`` against Redis; the last failure becomes :class:`StoreUnavailable`."""
        return self.call(
            fn,
            attempts=self.redis_attempts if attempts is None else attempts,
            transient=REDIS_TRANSIENT,
            wrap=StoreUnavailable,
            what=what,
        )

    def delta(self, fn: Callable[[], T], *, what: str, wrap: type[IdemError]) -> T:
        """``fn`` against a Delta table; the last failure becomes ``wrap``."""
        return self.call(
            fn, attempts=self.delta_attempts, transient=DELTA_TRANSIENT, wrap=wrap, what=what
        )


DEFAULT_FAULT_TOLERANCE = FaultTolerance()
