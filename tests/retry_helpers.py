"""Helpers of the resend-path tests."""

from __future__ import annotations

from idem.clock import ManualClock
from idem.retry import MessageExt, RetryEngine


def drain(engine: RetryEngine, clock: ManualClock, *, after_s: float) -> list[MessageExt]:
    """Let ``after_s`` seconds pass, then deliver and acknowledge everything pending."""
    clock.advance(after_s)
    engine.tick()
    delivered: list[MessageExt] = []
    while batch := engine.poll_retry("drain", 500):
        delivered += batch
        engine.ack(batch)
    return delivered
