"""RocketMQ's delay levels: ``messageDelayLevel`` parsed from its string form.

``"1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"`` is the broker
default: 18 levels, level ``n`` (1-based) waits the n-th duration, and its
schedule queue id is ``n - 1``. A send-back with delay level 0 lets the broker
choose ``3 + reconsume_times``, so the k-th retry waits level ``k + 2``.

This lives in the core package because the dedup window is validated against
the retry horizon; ``idem.retry`` re-exports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from idem.errors import ConfigError

DEFAULT_DELAY_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
"""RocketMQ's broker default for ``messageDelayLevel``."""

DEFAULT_MAX_RECONSUME_TIMES = 16
"""RocketMQ's default ``maxReconsumeTimes`` for concurrent consumers."""

FIRST_RETRY_LEVEL = 3
"""Delay level of the first retry when the broker chooses (``3 + reconsume_times``)."""

MAX_DELAY_MS = 7 * 86_400_000
"""The longest delay a level may have (7 days; RocketMQ's own ladder ends at 2 hours)."""

_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_TOKEN = re.compile(r"^(\d+)(ms|s|m|h|d)$")


@dataclass(frozen=True, slots=True)
class DelayLevels:
    """An ordered ladder of delays; level ``n`` is ``delays_ms[n - 1]``."""

    delays_ms: tuple[int, ...]
    source: str = DEFAULT_DELAY_LEVELS

    def __post_init__(self) -> None:
        if not self.delays_ms:
            raise ConfigError("delay_levels: at least one level is required")
        if any(d <= 0 for d in self.delays_ms):
            raise ConfigError("delay_levels: every delay must be positive")
        longest = max(self.delays_ms)
        if longest > MAX_DELAY_MS:
            level = self.delays_ms.index(longest) + 1
            raise ConfigError(
                f"delay_levels: level {level} is {longest} ms; the limit is {MAX_DELAY_MS} ms (7d)"
            )

    @classmethod
    def parse(cls, text: str = DEFAULT_DELAY_LEVELS) -> DelayLevels:
        """Parse RocketMQ's form: space-separated ``<int><unit>``, unit in ms/s/m/h/d."""
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(
                f"delay_levels: expected a string like {DEFAULT_DELAY_LEVELS!r}, got {text!r}"
            )
        delays: list[int] = []
        for position, token in enumerate(text.split(), start=1):
            match = _TOKEN.match(token.strip().lower())
            if match is None:
                raise ConfigError(
                    f"delay_levels: level {position} is {token!r}; expected a whole "
                    "number followed by one of ms, s, m, h, d (e.g. '10s', '2h')"
                )
            amount = int(match.group(1))
            if amount <= 0:
                raise ConfigError(f"delay_levels: level {position} ({token!r}) must be > 0")
            delays.append(amount * _UNIT_MS[match.group(2)])
        return cls(delays_ms=tuple(delays), source=" ".join(text.split()))

    @property
    def max_level(self) -> int:
        """The highest level (18 for the default ladder)."""
        return len(self.delays_ms)

    def delay_ms(self, level: int) -> int:
        """Delay of ``level``; levels above the top are clamped to it, as the broker does."""
        if level < 1:
            raise ValueError(f"delay level must be >= 1, got {level}")
        return self.delays_ms[min(level, self.max_level) - 1]

    def queue_id(self, level: int) -> int:
        """The schedule queue id of ``level`` (``level - 1``)."""
        return min(level, self.max_level) - 1

    def level_for_retry(self, reconsume_times: int) -> int:
        """The level the broker picks for delay level 0: ``3 + reconsume_times``, clamped."""
        return min(FIRST_RETRY_LEVEL + reconsume_times, self.max_level)

    def retry_horizon_ms(self, max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES) -> int:
        """Total delay a message can accumulate before it is dead-lettered.

        For the default ladder and 16 reconsumes: levels 3..18 = 4 h 45 min 40 s.
        """
        return sum(self.delay_ms(self.level_for_retry(k)) for k in range(max_reconsume_times))

    def __str__(self) -> str:
        return self.source
