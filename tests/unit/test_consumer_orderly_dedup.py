"""Orderly consumption with the dedup hook and batches of more than one message.

A key busy elsewhere (an instance that lost the queue's lock is still on it, or its
lease outlives it) must stop its orderly queue *at that message*: the messages after
it in the same consume call wait with it, rather than reaching the sink before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import fakeredis
import pytest

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.retry import MessageExt
from idem.retry.consumer import BatchResult, ConsumeScope, DedupMiddleware, MessageQueue

pytestmark = pytest.mark.unit

ORDERLY = ConsumeScope(mq=MessageQueue("orders", 0), client_id="c1", orderly=True)


class Sink:
    """A listener that writes what it is handed, in order."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def __call__(self, messages: Sequence[MessageExt]) -> BatchResult:
        self.written += [m.keys or "" for m in messages]
        return BatchResult(len(messages))


def _messages(*keys: str) -> list[MessageExt]:
    return [
        MessageExt(topic="orders", msg_id=f"M{i}", keys=key, body=b"{}", queue_offset=i)
        for i, key in enumerate(keys)
    ]


def test_a_busy_key_holds_back_the_messages_after_it_in_an_orderly_call(
    tmp_path: Path, clock: ManualClock, fake_redis: fakeredis.FakeRedis
) -> None:
    dedup = Dedup(
        IdemConfig(group="CID_orderly", data_dir=str(tmp_path), buckets=4),
        client=fake_redis,
        clock=clock,
    )
    elsewhere = dedup.begin(["ORDER-1"], owner="instance-that-lost-the-lock")
    hook = DedupMiddleware(dedup, owner="c1", commit_interval_ms=0)
    sink = Sink()
    batch = _messages("ORDER-0", "ORDER-1", "ORDER-2", "ORDER-3")

    first = hook(batch, ORDERLY, sink)
    assert sink.written == ["ORDER-0"], "consumed past the busy message"
    assert sorted(first.failed) == [1, 2, 3]
    assert all(not f.counts for f in first.failed.values())  # waiting is not a reconsume

    dedup.release(elsewhere)  # the other instance lets go: the queue goes on from ORDER-1
    second = hook(batch, ORDERLY, sink)
    assert second.ok
    assert sink.written == ["ORDER-0", "ORDER-1", "ORDER-2", "ORDER-3"]
    assert hook.stats.fresh == 4  # each key handed to the listener once


def test_a_key_held_by_another_call_here_holds_back_the_rest_of_an_orderly_call(
    tmp_path: Path, clock: ManualClock, fake_redis: fakeredis.FakeRedis
) -> None:
    dedup = Dedup(
        IdemConfig(group="CID_orderly", data_dir=str(tmp_path), buckets=4),
        client=fake_redis,
        clock=clock,
    )
    hook = DedupMiddleware(dedup, owner="c1", commit_interval_ms=0)
    sink = Sink()
    batch = _messages("ORDER-0", "ORDER-1", "ORDER-2")
    hook._reserve(["ORDER-1"], [0])  # another queue's call of this instance holds ORDER-1
    result = hook(batch, ORDERLY, sink)
    assert sink.written == ["ORDER-0"]
    assert sorted(result.failed) == [1, 2]
    assert dedup.begin(["ORDER-2"], owner="c2").fresh == (0,)  # its claim was given back
