"""Helpers of the resend-path tests."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from idem.clock import ManualClock
from idem.retry import MessageExt, RetryEngine
from idem.retry.status import ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus


def drain(engine: RetryEngine, clock: ManualClock, *, after_s: float) -> list[MessageExt]:
    """Let ``after_s`` seconds pass, then deliver and acknowledge everything pending."""
    clock.advance(after_s)
    engine.tick()
    delivered: list[MessageExt] = []
    while batch := engine.poll_retry("drain", 500):
        delivered += batch
        engine.ack(batch)
    return delivered


class RecordingListener:
    """A concurrent listener that records the key of every message it was handed (a
    sink's durable state, in memory)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: list[str] = []

    def __call__(
        self, messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        with self.lock:
            self.keys += [m.keys or "" for m in messages]
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS
