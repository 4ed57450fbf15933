"""Waiting for something a background thread or process does, and consumer settings fast
enough for tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from idem.retry.consumer import ConsumeFromWhere, ConsumerSettings


def eventually(
    check: Callable[[], object],
    timeout: float = 20.0,
    interval: float = 0.05,
    what: str = "condition",
) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


FAST = ConsumerSettings(
    consume_from_where=ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET,
    pull_block_ms=50,
    heartbeat_interval_ms=100,
    heartbeat_expire_ms=600,
    rebalance_interval_ms=500,
    persist_consumer_offset_interval_ms=100,
    consume_thread_nums=4,
)
"""A push consumer's intervals, shortened so a test takes seconds."""
