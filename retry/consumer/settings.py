"""The push consumer's settings: one frozen object, RocketMQ's defaults, validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum
from typing import Any

from idem.errors import ConfigError
from idem.retry.consumer.offset_store import DEFAULT_PERSIST_INTERVAL_MS
from idem.retry.consumer.rebalance import (
    DEFAULT_HEARTBEAT_INTERVAL_MS,
    DEFAULT_REBALANCE_INTERVAL_MS,
)
from idem.retry.status import DEFAULT_SUSPEND_MS, MessageModel

MINUTE_MS = 60_000


class ConsumeFromWhere(StrEnum):
    """Where a group without a stored offset starts (new groups only)."""

    CONSUME_FROM_LAST_OFFSET = "CONSUME_FROM_LAST_OFFSET"
    CONSUME_FROM_FIRST_OFFSET = "CONSUME_FROM_FIRST_OFFSET"
    CONSUME_FROM_TIMESTAMP = "CONSUME_FROM_TIMESTAMP"


_RANGES: dict[str, tuple[int, int]] = {
    "consume_message_batch_max_size": (1, 1024),
    "pull_batch_size": (1, 1024),
    "pull_block_ms": (0, 30_000),
    "consume_thread_nums": (1, 1000),
    "pull_threshold_for_queue": (1, 65_535),
    "pull_threshold_size_for_queue_mib": (1, 1024),
    "consume_concurrently_max_span": (1, 65_535),
    "persist_consumer_offset_interval_ms": (10, 24 * 60 * MINUTE_MS),
    "rebalance_interval_ms": (10, 24 * 60 * MINUTE_MS),
    "heartbeat_interval_ms": (10, 24 * 60 * MINUTE_MS),
    "consume_timeout_ms": (1000, 24 * 60 * MINUTE_MS),
    "suspend_current_queue_time_millis": (10, 60_000),
    "lock_interval_ms": (10, 24 * 60 * MINUTE_MS),
    "pull_time_delay_when_flow_control_ms": (1, 60_000),
    "await_termination_ms": (0, 10 * MINUTE_MS),
    "max_reconsume_times": (-1, 1_000),
}

_OPTIONAL_RANGES: dict[str, tuple[int, int]] = {  # ``None`` takes the default
    "consume_timestamp_ms": (0, 253_402_300_799_999),  # up to the end of year 9999
    "heartbeat_expire_ms": (10, 24 * 60 * MINUTE_MS),
    "lock_ttl_ms": (10, 24 * 60 * MINUTE_MS),
}


@dataclass(frozen=True, kw_only=True)
class ConsumerSettings:
    """Everything a :class:`~idem.retry.consumer.PushConsumer` can be told (RocketMQ's names).

    Intervals are in milliseconds so that tests can shorten RocketMQ's seconds.
    ``max_reconsume_times = -1`` takes the group's (``IdemConfig.max_reconsume_times``);
    another value is this consumer's limit for both listener kinds (RocketMQ sends it with
    each send-back), unless the consumer is given a ready ``engine``.
    """

    message_model: MessageModel = MessageModel.CLUSTERING
    consume_from_where: ConsumeFromWhere = ConsumeFromWhere.CONSUME_FROM_LAST_OFFSET
    consume_timestamp_ms: int | None = None
    """For ``CONSUME_FROM_TIMESTAMP``; ``None`` means half an hour before start."""
    consume_message_batch_max_size: int = 1
    pull_batch_size: int = 32
    pull_block_ms: int = 200
    """Long-polling wait of a pull that finds nothing (RocketMQ suspends 15 s; kept short so a
    rebalance takes effect at once)."""
    consume_thread_nums: int = 20
    pull_threshold_for_queue: int = 1000
    pull_threshold_size_for_queue_mib: int = 100
    consume_concurrently_max_span: int = 2000
    pull_time_delay_when_flow_control_ms: int = 50
    persist_consumer_offset_interval_ms: int = DEFAULT_PERSIST_INTERVAL_MS
    rebalance_interval_ms: int = DEFAULT_REBALANCE_INTERVAL_MS
    heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS
    heartbeat_expire_ms: int | None = None
    """An instance silent this long is gone (``None``: 3 heartbeat intervals)."""
    consume_timeout_ms: int = 15 * MINUTE_MS
    """Initial consume timeout; change it at run time with ``PushConsumer.consume_timeout_ms``."""
    max_reconsume_times: int = -1
    suspend_current_queue_time_millis: int = DEFAULT_SUSPEND_MS
    lock_interval_ms: int = 20_000
    """Orderly: how often held queue locks are renewed (``lockAll``)."""
    lock_ttl_ms: int | None = None
    """Orderly: a lock not renewed for this long is free (``None``: 3 lock intervals)."""
    await_termination_ms: int = 0
    """``awaitTerminationMillisWhenShutdown``: how long shutdown waits for in-flight consumes."""
    offset_store_dir: str | None = None
    """Broadcasting: where the local offset files live (default ``~/.rocketmq_offsets``)."""

    def __post_init__(self) -> None:
        checked = {
            **_RANGES,
            **{k: v for k, v in _OPTIONAL_RANGES.items() if getattr(self, k) is not None},
        }
        for name, (low, high) in checked.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name}: expected a whole number, got {value!r}")
            if not low <= value <= high:
                raise ConfigError(f"{name}: {value} is outside the allowed range {low}..{high}")
        if self.offset_store_dir is not None and not isinstance(self.offset_store_dir, str):
            raise ConfigError(f"offset_store_dir: expected a path, got {self.offset_store_dir!r}")
        for name, enum in (
            ("message_model", MessageModel),
            ("consume_from_where", ConsumeFromWhere),
        ):
            try:
                object.__setattr__(self, name, enum(getattr(self, name)))
            except ValueError:
                allowed = ", ".join(m.value for m in enum)
                raise ConfigError(
                    f"{name}: {getattr(self, name)!r} is not one of {allowed}"
                ) from None
        expire = self.effective_heartbeat_expire_ms
        if expire <= self.heartbeat_interval_ms:
            raise ConfigError(
                f"heartbeat_expire_ms: {expire} must exceed heartbeat_interval_ms "
                f"({self.heartbeat_interval_ms}), or live instances would be dropped"
            )
        if self.effective_lock_ttl_ms <= self.lock_interval_ms:
            raise ConfigError(
                f"lock_ttl_ms: {self.effective_lock_ttl_ms} must exceed lock_interval_ms "
                f"({self.lock_interval_ms}), or a held lock would lapse between renewals"
            )

    @property
    def effective_heartbeat_expire_ms(self) -> int:
        """``heartbeat_expire_ms`` or 3 heartbeat intervals."""
        return self.heartbeat_expire_ms or 3 * self.heartbeat_interval_ms

    @property
    def effective_lock_ttl_ms(self) -> int:
        """``lock_ttl_ms`` or 3 lock intervals."""
        return self.lock_ttl_ms or 3 * self.lock_interval_ms

    def with_changes(self, **changes: Any) -> ConsumerSettings:
        """A copy with some settings changed (validated again)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ConfigError(f"unknown consumer setting(s): {', '.join(unknown)}")
        return replace(self, **changes)
