"""The broker's send-back rules (docs/pages/protocol.md, "The resend path"), as pure decisions."""

from __future__ import annotations

import pytest

from idem.clock import ManualClock
from idem.retry import (
    SCHEDULE_TOPIC,
    DeadLettered,
    ExponentialRetryPolicy,
    MessageConst,
    MessageExt,
    Scheduled,
    SendBackProcessor,
)

pytestmark = pytest.mark.unit

P = MessageConst


def _processor(clock: ManualClock, **kw: object) -> SendBackProcessor:
    return SendBackProcessor("CID_JODIE_1", clock=clock, **kw)  # type: ignore[arg-type]


def _original() -> MessageExt:
    return MessageExt(
        topic="TopicTest",
        msg_id="MSG-0",
        keys="ORDERID_100",
        body=b"{}",
        tags="TagA",
        queue_id=5,
        queue_offset=51,
        born_timestamp=42,
    )


def test_first_failure_is_scheduled_at_level_3_in_schedule_queue_2(clock: ManualClock) -> None:
    decision = _processor(clock).process(_original(), error="db down")
    assert isinstance(decision, Scheduled)
    retry = decision.message
    assert decision.level == 3
    assert decision.queue_id == "2"
    assert decision.delay_ms == 10_000
    assert decision.due_ms == clock.now_ms() + 10_000
    assert retry.topic == SCHEDULE_TOPIC
    assert retry.queue_id == 2
    assert retry.msg_id != "MSG-0"
    assert retry.reconsume_times == 1
    assert retry.properties[P.PROPERTY_RETRY_TOPIC] == "TopicTest"
    assert retry.properties[P.PROPERTY_ORIGIN_MESSAGE_ID] == "MSG-0"
    assert retry.properties[P.PROPERTY_RECONSUME_TIME] == "1"
    assert retry.properties[P.PROPERTY_MAX_RECONSUME_TIMES] == "16"
    assert retry.properties[P.PROPERTY_REAL_TOPIC] == "%RETRY%CID_JODIE_1"
    assert retry.properties[P.PROPERTY_REAL_QUEUE_ID] == "0"
    assert retry.properties[P.PROPERTY_DELAY_TIME_LEVEL] == "3"
    assert (retry.keys, retry.body, retry.tags, retry.born_timestamp) == (
        "ORDERID_100",
        b"{}",
        "TagA",
        42,
    )


def test_origin_and_retry_topic_survive_every_resend(clock: ManualClock) -> None:
    processor = _processor(clock)
    message = _original()
    ids = set()
    for k in range(5):
        decision = processor.process(message)
        assert isinstance(decision, Scheduled)
        assert decision.level == 3 + k
        message = decision.message.evolve(topic="TopicTest")  # as the consumer sees it
        ids.add(message.msg_id)
        assert message.origin_msg_id == "MSG-0"
        assert message.properties[P.PROPERTY_RETRY_TOPIC] == "TopicTest"
    assert len(ids) == 5


def test_client_chosen_level_wins(clock: ManualClock) -> None:
    decision = _processor(clock).process(_original(), delay_level=1)
    assert isinstance(decision, Scheduled)
    assert (decision.level, decision.queue_id, decision.delay_ms) == (1, "0", 1000)


def test_negative_level_dead_letters_at_once(clock: ManualClock) -> None:
    decision = _processor(clock).process(_original(), delay_level=-1, error="bad key")
    assert isinstance(decision, DeadLettered)
    letter = decision.letter
    assert (letter.topic, letter.key, letter.origin_msg_id, letter.reconsume_times) == (
        "TopicTest",
        "ORDERID_100",
        "MSG-0",
        0,
    )
    assert letter.last_error == "ConsumeFailed: bad key"
    assert "delay level < 0" in letter.reason


def test_max_reconsume_times_dead_letters(clock: ManualClock) -> None:
    processor = _processor(clock, max_reconsume_times=2)
    tired = _original().evolve(reconsume_times=2)
    assert isinstance(processor.process(tired), DeadLettered)
    assert isinstance(processor.process(tired.evolve(reconsume_times=1)), Scheduled)


def test_resending_the_same_failure_names_the_same_new_message(clock: ManualClock) -> None:
    processor = _processor(clock)
    first = processor.process(_original())
    clock.advance(3)
    again = processor.process(_original())
    assert isinstance(first, Scheduled)
    assert isinstance(again, Scheduled)
    assert first.message.msg_id == again.message.msg_id


def test_messages_sharing_an_origin_property_are_resent_as_different_messages(
    clock: ManualClock,
) -> None:
    """``ORIGIN_MESSAGE_ID`` copied onto two messages (a consumed one forwarded twice): the
    resend ids came from it, so the second send-back merged into the first's retry."""
    processor = _processor(clock)
    shared = {P.PROPERTY_ORIGIN_MESSAGE_ID: "FORWARDED-FROM"}
    one, two = (
        processor.process(_original().evolve(msg_id=msg_id, properties=shared))
        for msg_id in ("MSG-1", "MSG-2")
    )
    assert isinstance(one, Scheduled)
    assert isinstance(two, Scheduled)
    assert one.message.msg_id != two.message.msg_id


def test_exponential_policy_uses_the_timer_queue(clock: ManualClock) -> None:
    decision = _processor(clock, policy=ExponentialRetryPolicy()).process(
        _original().evolve(reconsume_times=3)
    )
    assert isinstance(decision, Scheduled)
    assert (decision.level, decision.queue_id, decision.delay_ms) == (0, "timer", 8000)
    assert decision.message.properties[P.PROPERTY_TIMER_DELIVER_MS] == str(decision.due_ms)
    assert P.PROPERTY_DELAY_TIME_LEVEL not in decision.message.properties
