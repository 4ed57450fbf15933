"""Orderly consumption: per-queue order at the sink survives a suspended, retried message.

Two instances share a 4-queue topic; each order's steps go to one queue
(``select_message_queue_by_hash``). One step fails twice
(``SUSPEND_CURRENT_QUEUE_A_MOMENT``): its queue pauses, the step is retried in
place and nothing behind it runs meanwhile. A poison step fails every time and
goes to ``%DLQ%<group>`` after ``max_reconsume_times`` local retries; its queue
then moves on.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from redis_backends import RealRedis
from waiting import FAST, eventually

from idem.config import IdemConfig
from idem.retry.consumer import (
    MessageQueue,
    Producer,
    PushConsumer,
    QueueLocks,
    TopicStore,
    consumer_offsets,
    new_message,
    select_message_queue_by_hash,
)
from idem.retry.message import MessageExt
from idem.retry.status import ConsumeOrderlyContext, ConsumeOrderlyStatus

pytestmark = pytest.mark.integration

ORDERS, STEPS = 8, 5
FLAKY, FLAKY_FAILURES = "O3-2", 2
POISON = "O5-1"
SUSPEND_MS = 200


class OrderSink:
    """Writes steps in the order the listener sees them; fails the flaky and poison steps."""

    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []
        self.attempts: dict[str, list[float]] = defaultdict(list)
        self._lock = threading.Lock()

    def listener(
        self, name: str
    ) -> Callable[[Sequence[MessageExt], ConsumeOrderlyContext], ConsumeOrderlyStatus]:
        def consume(
            messages: Sequence[MessageExt], context: ConsumeOrderlyContext
        ) -> ConsumeOrderlyStatus:
            for message in messages:
                key = message.keys or ""
                with self._lock:
                    self.attempts[key].append(time.monotonic())
                    tries = len(self.attempts[key])
                if key == POISON or (key == FLAKY and tries <= FLAKY_FAILURES):
                    return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
                with self._lock:
                    self.rows.append(
                        {
                            "key": key,
                            "queue": message.queue_id,
                            "offset": message.queue_offset,
                            "by": name,
                            "reconsume": message.reconsume_times,
                        }
                    )
            return ConsumeOrderlyStatus.SUCCESS

        return consume


def test_order_kept_across_a_suspended_message(real_backend: RealRedis, tmp_path: Path) -> None:
    real_redis = real_backend.client
    group = f"o-{uuid.uuid4().hex[:8]}"
    config = IdemConfig(
        group=group, redis_url=real_backend.url, data_dir=str(tmp_path), max_reconsume_times=3
    )
    TopicStore(real_redis).create_topic("orders", 4)
    settings = replace(
        FAST,
        heartbeat_expire_ms=1000,
        lock_interval_ms=200,
        persist_consumer_offset_interval_ms=200,
        suspend_current_queue_time_millis=SUSPEND_MS,
    )
    sink = OrderSink()
    consumers = []
    for name in ("a", "b"):
        consumer = PushConsumer(
            config, settings=settings, client=real_backend.new_client(), instance_name=name
        )
        consumer.subscribe("orders")
        consumer.register_message_listener_orderly(sink.listener(name))
        consumers.append(consumer.start())
    try:
        locks = QueueLocks(real_redis, group, "observer", ttl_ms=1000)
        mqs = TopicStore(real_redis).message_queues("orders")
        # both instances in, each queue locked by exactly one of them
        eventually(lambda: all(len(c.process_queues()) == 2 for c in consumers))
        holders = {mq: locks.holder(mq) for mq in mqs}
        assert set(holders.values()) == {c.client_id for c in consumers}

        producer = Producer("p", client=real_redis)
        for step in range(STEPS):
            for order in range(ORDERS):
                producer.send(
                    new_message("orders", b"{}", keys=f"O{order}-{step}"),
                    selector=select_message_queue_by_hash,
                    arg=f"O{order}",
                )
        expected = {f"O{o}-{s}" for o in range(ORDERS) for s in range(STEPS)} - {POISON}
        eventually(lambda: {r["key"] for r in sink.rows} == expected)
        dlq = consumers[0].engine.dlq if consumers[0].engine else None
        assert dlq is not None
        eventually(lambda: dlq.count() == 1)
    finally:
        for consumer in consumers:
            consumer.shutdown()

    by_queue: dict[object, list[dict[str, object]]] = defaultdict(list)
    for row in sink.rows:
        by_queue[row["queue"]].append(row)
    for queue, rows in by_queue.items():
        offsets = [int(str(r["offset"])) for r in rows]
        assert offsets == sorted(offsets), f"queue {queue} written out of order: {offsets}"
        assert len({r["by"] for r in rows}) == 1, "one instance per queue"
    for order in range(ORDERS):
        steps = [
            int(str(r["key"]).split("-")[1])
            for r in sink.rows
            if str(r["key"]).startswith(f"O{order}-")
        ]
        assert steps == sorted(steps), f"order O{order} out of order: {steps}"
    assert len(sink.rows) == len(expected)  # nothing written twice

    flaky = next(r for r in sink.rows if r["key"] == FLAKY)
    assert flaky["reconsume"] == FLAKY_FAILURES
    tries = sink.attempts[FLAKY]
    assert all(b - a >= SUSPEND_MS / 1000 * 0.9 for a, b in itertools.pairwise(tries))
    letter = dlq.list()[0]
    assert letter.key == POISON
    assert letter.reconsume_times == 3
    # it ran out of local retries; it did not ask to be dead-lettered
    assert letter.reason == "reconsume times reached max (3)"
    assert len(sink.attempts[POISON]) == 4  # first try + 3 local retries


def test_a_filtered_message_does_not_move_the_offset_past_the_batch_being_consumed(
    real_backend: RealRedis, tmp_path: Path
) -> None:
    # An orderly listener is on K0 when a message the tag filter drops (K1) arrives. The
    # offset may pass K1 only once K0 is done: persisted past K0 earlier, a crash in
    # the listener would lose K0 for good.
    real_redis = real_backend.client
    group = f"f-{uuid.uuid4().hex[:8]}"
    config = IdemConfig(group=group, redis_url=real_backend.url, data_dir=str(tmp_path))
    TopicStore(real_redis).create_topic("orders", 1)
    started, release = threading.Event(), threading.Event()

    def slow(
        messages: Sequence[MessageExt], context: ConsumeOrderlyContext
    ) -> ConsumeOrderlyStatus:
        started.set()
        release.wait(30)
        return ConsumeOrderlyStatus.SUCCESS

    settings = replace(FAST, lock_interval_ms=200)
    consumer = PushConsumer(config, settings=settings, client=real_backend.new_client())
    consumer.subscribe("orders", "A")
    consumer.register_message_listener_orderly(slow)
    consumer.start()
    try:
        producer = Producer("p", client=real_redis)
        producer.send(new_message("orders", b"{}", keys="K0", tags="A"))
        assert started.wait(10)
        producer.send(new_message("orders", b"{}", keys="K1", tags="B"))  # filtered out
        time.sleep(10 * settings.persist_consumer_offset_interval_ms / 1000)
        assert consumer_offsets(real_redis, group).get(MessageQueue("orders", 0), 0) == 0
        release.set()  # K0 done: the offset moves on (past K1 with a later pull, as RocketMQ)
        eventually(lambda: consumer_offsets(real_redis, group)[MessageQueue("orders", 0)] >= 1)
    finally:
        release.set()
        consumer.shutdown()


def test_a_bad_suspend_time_from_the_listener_retries_then_dead_letters_naming_it(
    real_backend: RealRedis, tmp_path: Path
) -> None:
    """``suspend_current_queue_time_millis = None`` from the listener is a bad value, not a
    crash while the result is settled: the message is retried, then dead-lettered naming
    it, and the queue's offset never passes it before that."""
    real_redis = real_backend.client
    group = f"s-{uuid.uuid4().hex[:8]}"
    config = IdemConfig(
        group=group, redis_url=real_backend.url, data_dir=str(tmp_path), max_reconsume_times=2
    )
    TopicStore(real_redis).create_topic("orders", 1)
    seen: list[tuple[str, int]] = []

    def mistaken(
        messages: Sequence[MessageExt], context: ConsumeOrderlyContext
    ) -> ConsumeOrderlyStatus:
        seen.extend((m.keys or "", m.reconsume_times) for m in messages)
        if messages[0].keys == "VICTIM":
            context.suspend_current_queue_time_millis = None  # type: ignore[assignment]
            return ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        return ConsumeOrderlyStatus.SUCCESS

    settings = replace(FAST, lock_interval_ms=200, suspend_current_queue_time_millis=10)
    consumer = PushConsumer(config, settings=settings, client=real_backend.new_client())
    consumer.subscribe("orders")
    consumer.register_message_listener_orderly(mistaken)
    producer = Producer("p", client=real_redis)
    for key in ("VICTIM", "NEXT"):
        producer.send(new_message("orders", b"{}", keys=key))
    consumer.start()
    try:
        eventually(lambda: ("NEXT", 0) in seen)
        eventually(lambda: consumer_offsets(real_redis, group).get(MessageQueue("orders", 0)) == 2)
        assert consumer.engine is not None
        [letter] = consumer.engine.dlq.list()
    finally:
        consumer.shutdown()
    assert seen == [("VICTIM", 0), ("VICTIM", 1), ("VICTIM", 2), ("NEXT", 0)]
    assert letter.key == "VICTIM"
    assert letter.reason == "reconsume times reached max (2)"
    assert letter.last_error is not None
    assert (
        "ConfigError: suspend_current_queue_time_millis: None is not a whole number"
        in letter.last_error
    )
