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


def test_c7_across_instances_with_a_lease_shorter_than_the_timeout(group: Group) -> None:
    """Two instances; the claim lease (1 s) is shorter than the consume timeout (2 s), as
    the defaults are (5 min and 15 min), and the sink takes 4 s over the first delivery
    of each key. The timeout sends each back; the retried copy may reach the instance
    that is not consuming the key, after its lease ran out: the lease must be renewed
    while the first delivery runs, or that copy is written a second time."""
    group.config = group.config.with_changes(lease_ms=1000)
    wanted = keys("C7L-", 4)

    def listener(name: str) -> DefaultMessageListenerConcurrently:
        def handle(message: MessageExt) -> None:
            if message.reconsume_times == 0:
                time.sleep(4.0)
            group.sink.write(message, name)

        return DefaultMessageListenerConcurrently(handle)

    # Members outlive a missed heartbeat here: a rebalance while a first delivery
    # sleeps would hand its queue over and that copy would not be the one expired.
    settings = FAST.with_changes(consume_timeout_ms=2000, heartbeat_expire_ms=10_000)
    instances = [group.consumer(n, listener=listener(n), settings=settings) for n in "ab"]
    eventually(
        lambda: all(len(c.process_queues()) >= 2 for c in instances), what="the queues shared"
    )
    group.produce(wanted)
    eventually(
        lambda: sum(c.stats.snapshot()["expired"] for c in instances) == len(wanted),
        timeout=45,
        what="every first delivery sent back by the consume timeout",
    )
    if not group.dedup:
        eventually(lambda: set(group.sink.duplicates()) == set(wanted), what="each key twice")
        return
    eventually(
        lambda: group.settled(wanted) and group.duplicates_by_cause()["completed"] == len(wanted),
        timeout=30,
        what="every retried copy absorbed",
    )
    group.assert_exactly_once(wanted)
