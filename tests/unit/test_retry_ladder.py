"""Acceptance: a message failing k times (k = 0..20) walks RocketMQ's ladder, then the DLQ.

Injected clock, fakeredis, real Delta tables in tmp_path; nothing sleeps.
"""

from __future__ import annotations

from pathlib import Path

import fakeredis
import pytest

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.retry import (
    DeadLetterStatus,
    DelayLevels,
    MessageConst,
    MessageExt,
    RetryEngine,
    SendBackStatus,
)

pytestmark = pytest.mark.unit

SECOND, MINUTE, HOUR = 1000, 60_000, 3_600_000
LADDER = DelayLevels.parse()
HORIZON_MS = 4 * HOUR + 45 * MINUTE + 40 * SECOND


def _engine(tmp_path: Path, clock: ManualClock) -> RetryEngine:
    config = IdemConfig(group="CID_ladder", data_dir=str(tmp_path))
    return RetryEngine(config, client=fakeredis.FakeRedis(), clock=clock)


def _deliver_when_due(engine: RetryEngine, clock: ManualClock, due_ms: int) -> MessageExt:
    """Not a millisecond early, and exactly at the due time."""
    clock.advance((due_ms - clock.now_ms() - 1) / 1000)
    assert engine.tick() == 0
    assert engine.poll_retry("consumer-1", 10) == []
    clock.advance(0.001)
    assert engine.tick() == 1
    (message,) = engine.poll_retry("consumer-1", 10)
    return message


@pytest.mark.parametrize("k", range(21))
def test_message_failing_k_times(k: int, tmp_path: Path, clock: ManualClock) -> None:
    engine = _engine(tmp_path, clock)
    original = MessageExt(
        topic="TopicTest",
        msg_id="MSG-ORIGIN",
        keys="ORDERID_100",
        body=b'{"amount": 5}',
        born_timestamp=clock.now_ms(),
    )
    message, failures, levels, delays, retries = original, 0, [], [], 0
    while failures < k:  # the listener returns RECONSUME_LATER k times
        failures += 1
        sent_at = clock.now_ms()
        result = engine.send_back([message], errors={message.msg_id: f"failure {failures}"})
        (outcome,) = result.outcomes
        if outcome.status is SendBackStatus.DEAD:
            break
        assert outcome.status is SendBackStatus.SCHEDULED
        levels.append(outcome.delay_level)
        delays.append(outcome.due_ms - sent_at)  # type: ignore[operator]
        message = _deliver_when_due(engine, clock, outcome.due_ms)  # type: ignore[arg-type]
        retries += 1
        assert message.topic == "TopicTest"  # original topic restored on read
        assert message.reconsume_times == retries
        assert message.keys == "ORDERID_100"
        assert message.origin_msg_id == "MSG-ORIGIN"
        assert message.properties[MessageConst.PROPERTY_RETRY_TOPIC] == "TopicTest"

    expected_retries = min(k, 16)
    assert retries == expected_retries
    assert levels == list(range(3, 3 + expected_retries))
    assert delays == [LADDER.delay_ms(level) for level in levels]
    letters = engine.dlq.list()
    if k <= 16:
        # the (k+1)-th delivery succeeds: acknowledged, nothing left anywhere
        if message is not original:
            engine.ack([message])
        assert letters == []
    else:
        assert sum(delays) == HORIZON_MS
        assert len(letters) == 1
        (letter,) = letters
        assert letter.reconsume_times == 16
        assert letter.topic == "TopicTest"
        assert letter.key == "ORDERID_100"
        assert letter.origin_msg_id == "MSG-ORIGIN"
        assert letter.body == b'{"amount": 5}'
        assert letter.status is DeadLetterStatus.DEAD
        assert [e.message for e in letter.errors] == [f"failure {n}" for n in range(1, 18)]
        assert letter.first_failed_at_ms == original.born_timestamp
    assert engine.pending() == 0
    assert engine.next_due_ms() is None


def test_level_minus_one_goes_to_the_dlq_at_once(tmp_path: Path, clock: ManualClock) -> None:
    engine = _engine(tmp_path, clock)
    message = MessageExt(topic="TopicTest", msg_id="M-1", keys="ORDERID_7", body=b"x")
    result = engine.send_back([message], delay_level=-1, errors={"M-1": "amount is negative"})
    assert [o.status for o in result.outcomes] == [SendBackStatus.DEAD]
    (letter,) = engine.dlq.list()
    assert (letter.reconsume_times, letter.topic, letter.key, letter.origin_msg_id) == (
        0,
        "TopicTest",
        "ORDERID_7",
        "M-1",
    )
    assert letter.last_error == "ConsumeFailed: amount is negative"
    assert engine.pending() == 0
    clock.advance(3 * 3600)
    assert engine.tick() == 0


def test_a_retried_message_dead_lettered_with_level_minus_one_leaves_the_retry_topic(
    tmp_path: Path, clock: ManualClock
) -> None:
    engine = _engine(tmp_path, clock)
    (outcome,) = engine.send_back([MessageExt(topic="T", msg_id="M", keys="K")]).outcomes
    retried = _deliver_when_due(engine, clock, outcome.due_ms)  # type: ignore[arg-type]
    assert engine.pending() == 1
    engine.dead_letter([retried], reason="poison")
    assert engine.pending() == 0
    assert [letter.reconsume_times for letter in engine.dlq.list()] == [1]
