"""The push consumer with idem's dedup hook on a real redis-server: busy keys and group commit.

- A key another consumer holds comes back again and again without counting as a
  reconsume: it is never dead-lettered for being busy, and is consumed once free.
- The offset of a consumed message does not move until its group-committed ledger
  write is durable.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from retry_helpers import RecordingListener
from waiting import FAST, eventually

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.redis_server import RedisServer
from idem.retry.consumer import (
    DedupMiddleware,
    MessageQueue,
    Producer,
    PushConsumer,
    ReadOffsetType,
    TopicStore,
    consumer_offsets,
    new_message,
)
from idem.retry.consumer.group_commit import CommitItem, GroupCommitter
from idem.retry.message import MessageExt

pytestmark = pytest.mark.integration


def _consumer(
    config: IdemConfig, server: RedisServer, sink: RecordingListener, **hook: object
) -> tuple[PushConsumer, DedupMiddleware]:
    consumer = PushConsumer(config, settings=FAST, client=server.client())
    consumer.subscribe("orders")
    middleware = DedupMiddleware(Dedup(config, client=server.client()), **hook)  # type: ignore[arg-type]
    consumer.use(middleware)
    consumer.register_message_listener_concurrently(sink)
    return consumer, middleware


def test_a_busy_key_comes_back_without_counting_and_is_consumed_once_free(
    redis_server: RedisServer, real_redis: redis.Redis, tmp_path: Path
) -> None:
    config = IdemConfig(
        group=f"g-{uuid.uuid4().hex[:8]}",
        redis_url=redis_server.url,
        data_dir=str(tmp_path),
        delay_levels="1s 1s 1s",
        max_reconsume_times=1,
    )
    TopicStore(real_redis).create_topic("orders", 1)
    other = Dedup(config, client=redis_server.client())
    held = other.begin(["ORDER-1"], owner="another-consumer")  # a live claim elsewhere
    sink = RecordingListener()
    consumer, hook = _consumer(config, redis_server, sink)
    consumer.start()
    try:
        Producer("p", client=real_redis).send(new_message("orders", b"{}", keys="ORDER-1"))
        # counted, the second busy round would dead-letter it (max_reconsume_times=1)
        eventually(lambda: hook.stats.busy >= 3)
        assert sink.keys == []
        other.release(held)
        eventually(lambda: sink.keys == ["ORDER-1"])
        engine = consumer.engine
        assert engine is not None
        eventually(lambda: engine.pending() == 0)
        assert engine.dlq.count() == 0
        assert sink.keys == ["ORDER-1"]
    finally:
        consumer.shutdown()


def test_the_offset_waits_for_the_group_commit(
    redis_server: RedisServer, real_redis: redis.Redis, tmp_path: Path
) -> None:
    config = IdemConfig(
        group=f"g-{uuid.uuid4().hex[:8]}", redis_url=redis_server.url, data_dir=str(tmp_path)
    )
    TopicStore(real_redis).create_topic("orders", 1)
    sink = RecordingListener()
    consumer, hook = _consumer(config, redis_server, sink, commit_interval_ms=1500)
    mq = MessageQueue("orders", 0)
    consumer.start()
    try:
        Producer("p", client=real_redis).send_batch(
            [new_message("orders", b"{}", keys=f"ORDER-{i}") for i in range(4)]
        )
        eventually(lambda: len(sink.keys) == 4)
        # in the sink, not yet in the ledger: the offset stays before them
        assert hook.committer.pending_keys == 4
        assert consumer.offset_store.read_offset(mq, ReadOffsetType.READ_FROM_MEMORY) == 0
        eventually(
            lambda: consumer.offset_store.read_offset(mq, ReadOffsetType.READ_FROM_MEMORY) == 4
        )
        ledger = hook.dedup.ledger.window(0, None).keys.column("key").to_pylist()
        assert sorted(ledger) == [f"ORDER-{i}" for i in range(4)]
        assert hook.stats.commits == 1
    finally:
        consumer.shutdown()


def test_two_copies_with_one_msg_id_in_one_request_both_leave_the_queue(
    redis_server: RedisServer, real_redis: redis.Redis, tmp_path: Path
) -> None:
    # C1 in one consume request: the producer's resend stored the message twice in the
    # queue, one msg id at offsets 0 and 1. The first copy waits for the group commit,
    # the second is an in-batch duplicate, acknowledged at once: it must leave the
    # process queue, or the offset is stuck at it until the consume timeout.
    config = IdemConfig(
        group=f"g-{uuid.uuid4().hex[:8]}", redis_url=redis_server.url, data_dir=str(tmp_path)
    )
    topics = TopicStore(real_redis)
    topics.create_topic("orders", 1)
    mq = MessageQueue("orders", 0)
    twice = new_message("orders", b"{}", keys="ORDER-0")
    topics.put(mq, [twice, twice, new_message("orders", b"{}", keys="ORDER-1")])
    sink = RecordingListener()
    consumer = PushConsumer(
        config, settings=replace(FAST, consume_message_batch_max_size=16),
        client=redis_server.client(),
    )  # fmt: skip
    consumer.subscribe("orders")
    hook = DedupMiddleware(Dedup(config, client=redis_server.client()), commit_interval_ms=50)
    consumer.use(hook)
    consumer.register_message_listener_concurrently(sink)
    consumer.start()
    try:
        eventually(lambda: consumer_offsets(real_redis, config.group).get(mq) == 3, timeout=5)
        assert sorted(sink.keys) == ["ORDER-0", "ORDER-1"]
        assert hook.stats.duplicates == {"in_batch": 1}
        pq = consumer.rebalance.get(mq) if consumer.rebalance else None
        assert pq is not None
        assert pq.msg_count == 0
    finally:
        consumer.shutdown()


def test_a_commit_lock_whose_reply_was_lost_does_not_hold_up_the_commit(
    redis_server: RedisServer, real_redis: redis.Redis, tmp_path: Path
) -> None:
    """The lock's ``SET NX`` reached Redis but its reply was lost: the lock is this
    owner's already. The commit takes it as its own, rather than waiting out the lock's
    time-to-live, and gives it back after."""
    config = IdemConfig(
        group=f"g-{uuid.uuid4().hex[:8]}", redis_url=redis_server.url, data_dir=str(tmp_path)
    )
    dedup = Dedup(config, client=redis_server.client())
    committer = GroupCommitter(dedup, "consumer-1", client=redis_server.client())
    claim = dedup.begin(["ORDER-1"], owner="consumer-1")
    real_redis.set(committer.lock_key, "consumer-1", px=committer.lock_ttl_ms)

    started = time.monotonic()
    outcome = committer.commit(
        CommitItem(
            keys=["ORDER-1"],
            prints=[""],
            messages=[MessageExt(topic="orders", msg_id="M1", keys="ORDER-1", body=b"{}")],
            ledger_version=claim.ledger_version,
        ),
        timeout=30,
    )
    took = time.monotonic() - started
    committer.close(timeout=10)
    assert outcome.version is not None
    assert dedup.ledger.existing(["ORDER-1"], since_ms=None) == {"ORDER-1": ""}
    assert took < committer.lock_ttl_ms / 2000, f"waited {took:.1f} s for its own lock"
    assert real_redis.get(committer.lock_key) is None
