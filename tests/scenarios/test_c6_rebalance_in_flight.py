"""C6: a queue moves to another instance while a message of it is in flight (seed 004).

Instance *a* consumes every queue; one message of queue 3 is slow, so the
queue's offset stays at it while the messages after it are consumed. Instance
*b* joins: rebalance gives it queue 3, *a* marks the queue dropped, and *b*
starts from the committed offset — the slow message and everything after it are
delivered again. When the slow message finally finishes on *a*, its result is
not committed (the queue was dropped).
"""

from __future__ import annotations

import threading

import pytest
from harness import Group, keys
from waiting import eventually

from idem.retry.consumer import DefaultMessageListenerConcurrently
from idem.retry.message import MessageExt

pytestmark = pytest.mark.scenarios


def test_c6_queue_taken_away_mid_batch(group: Group) -> None:
    wanted = group.produce(keys("C6-", 16))
    slow = wanted[3]  # offset 0 of queue 3 (round robin)
    after_slow = [wanted[7], wanted[11], wanted[15]]  # the rest of queue 3
    release = threading.Event()

    def handle_on_a(message: MessageExt) -> None:
        if message.keys == slow:
            assert release.wait(30), "the test never released the slow message"
        group.sink.write(message, "a")

    a = group.consumer("a", listener=DefaultMessageListenerConcurrently(handle_on_a))
    eventually(
        lambda: group.sink.has_all(k for k in wanted if k != slow),
        what="everything but the slow message consumed by a",
    )
    group.consumer("b")  # joins: the group rebalances, queue 3 moves to b
    try:
        if not group.dedup:
            eventually(
                lambda: set(after_slow) <= set(group.sink.duplicates()),
                what="b consuming queue 3 again from the committed offset",
            )
        else:
            eventually(
                lambda: group.duplicates_by_cause()["completed"] >= len(after_slow),
                what="b's redeliveries absorbed",
            )
    finally:
        release.set()
    eventually(
        lambda: a.stats.snapshot()["dropped_results"] >= 1,
        what="a finishing the slow message on a dropped queue",
    )
    assert all(pq.mq.queue_id != 3 for pq in a.process_queues())
    if not group.dedup:
        eventually(lambda: slow in group.sink.duplicates(), what="the slow message twice")
        assert {r["by"] for r in group.sink.rows_of(slow)} == {"a", "b"}
        return
    eventually(
        lambda: (
            group.settled(wanted)
            and group.duplicates_by_cause()["completed"] >= len(after_slow) + 1
        ),
        what="the slow message's redelivery absorbed",
    )
    group.assert_exactly_once(wanted)
    causes = {r.key: r.cause for mw in group.middlewares for r in mw.stats.duplicate_records()}
    assert causes[slow] in {"busy", "completed"}
    assert {
        k
        for mw in group.middlewares
        for k in (r.key for r in mw.stats.duplicate_records("completed"))
    } >= {slow, *after_slow}
