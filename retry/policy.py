"""Retry policies: small callables over one frozen :class:`DeliveryState`.

A policy is a *stop* condition (when to give up and dead-letter) and a
*backoff* (how long to wait). Both compose the way tenacity's strategies do:
stop conditions with ``|`` and ``&``, backoffs with ``+``. The two presets are
RocketMQ's: :class:`RocketMQLadder` (the 18 delay levels, ``3 + reconsume_times``,
16 reconsumes) and :class:`ExponentialRetryPolicy` (RocketMQ 5's exponential
policy, delivered by the timer queue).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from idem.delay_levels import DEFAULT_MAX_RECONSUME_TIMES, DelayLevels
from idem.errors import ConfigError


@dataclass(frozen=True, slots=True)
class DeliveryState:
    """Everything a policy may look at for one failed message.

    ``requested_level`` is the consumer's ``delay_level_when_next_consume``
    (``-1`` dead-letter now, ``0`` let the policy choose, ``> 0`` that level).
    """

    key: str | None
    reconsume_times: int
    first_seen_ms: int
    now_ms: int
    last_error: str | None = None
    requested_level: int = 0
    topic: str = ""


@dataclass(frozen=True, slots=True)
class Delay:
    """A wait: a delay ``level`` (1-based) or ``level == 0`` for a custom delay in ms."""

    level: int
    delay_ms: int


@dataclass(frozen=True, slots=True)
class RetryDecision:
    """Either a :class:`Delay` or dead (``delay is None``), with a reason for the DLQ row."""

    delay: Delay | None
    reason: str = ""

    @property
    def dead(self) -> bool:
        """Whether the message goes to ``%DLQ%<group>``."""
        return self.delay is None


class RetryPolicy(Protocol):
    """What the send-back processor asks: retry (when) or give up?"""

    def __call__(self, state: DeliveryState) -> RetryDecision:
        """Decide for one failed message."""
        ...


@dataclass(frozen=True, slots=True)
class Stop:
    """A give-up condition; compose with ``|`` (either) and ``&`` (both).

    ``reason`` describes the condition; :meth:`explain` says why it fired for one
    message (for the DLQ row): of ``a | b`` only the part that fired.
    """

    test: Callable[[DeliveryState], bool]
    reason: str
    why: Callable[[DeliveryState], str] | None = None

    def __call__(self, state: DeliveryState) -> bool:
        """Whether to give up."""
        return self.test(state)

    def explain(self, state: DeliveryState) -> str:
        """Why this condition gives ``state`` up (call when it does)."""
        return self.why(state) if self.why is not None else self.reason

    def __or__(self, other: Stop) -> Stop:
        return Stop(
            lambda s: self(s) or other(s),
            f"{self.reason} or {other.reason}",
            lambda s: self.explain(s) if self(s) else other.explain(s),
        )

    def __and__(self, other: Stop) -> Stop:
        return Stop(
            lambda s: self(s) and other(s),
            f"{self.reason} and {other.reason}",
            lambda s: f"{self.explain(s)} and {other.explain(s)}",
        )


def stop_after_reconsume_times(limit: int) -> Stop:
    """Give up once ``reconsume_times >= limit`` (RocketMQ's ``maxReconsumeTimes``)."""
    if limit < 0:
        raise ConfigError(f"max_reconsume_times: must be >= 0, got {limit}")
    return Stop(lambda s: s.reconsume_times >= limit, f"reconsume times reached max ({limit})")


def stop_on_dead_letter_request() -> Stop:
    """Give up when the consumer asked for it (``delay_level_when_next_consume < 0``)."""
    reason = "delay level < 0 (dead-letter requested)"
    return Stop(
        lambda s: s.requested_level < 0,
        reason,
        lambda s: f"{reason}: {s.last_error}" if s.last_error else reason,
    )


def stop_after_elapsed(limit_ms: int) -> Stop:
    """Give up once the first failure is ``limit_ms`` or more in the past."""
    return Stop(lambda s: s.now_ms - s.first_seen_ms >= limit_ms, f"retrying for {limit_ms} ms")


@dataclass(frozen=True, slots=True)
class Backoff:
    """A wait strategy; ``a + b`` waits the sum (a custom delay on the timer queue)."""

    wait: Callable[[DeliveryState], Delay]

    def __call__(self, state: DeliveryState) -> Delay:
        """The delay for ``state``."""
        return self.wait(state)

    def __add__(self, other: Backoff) -> Backoff:
        return Backoff(lambda s: Delay(0, self(s).delay_ms + other(s).delay_ms))


def ladder_backoff(levels: DelayLevels) -> Backoff:
    """The broker's rule: the client's level if ``> 0``, else ``3 + reconsume_times`` (clamped)."""

    def wait(state: DeliveryState) -> Delay:
        level = (
            min(state.requested_level, levels.max_level)
            if state.requested_level > 0
            else levels.level_for_retry(state.reconsume_times)
        )
        return Delay(level, levels.delay_ms(level))

    return Backoff(wait)


def exponential_backoff(
    initial_ms: int, multiplier: float, max_ms: int, levels: DelayLevels | None = None
) -> Backoff:
    """``min(initial * multiplier ** reconsume_times, max)``; a client-chosen level wins."""
    for name, value in (("initial_ms", initial_ms), ("multiplier", multiplier), ("max_ms", max_ms)):
        # NaN passes every comparison below, and an infinity ends in int(inf) on send-back
        if not math.isfinite(value):
            raise ConfigError(f"exponential retry: {name}: must be a finite number, got {value}")
    if initial_ms <= 0 or max_ms < initial_ms or multiplier < 1:
        raise ConfigError(
            "exponential retry: need initial_ms > 0, max_ms >= initial_ms and multiplier >= 1 "
            f"(got {initial_ms}, {max_ms}, {multiplier})"
        )

    def wait(state: DeliveryState) -> Delay:
        if levels is not None and state.requested_level > 0:
            level = min(state.requested_level, levels.max_level)
            return Delay(level, levels.delay_ms(level))
        raw = initial_ms * multiplier ** min(state.reconsume_times, 64)
        return Delay(0, int(min(raw, max_ms)))

    return Backoff(wait)


def fixed_backoff(delay_ms: int) -> Backoff:
    """Always the same custom delay."""
    return Backoff(lambda _s: Delay(0, delay_ms))


@dataclass(frozen=True, slots=True)
class ComposedPolicy:
    """``stop`` decides dead or not; ``backoff`` decides when. ``policy | stop`` adds a stop."""

    stop: Stop
    backoff: Backoff

    def __call__(self, state: DeliveryState) -> RetryDecision:
        """Dead if ``stop`` says so, else the backoff's delay."""
        if self.stop(state):
            return RetryDecision(None, self.stop.explain(state))
        return RetryDecision(self.backoff(state))

    def __or__(self, stop: Stop) -> ComposedPolicy:
        return ComposedPolicy(self.stop | stop, self.backoff)


@dataclass(frozen=True)
class RocketMQLadder:
    """RocketMQ's default: delay levels ``3, 4, ...`` of the ladder, DLQ after 16 reconsumes."""

    levels: DelayLevels = field(default_factory=DelayLevels.parse)
    max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES
    _policy: ComposedPolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        policy = ComposedPolicy(
            stop_on_dead_letter_request() | stop_after_reconsume_times(self.max_reconsume_times),
            ladder_backoff(self.levels),
        )
        object.__setattr__(self, "_policy", policy)

    def composed(self) -> ComposedPolicy:
        """The same policy as a stop + backoff pair (to extend with ``|``)."""
        return self._policy

    def __call__(self, state: DeliveryState) -> RetryDecision:
        """The broker's send-back rule for ``state``."""
        return self._policy(state)


@dataclass(frozen=True)
class ExponentialRetryPolicy:
    """RocketMQ 5's exponential policy: ``min(initial * multiplier ** n, max)`` ms.

    Defaults are RocketMQ 5's (1 s initial, x2, 2 h cap). A client-chosen level
    (``> 0``) still uses ``levels``.
    """

    initial_ms: int = 1000
    multiplier: float = 2.0
    max_ms: int = 2 * 3_600_000
    max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES
    levels: DelayLevels = field(default_factory=DelayLevels.parse)
    _policy: ComposedPolicy = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        policy = ComposedPolicy(
            stop_on_dead_letter_request() | stop_after_reconsume_times(self.max_reconsume_times),
            exponential_backoff(self.initial_ms, self.multiplier, self.max_ms, self.levels),
        )
        object.__setattr__(self, "_policy", policy)

    def composed(self) -> ComposedPolicy:
        """The same policy as a stop + backoff pair (to extend with ``|``)."""
        return self._policy

    def __call__(self, state: DeliveryState) -> RetryDecision:
        """The exponential delay for ``state``, or dead."""
        return self._policy(state)
