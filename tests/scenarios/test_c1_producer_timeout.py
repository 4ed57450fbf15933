"""C1: a send times out after the broker stored the message; the producer sends it again.

The broker (a private redis-server) stalls for 450 ms (``DEBUG SLEEP``) while the
producer's send is in flight. The producer's 300 ms send timeout fires, so it
resends (``retry_times_when_send_failed`` = 2) to another queue — and when the
broker wakes it stores both: the same key and the same msg id, twice (as RocketMQ
users are warned: "消费者后续会收到两条内容相同并且 Message ID 也相同的消息").
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Group, keys
from waiting import eventually

from idem.redis_server import RedisServer
from idem.retry.consumer import Producer, TopicStore, new_message

pytestmark = pytest.mark.scenarios


@pytest.fixture
def broker() -> Iterator[RedisServer]:
    """A private broker that can be stalled."""
    server = RedisServer(extra={"enable-debug-command": "yes"})
    server.start()
    yield server
    server.stop()


def send_during_stall(broker: RedisServer, key: str) -> int:
    """Send ``key`` while the broker sleeps; returns the attempts the send took."""
    producer = Producer("c1-producer", redis_url=broker.url, send_msg_timeout_ms=300)
    producer.send(new_message("orders", b"warm-up", keys=f"{key}-WARMUP"))  # route cached
    staller = broker.client()
    stall = threading.Thread(target=lambda: staller.execute_command("DEBUG", "SLEEP", "0.45"))
    stall.start()
    time.sleep(0.05)  # the broker is asleep now
    try:
        result = producer.send(new_message("orders", key.encode(), keys=key))
    finally:
        stall.join()
        staller.close()
        producer.shutdown()
    return result.attempts


def test_c1_send_timeout_after_store(broker: RedisServer, tmp_path: Path, dedup: bool) -> None:
    group = Group(broker.url, tmp_path, f"g-{uuid.uuid4().hex[:8]}", dedup)
    try:
        wanted = group.produce(keys("C1-", 10))
        resent = "C1-RESENT"
        assert send_during_stall(broker, resent) == 2  # timed out once, then succeeded
        wanted += [resent, f"{resent}-WARMUP"]
        stored = [
            m
            for mq in TopicStore(group.client).message_queues("orders")
            for m in TopicStore(group.client).messages(mq)
            if m.keys == resent
        ]
        assert len(stored) == 2, "the broker holds the message twice"
        assert stored[0].msg_id == stored[1].msg_id
        assert stored[0].queue_id != stored[1].queue_id

        group.consumer("c1")
        if not dedup:
            doubled = eventually(group.sink.duplicates, what="the resent key written twice")
            assert set(doubled) == {resent}
            rows = group.sink.rows_of(resent)
            assert rows[0]["msg_id"] == rows[1]["msg_id"]  # same message, stored twice
            assert {r["queue_id"] for r in rows} == {s.queue_id for s in stored}
            return
        eventually(
            lambda: group.settled(wanted) and group.duplicates_by_cause()["completed"],
            what="every key written and the second copy absorbed",
        )
        group.assert_exactly_once(wanted)
        records = [r for mw in group.middlewares for r in mw.stats.duplicate_records("completed")]
        assert [r.key for r in records] == [resent]
        assert records[0].origin_msg_id == stored[0].msg_id  # (busy, sent back: new msg id)
    finally:
        group.close()
