"""A dead letter keeps the message's tag: a replay must reach the listener as it was sent."""

from __future__ import annotations

from pathlib import Path

import pytest

from idem.clock import ManualClock
from idem.retry import DeadLetterTable, MessageConst, MessageExt, SendBackProcessor
from idem.retry.sendback import DeadLettered

pytestmark = pytest.mark.unit


def test_a_dead_letter_keeps_the_tag_and_its_replay_carries_it(
    tmp_path: Path, clock: ManualClock
) -> None:
    """RocketMQ keeps a message's tag in its ``TAGS`` property, so the DLQ message keeps
    it; a listener that routes on ``message.tags`` must see a replayed message's tag."""
    processor = SendBackProcessor("CID_tags", clock=clock)
    message = MessageExt(
        topic="TopicTest", msg_id="M0", keys="ORDER_0", tags="TagA", reconsume_times=16
    )
    decision = processor.process(message, error="boom")
    assert isinstance(decision, DeadLettered)
    table = DeadLetterTable(str(tmp_path / "dlq"), "CID_tags", clock=clock)
    assert table.write([decision.letter]) == 1
    [row] = table.list()
    assert row.properties[MessageConst.PROPERTY_TAGS] == "TagA"
    replayed = row.to_message()
    assert replayed.tags == "TagA"
    # as a message from idem's producer (and RocketMQ's getTags()): the property names it too
    assert replayed.properties[MessageConst.PROPERTY_TAGS] == "TagA"


def test_a_message_without_a_tag_dies_and_replays_without_one(clock: ManualClock) -> None:
    processor = SendBackProcessor("CID_tags", clock=clock)
    message = MessageExt(topic="TopicTest", msg_id="M0", reconsume_times=16)
    decision = processor.process(message)
    assert isinstance(decision, DeadLettered)
    assert MessageConst.PROPERTY_TAGS not in decision.letter.properties
    assert decision.letter.to_message().tags is None


def test_a_producer_message_replays_with_its_tag_field(clock: ManualClock) -> None:
    """idem's producer puts the tag in ``TAGS`` and in the field; the replay had only the
    property, so ``message.tags`` (what a listener routes on) was ``None``."""
    from idem.retry.consumer.producer import new_message

    processor = SendBackProcessor("CID_tags", clock=clock)
    sent = new_message("TopicTest", b"x", keys="ORDER_1", tags="TagB", clock=clock)
    decision = processor.process(sent.evolve(reconsume_times=16))
    assert isinstance(decision, DeadLettered)
    assert decision.letter.to_message().tags == "TagB"
