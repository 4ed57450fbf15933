"""C2: one message of a batch fails, so the whole batch is sent back (seed 004).

``consume_message_batch_max_size`` = 8 and RocketMQ's default listener, which handles
the messages one by one and returns ``RECONSUME_LATER`` at the first failure:
the messages handled before the failing one were written to the sink, and come
back from ``%RETRY%<group>`` with the rest of the batch.
"""

from __future__ import annotations

import threading

import pytest
from harness import FAST, Group, keys
from waiting import eventually

from idem.retry.consumer import DefaultMessageListenerConcurrently
from idem.retry.message import MessageExt

pytestmark = pytest.mark.scenarios


def test_c2_whole_batch_is_resent(group: Group) -> None:
    wanted = group.produce(keys("C2-", 16))
    failing = wanted[5]
    failed_once: set[str] = set()
    lock = threading.Lock()

    def handle(message: MessageExt) -> None:
        with lock:
            first = message.keys == failing and failing not in failed_once
            failed_once.add(message.keys or "")
        if first:
            raise RuntimeError("the database refused this row, once")
        group.sink.write(message, "c1")

    settings = FAST.with_changes(consume_message_batch_max_size=8, pull_batch_size=32)
    group.consumer("c1", listener=DefaultMessageListenerConcurrently(handle), settings=settings)

    if not group.dedup:
        doubled = eventually(group.sink.duplicates, what="a key written twice")
        again = [r for k in doubled for r in group.sink.rows_of(k) if r["reconsume"] >= 1]
        assert again, "the second write must come from the retry topic (the resent batch)"
        eventually(lambda: group.settled(wanted), what="every key written")
        return

    eventually(
        lambda: group.settled(wanted) and group.duplicates_by_cause()["completed"],
        what="every key written and the resent batch absorbed",
    )
    group.assert_exactly_once(wanted)
    records = [r for mw in group.middlewares for r in mw.stats.duplicate_records("completed")]
    assert all(r.reconsume_times >= 1 for r in records), records
    assert records, "the resent rows must be counted as duplicates"
