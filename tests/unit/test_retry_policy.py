"""Retry policies: RocketMQ's ladder, RocketMQ 5's exponential policy, composition."""

from __future__ import annotations

import pytest

from idem.errors import ConfigError
from idem.retry import (
    DelayLevels,
    DeliveryState,
    ExponentialRetryPolicy,
    RocketMQLadder,
    exponential_backoff,
    fixed_backoff,
    ladder_backoff,
    stop_after_elapsed,
    stop_after_reconsume_times,
)

pytestmark = pytest.mark.unit

HOUR, MINUTE, SECOND = 3_600_000, 60_000, 1000
LADDER_SECONDS = [
    1,
    5,
    10,
    30,
    60,
    120,
    180,
    240,
    300,
    360,
    420,
    480,
    540,
    600,
    1200,
    1800,
    3600,
    7200,
]


def _state(reconsume_times: int = 0, requested_level: int = 0, **kw: object) -> DeliveryState:
    values: dict[str, object] = {
        "key": "K",
        "reconsume_times": reconsume_times,
        "first_seen_ms": 0,
        "now_ms": 0,
        "requested_level": requested_level,
    }
    values.update(kw)
    return DeliveryState(**values)  # type: ignore[arg-type]


def test_default_ladder_is_rocketmqs_18_levels() -> None:
    levels = DelayLevels.parse()
    assert [levels.delay_ms(n) for n in range(1, 19)] == [s * SECOND for s in LADDER_SECONDS]
    assert levels.queue_id(3) == 2


def test_sum_of_the_default_ladder_is_4h_45min_40s() -> None:
    expected = 4 * HOUR + 45 * MINUTE + 40 * SECOND
    assert DelayLevels.parse().retry_horizon_ms(16) == expected
    policy = RocketMQLadder()
    total = sum(policy(_state(k)).delay.delay_ms for k in range(16))  # type: ignore[union-attr]
    assert total == expected


@pytest.mark.parametrize("k", range(16))
def test_ladder_level_zero_means_three_plus_reconsume_times(k: int) -> None:
    decision = RocketMQLadder()(_state(k))
    assert decision.delay is not None
    assert decision.delay.level == 3 + k
    assert decision.delay.delay_ms == LADDER_SECONDS[2 + k] * SECOND


def test_ladder_dead_letters_at_max_reconsume_times_and_on_negative_level() -> None:
    policy = RocketMQLadder()
    assert policy(_state(16)).dead
    assert "max (16)" in policy(_state(16)).reason
    assert policy(_state(0, requested_level=-1)).dead
    assert "delay level < 0" in policy(_state(0, requested_level=-1)).reason
    assert not policy(_state(15)).dead
    assert RocketMQLadder(max_reconsume_times=3)(_state(3)).dead


def test_ladder_honours_the_clients_level_and_clamps_to_the_top() -> None:
    policy = RocketMQLadder()
    assert policy(_state(0, requested_level=1)).delay.level == 1  # type: ignore[union-attr]
    top = policy(_state(0, requested_level=99)).delay
    assert top is not None
    assert (top.level, top.delay_ms) == (18, 2 * HOUR)


def test_custom_ladder_string() -> None:
    levels = DelayLevels.parse("1s 2s 3s 4m")
    decision = RocketMQLadder(levels)(_state(0))
    assert decision.delay is not None
    assert (decision.delay.level, decision.delay.delay_ms) == (3, 3 * SECOND)
    assert RocketMQLadder(levels)(_state(5)).delay.level == 4  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="level 2"):
        DelayLevels.parse("1s 2x")


def test_exponential_policy_doubles_from_one_second_up_to_two_hours() -> None:
    policy = ExponentialRetryPolicy()
    delays = [policy(_state(k)).delay.delay_ms for k in range(16)]  # type: ignore[union-attr]
    assert delays[:4] == [1000, 2000, 4000, 8000]
    assert delays[-1] == 2 * HOUR
    assert all(policy(_state(k)).delay.level == 0 for k in range(16))  # type: ignore[union-attr]
    assert policy(_state(16)).dead
    assert policy(_state(0, requested_level=3)).delay.level == 3  # type: ignore[union-attr]


def test_exponential_backoff_refuses_nonsense() -> None:
    with pytest.raises(ConfigError, match="initial_ms"):
        exponential_backoff(0, 2.0, 10)


def test_policies_compose_like_tenacity() -> None:
    policy = RocketMQLadder().composed() | stop_after_elapsed(HOUR)
    assert not policy(_state(2, now_ms=HOUR - 1)).dead
    assert policy(_state(2, now_ms=HOUR)).dead
    both = stop_after_reconsume_times(2) & stop_after_elapsed(10)
    assert not both(_state(2, now_ms=5))
    assert both(_state(2, now_ms=10))
    summed = (ladder_backoff(DelayLevels.parse()) + fixed_backoff(500))(_state(0))
    assert (summed.level, summed.delay_ms) == (0, 10_500)
