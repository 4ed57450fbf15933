"""An outage of the dedup store never dead-letters a healthy message.

The consumer's topics live on one real redis-server, its dedup claims on another,
which is killed (SIGKILL) while messages arrive. Each message the dedup hook cannot
claim comes back later without counting toward ``max_reconsume_times``; once the
store is back, every message is consumed once and the DLQ stays empty.
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
from idem.retry.consumer import DedupMiddleware, Producer, PushConsumer, TopicStore, new_message

pytestmark = pytest.mark.integration


def test_messages_waiting_out_a_dedup_store_outage_are_never_dead_lettered(
    redis_server: RedisServer, real_redis: redis.Redis, tmp_path: Path
) -> None:
    config = IdemConfig(
        group=f"g-{uuid.uuid4().hex[:8]}",
        redis_url=redis_server.url,
        data_dir=str(tmp_path),
        delay_levels="1s 1s 1s",
        max_reconsume_times=1,
        engine="delta-rs",
    )
    TopicStore(real_redis).create_topic("orders", 1)
    sink = RecordingListener()
    with RedisServer(appendonly=True) as dedup_store:
        dedup = Dedup(config.with_changes(redis_url=dedup_store.url))
        consumer = PushConsumer(config, settings=FAST, client=redis_server.client())
        consumer.subscribe("orders")
        consumer.use(DedupMiddleware(dedup, key="keys"))
        consumer.register_message_listener_concurrently(sink)
        consumer.start()
        try:
            dedup_store.kill()
            producer = Producer("p", client=real_redis)
            keys = [f"ORDERID_{n}" for n in range(5)]
            for key in keys:
                producer.send(new_message("orders", b"{}", keys=key))
            engine = consumer.engine
            assert engine is not None
            # Counted, the second failed claim of a message would dead-letter it.
            eventually(
                lambda: consumer.stats.sent_back >= 3 * len(keys) or engine.dlq.count() > 0,
                timeout=60,
            )
            assert engine.dlq.count() == 0
            assert sink.keys == []
            dedup_store.start()
            eventually(lambda: sorted(sink.keys) == keys, timeout=60)
            eventually(lambda: engine.pending() == 0, timeout=30)
            assert engine.dlq.count() == 0
            assert sorted(sink.keys) == keys
        finally:
            consumer.shutdown()
