"""The consume timeout: per message, precise to a second, changeable while running.

A message whose listener is stuck is sent back (delay level 3) within a second
of its deadline — RocketMQ scans only every ``consumeTimeout`` minutes, so a
stuck message can wait up to twice the timeout there — and a new timeout set on
the running consumer applies to messages already in flight.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
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
    ReadOffsetType,
    TopicStore,
    new_message,
)
from idem.retry.message import MessageExt
from idem.retry.status import ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus

pytestmark = pytest.mark.integration


class StuckListener:
    """Blocks on chosen keys until released; records when each consume began."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: dict[str, float] = {}

    def __call__(
        self, messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        for message in messages:
            if message.reconsume_times == 0 and (message.keys or "").startswith("STUCK"):
                self.started[message.keys or ""] = time.monotonic()
                self.release.wait(30)
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


@pytest.fixture
def setup(
    real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> Iterator[tuple[PushConsumer, StuckListener, dict[str, float], Producer]]:
    group = f"t-{uuid.uuid4().hex[:8]}"
    config = IdemConfig(
        group=group, redis_url=redis_server.url, data_dir=str(tmp_path), delay_levels="1s 1s 1s"
    )
    TopicStore(real_redis).create_topic("orders", 2)
    sent_back: dict[str, float] = {}

    def on_stage(stage: str, messages: Sequence[MessageExt]) -> None:
        if stage == "applied":
            for message in messages:
                sent_back.setdefault(message.keys or "", time.monotonic())

    engine = RetryEngine(config, client=redis_server.client(), on_stage=on_stage)
    # the first send-back of a group creates its Delta journal (~0.4 s): not what is measured
    engine.send_back([MessageExt(topic="orders", msg_id="WARMUP", keys="WARMUP")])
    settings = ConsumerSettings(
        consume_from_where=ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET,
        consume_timeout_ms=2000,
        pull_block_ms=50,
        heartbeat_interval_ms=200,
        persist_consumer_offset_interval_ms=200,
    )
    listener = StuckListener()
    consumer = PushConsumer(config, settings=settings, client=redis_server.client(), engine=engine)
    consumer.subscribe("orders")
    consumer.register_message_listener_concurrently(listener)
    consumer.start()
    producer = Producer("p", client=real_redis)
    yield consumer, listener, sent_back, producer
    listener.release.set()
    consumer.shutdown()


def _lateness(
    key: str, timeout_s: float, listener: StuckListener, sent_back: dict[str, float]
) -> float:
    eventually(lambda: key in sent_back)
    return sent_back[key] - (listener.started[key] + timeout_s)


def test_stuck_message_is_sent_back_within_a_second_of_its_deadline(
    setup: tuple[PushConsumer, StuckListener, dict[str, float], Producer],
) -> None:
    consumer, listener, sent_back, producer = setup
    sent = producer.send(new_message("orders", b"{}", keys="STUCK-1"))
    late = _lateness("STUCK-1", 2.0, listener, sent_back)
    assert -0.05 <= late <= 1.0, f"sent back {late:+.3f}s from its 2 s deadline"
    assert consumer.stats.snapshot()["expired"] == 1
    assert consumer.concurrently_service is not None
    found_late = list(consumer.concurrently_service.watchdog.lateness_ms)
    assert len(found_late) == 1
    assert 0 <= found_late[0] <= 300  # found within the watchdog's 250 ms look
    # removed so the offset moves past it: the queue is not held back by the stuck message
    eventually(
        lambda: (
            consumer.offset_store.read_offset(sent.message_queue, ReadOffsetType.READ_FROM_MEMORY)
            == sent.queue_offset + 1
        )
    )


def test_a_new_timeout_applies_while_running(
    setup: tuple[PushConsumer, StuckListener, dict[str, float], Producer],
) -> None:
    consumer, listener, sent_back, producer = setup
    consumer.consume_timeout_ms = 4000
    producer.send(new_message("orders", b"{}", keys="STUCK-4S"))
    late = _lateness("STUCK-4S", 4.0, listener, sent_back)
    assert -0.05 <= late <= 1.0, f"sent back {late:+.3f}s from its 4 s deadline"

    # in flight under a 4 s timeout, then shortened to 1 s: it expires at once, not at 4 s
    producer.send(new_message("orders", b"{}", keys="STUCK-SHORTENED"))
    eventually(lambda: "STUCK-SHORTENED" in listener.started)
    time.sleep(1.5)
    assert "STUCK-SHORTENED" not in sent_back
    consumer.consume_timeout_ms = 1000
    changed = time.monotonic()
    eventually(lambda: "STUCK-SHORTENED" in sent_back)
    assert sent_back["STUCK-SHORTENED"] - changed <= 1.0
    assert consumer.stats.snapshot()["expired"] == 2


def test_a_timed_out_message_whose_send_back_fails_is_tried_again_after_the_resubmit_delay(
    setup: tuple[PushConsumer, StuckListener, dict[str, float], Producer],
) -> None:
    consumer, _listener, sent_back, producer = setup
    engine = consumer.engine
    assert engine is not None
    attempts: list[float] = []
    send_back = engine.send_back

    def down_for_a_while(messages: Sequence[MessageExt], **options: object) -> object:
        attempts.append(time.monotonic())
        if len(attempts) < 3:
            raise redis.ConnectionError("the send-back path is down")
        return send_back(messages, **options)  # type: ignore[arg-type]

    engine.send_back = down_for_a_while  # type: ignore[method-assign]
    producer.send(new_message("orders", b"{}", keys="STUCK-DOWN"))
    eventually(lambda: "STUCK-DOWN" in sent_back, timeout=20, what="sent back once it works")
    assert len(attempts) == 3
    gaps = [later - earlier for earlier, later in itertools.pairwise(attempts)]
    assert min(gaps) >= 4.5, f"tried again after {gaps} s, not the 5 s re-submit delay"
    assert consumer.stats.snapshot()["expired"] == 1
