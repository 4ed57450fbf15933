"""A clean shutdown finishes the group commit of what its listener already consumed.

With RocketMQ's default ``await_termination_ms = 0`` the shutdown waited 0 ms for the
dedup hook's pending ledger commit: the offsets were persisted before the consumed
messages (the sink already held them), and a process exiting right after left their
keys claimed and uncommitted. The next instance found them busy until the lease ran
out (5 min), then ran the listener for them again: twice at the sink, after a clean
shutdown.
"""

from __future__ import annotations

import uuid
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
    TopicStore,
    consumer_offsets,
    new_message,
)

pytestmark = pytest.mark.integration


def test_shutdown_commits_the_consumed_keys_before_persisting_their_offsets(
    redis_server: RedisServer, real_redis: redis.Redis, tmp_path: Path
) -> None:
    config = IdemConfig(
        group=f"g-{uuid.uuid4().hex[:8]}", redis_url=redis_server.url, data_dir=str(tmp_path)
    )
    TopicStore(real_redis).create_topic("orders", 1)
    sink = RecordingListener()
    assert FAST.await_termination_ms == 0  # RocketMQ's default
    consumer = PushConsumer(config, settings=FAST, client=redis_server.client())
    consumer.subscribe("orders")
    hook = DedupMiddleware(Dedup(config, client=redis_server.client()), commit_interval_ms=10_000)
    consumer.use(hook)
    consumer.register_message_listener_concurrently(sink)
    consumer.start()
    try:
        Producer("p", client=real_redis).send_batch(
            [new_message("orders", b"{}", keys=f"ORDER-{i}") for i in range(3)]
        )
        eventually(lambda: len(sink.keys) == 3)
        assert hook.committer.pending_keys == 3  # in the sink, waiting for the commit
    finally:
        consumer.shutdown()
    assert hook.committer.pending_keys == 0
    ledger = hook.dedup.ledger.window(0, None).keys.column("key").to_pylist()
    assert sorted(ledger) == ["ORDER-0", "ORDER-1", "ORDER-2"]
    assert consumer_offsets(real_redis, config.group)[MessageQueue("orders", 0)] == 3
