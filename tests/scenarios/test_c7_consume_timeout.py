"""C7: the consume timeout sends back a message that is still being consumed (seed 004).

The consume timeout is 2 s; the sink takes 3 s for one message. At 2 s the
consumer sends the message back (delay level 3) and removes it so the offset can
advance; the retried copy is consumed while — or after — the first delivery
finishes its write.
"""

from __future__ import annotations

import time

import pytest
from harness import FAST, Group, keys
from waiting import eventually

from idem.retry.consumer import DefaultMessageListenerConcurrently
from idem.retry.message import MessageExt

pytestmark = pytest.mark.scenarios


def test_c7_slow_sink_outlives_the_consume_timeout(group: Group) -> None:
    wanted = group.produce(keys("C7-", 8))
    slow = wanted[0]

    def handle(message: MessageExt) -> None:
        if message.keys == slow and message.reconsume_times == 0:
            time.sleep(3.0)
        group.sink.write(message, "c")

    consumer = group.consumer(
        "c",
        listener=DefaultMessageListenerConcurrently(handle),
        settings=FAST.with_changes(consume_timeout_ms=2000),
    )
    eventually(
        lambda: consumer.stats.snapshot()["expired"] == 1,
        timeout=10,
        what="the slow message sent back by the consume timeout",
    )
    if not group.dedup:
        eventually(lambda: slow in group.sink.duplicates(), what="the slow message twice")
        rows = group.sink.rows_of(slow)
        assert sorted(r["reconsume"] for r in rows) == [0, 1]
        assert rows[0]["origin"] == rows[1]["origin"]
        return
    eventually(
        lambda: group.settled(wanted) and group.duplicates_by_cause()["completed"],
        what="the retried copy absorbed",
    )
    group.assert_exactly_once(wanted)
    records = [r for mw in group.middlewares for r in mw.stats.duplicate_records("completed")]
    assert [r.key for r in records] == [slow]
    assert records[0].reconsume_times >= 1
