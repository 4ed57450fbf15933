"""A message field of the wrong JSON type is bad input: a clear error naming the field,
and (read from a topic) a placeholder the consumer dead-letters, never a traceback."""

from __future__ import annotations

import json

import fakeredis
import pytest

from idem.errors import SerializationError
from idem.retry import MessageExt
from idem.retry.consumer.topics import UNDECODABLE, MessageQueue, TopicStore

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("field", ["keys", "tags"])
@pytest.mark.parametrize("value", [123, True, ["K"], {"k": "v"}])
def test_a_non_text_key_or_tag_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=f"^{field}: must be a string or None, got "):
        MessageExt(topic="T", msg_id="M", **{field: value})  # type: ignore[arg-type]
    wire = json.dumps({"v": 1, "topic": "T", "msg_id": "M", field: value})
    with pytest.raises(SerializationError, match=f"message envelope: {field}: must be a string"):
        MessageExt.from_wire(wire)


def test_a_foreign_entry_with_a_numeric_key_is_a_placeholder_not_a_stuck_queue() -> None:
    """A producer that writes ``"keys": 100`` (an order id as a number) must not stop the
    queue with an AttributeError: the entry is read as a placeholder to dead-letter."""
    client = fakeredis.FakeRedis()
    topics = TopicStore(client)
    topics.create_topic("Orders", 1)
    mq = MessageQueue("Orders", 0)
    client.xadd(
        topics.queue_key(mq),
        {"m": json.dumps({"topic": "Orders", "msg_id": "M", "keys": 100}), "t": 0},
        id="0-*",
    )
    [message] = topics.read_many({mq: 0}, 10)[mq]
    assert UNDECODABLE in message.properties
    assert "keys" in message.properties[UNDECODABLE]
