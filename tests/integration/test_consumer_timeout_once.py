"""A message the consume timeout sent back is not sent back again by its own late result.

The watchdog sends a message stuck past the consume timeout back (delay level 3) and
removes it from its process queue. When the stuck listener later answers
``RECONSUME_LATER`` for it, the message is no longer this consumer's to send back: a
second send-back would put a second copy on the retry ladder, and the listener would
run for both.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
from waiting import eventually

from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry import RetryEngine
from idem.retry.consumer import (
    ConsumeFromWhere,
    ConsumerSettings,
    Producer,
    PushConsumer,
    TopicStore,
    new_message,
)
from idem.retry.message import MessageExt
from idem.retry.status import ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus

pytestmark = pytest.mark.integration


class StuckThenFailing:
    """Blocks on a first delivery of ``STUCK*`` until released, then fails it."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.answered: set[str] = set()

    def __call__(
        self, messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        del context
        for message in messages:
            if message.reconsume_times == 0 and (message.keys or "").startswith("STUCK"):
                self.release.wait(30)
                self.answered.add(message.keys or "")
                return ConsumeConcurrentlyStatus.RECONSUME_LATER
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


@pytest.fixture
def setup(
    real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> Iterator[tuple[PushConsumer, StuckThenFailing, Counter[str], Producer]]:
    group = f"t-{uuid.uuid4().hex[:8]}"
    config = IdemConfig(
        group=group, redis_url=redis_server.url, data_dir=str(tmp_path), delay_levels="1s 1s 1s"
    )
    TopicStore(real_redis).create_topic("orders", 1)
    journaled: Counter[str] = Counter()
    lock = threading.Lock()

    def on_stage(stage: str, messages: Sequence[MessageExt]) -> None:
        if stage == "journaled":
            with lock:
                journaled.update(m.msg_id for m in messages)

    engine = RetryEngine(config, client=redis_server.client(), on_stage=on_stage)
    settings = ConsumerSettings(
        consume_from_where=ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET,
        consume_timeout_ms=1000,
        pull_block_ms=50,
        heartbeat_interval_ms=200,
        persist_consumer_offset_interval_ms=200,
    )
    listener = StuckThenFailing()
    consumer = PushConsumer(config, settings=settings, client=redis_server.client(), engine=engine)
    consumer.subscribe("orders")
    consumer.register_message_listener_concurrently(listener)
    consumer.start()
    yield consumer, listener, journaled, Producer("p", client=real_redis)
    listener.release.set()
    consumer.shutdown()


def test_a_timed_out_message_that_then_fails_is_sent_back_once(
    setup: tuple[PushConsumer, StuckThenFailing, Counter[str], Producer],
) -> None:
    consumer, listener, journaled, producer = setup
    sent = producer.send(new_message("orders", b"{}", keys="STUCK-FAILS"))
    eventually(lambda: consumer.stats.snapshot()["expired"] == 1, what="the timeout's send-back")
    listener.release.set()
    eventually(lambda: "STUCK-FAILS" in listener.answered, what="the late answer")
    service = consumer.concurrently_service
    assert service is not None
    eventually(lambda: service._running == 0, what="its result handled")
    assert journaled[sent.msg_id] == 1, "sent back by the timeout and again by its late result"
    assert consumer.stats.snapshot()["sent_back"] == 0
