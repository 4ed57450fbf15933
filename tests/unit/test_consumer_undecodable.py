"""A queue entry whose JSON decodes to something Python cannot take is bad input too.

A number too large for an integer (``1e400`` is infinity) or JSON nested past the
recursion limit raised ``OverflowError`` / ``RecursionError`` out of the topic read: the
pull of the whole topic (one ``XREAD`` for all its queues) failed on it every 3 s,
forever. It must become a placeholder the consumer dead-letters, naming the problem.
"""

from __future__ import annotations

import fakeredis
import pytest

from idem.retry.consumer.topics import UNDECODABLE, MessageQueue, TopicStore

pytestmark = pytest.mark.unit

DEEP = "[" * 100_000


@pytest.mark.parametrize(
    ("wire", "named"),
    [
        ('{"topic": "O", "msg_id": "M", "born_timestamp": 1e400}', "infinity"),
        ('{"topic": "O", "msg_id": "M", "reconsume_times": -1e400}', "infinity"),
        (DEEP, "recursion"),
        ('{"topic": "O", "msg_id": "M", "properties": {"P": ' + DEEP + "}}", "recursion"),
    ],
    ids=["huge-born-timestamp", "huge-reconsume-times", "deep-array", "deep-property"],
)
def test_an_entry_python_cannot_hold_is_a_placeholder_not_a_stuck_topic(
    wire: str, named: str
) -> None:
    client = fakeredis.FakeRedis()
    topics = TopicStore(client)
    topics.create_topic("O", 1)
    mq = MessageQueue("O", 0)
    client.xadd(topics.queue_key(mq), {"m": wire, "t": 0}, id="0-*")
    topics.put(mq, [])  # nothing: the bad entry is the only one
    [message] = topics.read_many({mq: 0}, 10)[mq]
    assert message.queue_offset == 0
    assert message.properties[UNDECODABLE].startswith("undecodable: O:0 offset 0 is not a message")
    assert named in message.properties[UNDECODABLE].lower()
    assert len(message.properties[UNDECODABLE]) < 1000
