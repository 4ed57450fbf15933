"""Copies of one key with different payloads reach the push consumer's dedup hook, on a
real redis-server: they follow ``mismatch_policy`` whether they meet in one consume call
or arrive after the key was completed.

A retry (``reconsume_times`` 1) and a fresh message of the same key with another body
(sent back because its key was busy meanwhile) are delivered from ``%RETRY%<group>``
in one call. The retry wins and reaches the listener; the fresh copy is a payload
mismatch: dead-lettered naming the key (``dead_letter``), failed and retried until
dead-lettered (``raise``), or acknowledged with a warning (``warn``); counted in every
case.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis
from waiting import FAST, eventually

from idem.config import IdemConfig, MismatchPolicy
from idem.dedup import Dedup
from idem.redis_server import RedisServer
from idem.retry import MessageExt, RetryEngine
from idem.retry.consumer import (
    BatchResult,
    ConsumeScope,
    DedupMiddleware,
    Producer,
    PushConsumer,
    TopicStore,
    new_message,
)
from idem.retry.consumer.listener import CallNext
from idem.retry.status import ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus

pytestmark = pytest.mark.integration

KEY = "ORDER-1"
RETRIED = json.dumps({"order_id": KEY, "amount": 10}).encode()
FRESH = json.dumps({"order_id": KEY, "amount": 99}).encode()
"""The fresh copy's body: the same key, another payload."""


class BodySink:
    """A concurrent listener writing every message's body (a sink's durable state)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bodies: list[bytes] = []

    def __call__(
        self, messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        with self.lock:
            self.bodies += [m.body for m in messages]
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


def _config(tmp_path: Path, server: RedisServer, policy: MismatchPolicy) -> IdemConfig:
    return IdemConfig(
        group=f"mm-{uuid.uuid4().hex[:8]}",
        redis_url=server.url,
        data_dir=str(tmp_path),
        delay_levels="1s 1s 1s",
        max_reconsume_times=1,
        mismatch_policy=policy,
    )


class CallSizes:
    """An outer middleware recording how many messages each consume call held."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(
        self, messages: Sequence[MessageExt], scope: ConsumeScope, call_next: CallNext
    ) -> BatchResult:
        self.sizes.append(len(messages))
        return call_next(messages)


def _start(
    config: IdemConfig,
    server: RedisServer,
    consumers: list[PushConsumer],
    sink: BodySink,
    calls: CallSizes | None = None,
) -> tuple[PushConsumer, DedupMiddleware]:
    # a batch of up to 8 messages per consume call: both copies in one call
    settings = FAST.with_changes(consume_message_batch_max_size=8)
    consumer = PushConsumer(config, settings=settings, client=server.client())
    consumer.subscribe("orders")
    if calls is not None:
        consumer.use(calls)
    hook = DedupMiddleware(Dedup(config, client=server.client()))
    consumer.use(hook)
    consumer.register_message_listener_concurrently(sink)
    consumers.append(consumer.start())
    return consumer, hook


def _letters(config: IdemConfig, engine: RetryEngine) -> dict[bytes, str]:
    return {d.body: d.last_error or "" for d in engine.dlq.list()}


@pytest.mark.parametrize(
    "policy",
    [MismatchPolicy.DEAD_LETTER, MismatchPolicy.RAISE, MismatchPolicy.WARN],
    ids=["dead_letter", "raise", "warn"],
)
def test_a_retry_and_a_fresh_copy_with_another_payload_in_one_call_follow_the_policy(  # noqa: PLR0917 (fixtures and parameters)
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    consumers: list[PushConsumer],
    caplog: pytest.LogCaptureFixture,
    policy: MismatchPolicy,
) -> None:
    config = _config(tmp_path, redis_server, policy)
    TopicStore(real_redis).create_topic("orders", 1)
    engine = RetryEngine(config, client=redis_server.client())
    retried = MessageExt(topic="orders", msg_id="M-RETRIED", keys=KEY, body=RETRIED)
    fresh = MessageExt(topic="orders", msg_id="M-FRESH", keys=KEY, body=FRESH, queue_offset=1)
    engine.send_back([retried], errors={"M-RETRIED": "db down"})  # reconsume_times 1
    engine.send_back_busy([fresh])  # reconsume_times 0: its key was busy
    # both wait in %RETRY%<group> before the consumer starts: one pull, one call
    eventually(lambda: engine.tick() >= 0 and engine.pending() == 2 and _in_topic(engine) == 2)
    sink, calls = BodySink(), CallSizes()
    caplog.set_level(logging.WARNING)
    _, hook = _start(config, redis_server, consumers, sink, calls)

    eventually(lambda: engine.pending() == 0, timeout=30, what="the retry topic drained")
    eventually(lambda: hook.committer.pending_keys == 0)
    assert calls.sizes[0] == 2  # both copies in the first consume call
    assert sink.bodies == [RETRIED]  # the retry's chain goes on; the sink has it once
    letters = _letters(config, engine)
    if policy is MismatchPolicy.WARN:
        assert letters == {}
        assert any(
            KEY in r.getMessage() and "another payload" in r.getMessage() for r in caplog.records
        )
    else:
        # never acknowledged as a duplicate: it ends in the DLQ, body and reason kept
        assert list(letters) == [FRESH]
        assert KEY in letters[FRESH]
        assert "payload_mismatch" in letters[FRESH]
    assert hook.stats.duplicates["in_batch"] == 1
    if policy is MismatchPolicy.RAISE:
        # retried like a failed message, then found the key completed with another payload
        assert hook.stats.mismatched == 2
        assert hook.stats.duplicates["completed"] == 1
    else:
        assert hook.stats.mismatched == 1


def _in_topic(engine: RetryEngine) -> int:
    """Messages moved to ``%RETRY%<group>`` and not yet read."""
    return int(engine.topic.client.xlen(engine.topic.key))


@pytest.mark.parametrize(
    "policy", [MismatchPolicy.DEAD_LETTER, MismatchPolicy.WARN], ids=["dead_letter", "warn"]
)
def test_a_completed_key_arriving_with_another_payload_follows_the_policy(
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    consumers: list[PushConsumer],
    policy: MismatchPolicy,
) -> None:
    config = _config(tmp_path, redis_server, policy)
    TopicStore(real_redis).create_topic("orders", 1)
    sink = BodySink()
    consumer, hook = _start(config, redis_server, consumers, sink)
    producer = Producer("p", client=real_redis)
    producer.send(new_message("orders", RETRIED, keys=KEY))
    eventually(lambda: hook.stats.completed == 1, what="the first copy completed")
    producer.send(new_message("orders", FRESH, keys=KEY))
    eventually(lambda: hook.stats.mismatched == 1, what="the second copy counted")
    engine = consumer.engine
    assert engine is not None
    if policy is MismatchPolicy.DEAD_LETTER:
        letters = eventually(lambda: _letters(config, engine), what="the dead letter")
        assert list(letters) == [FRESH]
        assert KEY in letters[FRESH]
        assert "payload_mismatch" in letters[FRESH]
    assert sink.bodies == [RETRIED]
    assert hook.stats.duplicates["completed"] == 1
    if policy is MismatchPolicy.WARN:
        assert engine.dlq.count() == 0
