"""One retry chain per failed delivery when the retry side's Redis is down during send-back.

The consumer's topics and offsets live on one real redis-server, its retry engine's
schedule queues and ``%RETRY%<group>`` on another, which is killed (SIGKILL) before the
messages arrive. Every send-back then reaches the Delta retry journal but not Redis, and
the consumer re-submits the message locally; the journaled resend is delivered again
from the retry topic once Redis is back. A listener that fails a message's first
deliveries must see it succeed once: the local re-submits and the journaled resends are
one chain, so after recovery at most one retry per failed delivery is live, none is
lost, and no copy comes back after the local success.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from waiting import FAST, eventually

from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry import FaultTolerance, MessageExt, RetryEngine, audit_states
from idem.retry.consumer import Producer, PushConsumer, TopicStore, new_message
from idem.retry.status import ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus

pytestmark = pytest.mark.integration

FAULTS = FaultTolerance(
    redis_attempts=1,
    fallback_attempts=1,
    wait_initial_s=0.01,
    wait_max_s=0.02,
    resubmit_delay_ms=300,
)


class FailingFirst:
    """Fails each key's first ``failures`` deliveries, then succeeds; records every call."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: Counter[str] = Counter()
        self.succeeded: Counter[str] = Counter()

    def __call__(
        self, messages: Sequence[MessageExt], _context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        (message,) = messages
        key = message.keys or ""
        self.calls[key] += 1
        if self.calls[key] <= self.failures:
            return ConsumeConcurrentlyStatus.RECONSUME_LATER
        self.succeeded[key] += 1
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


@pytest.fixture
def retry_store(tmp_path: Path) -> Iterator[RedisServer]:
    """The retry side's own redis-server (append-only), to kill and restart."""
    (tmp_path / "retry-redis").mkdir()
    server = RedisServer(appendonly=True, directory=tmp_path / "retry-redis")
    server.start()
    yield server
    server.stop()


def _consumer(
    redis_server: RedisServer,
    real_redis: redis.Redis,
    retry_store: RedisServer,
    tmp_path: Path,
    *,
    listener: FailingFirst,
    faults: FaultTolerance,
) -> tuple[PushConsumer, RetryEngine]:
    """A started consumer of ``orders`` whose retry engine is on ``retry_store``."""
    config = IdemConfig(
        group=f"g-{uuid.uuid4().hex[:8]}",
        redis_url=redis_server.url,
        data_dir=str(tmp_path / "data"),
        delay_levels="1s 1s 1s",
    )
    fail_fast = retry_store.client(
        retry=Retry(NoBackoff(), 0), socket_connect_timeout=0.5, socket_timeout=2
    )
    engine = RetryEngine(
        config.with_changes(redis_url=retry_store.url), client=fail_fast, faults=faults
    )
    TopicStore(real_redis).create_topic("orders", 2)
    consumer = PushConsumer(config, settings=FAST, client=redis_server.client(), engine=engine)
    consumer.subscribe("orders")
    consumer.register_message_listener_concurrently(listener)
    consumer.start()
    return consumer, engine


def test_local_resubmits_during_a_retry_redis_outage_make_one_retry_chain(
    redis_server: RedisServer, real_redis: redis.Redis, retry_store: RedisServer, tmp_path: Path
) -> None:
    failures = 3
    listener = FailingFirst(failures)
    consumer, engine = _consumer(
        redis_server, real_redis, retry_store, tmp_path, listener=listener, faults=FAULTS
    )
    keys = [f"ORDER_{n}" for n in range(8)]
    try:
        retry_store.kill()
        producer = Producer("p", client=real_redis)
        origins = {producer.send(new_message("orders", b"{}", keys=key)).msg_id for key in keys}
        # every send-back is journaled but reaches no Redis: each key is failed and
        # re-submitted locally until it succeeds, all while the retry side is down
        eventually(lambda: all(listener.succeeded[k] for k in keys), timeout=60)
        assert consumer.stats.resubmitted >= failures * len(keys)
        retry_store.start()
        engine.sync()

        # at most one live retry per failed delivery, in the journal and in Redis
        live = Counter(e.origin_msg_id for e in engine.journal.live().values())
        assert all(n <= 1 for n in live.values()), f"retry chains per delivery: {live}"
        in_redis = Counter(e.origin_msg_id for e in engine.store.live_entries())
        assert all(n <= 1 for n in in_redis.values()), f"live in Redis per delivery: {in_redis}"

        # whatever the journal still holds comes due within seconds: nothing comes back
        eventually(lambda: engine.pending() == 0, timeout=30, what="no retry pending")
        time.sleep(3)
        assert listener.succeeded == dict.fromkeys(keys, 1), listener.succeeded
        assert engine.pending() == 0
        assert engine.dlq.count() == 0
        audit = audit_states(engine, origins, done=origins)
        assert audit.ok, audit.describe()
    finally:
        consumer.shutdown()
        engine.close()


def test_a_retried_copy_of_a_message_consumed_locally_is_not_consumed_again(
    redis_server: RedisServer, real_redis: redis.Redis, retry_store: RedisServer, tmp_path: Path
) -> None:
    """Redis is back right after the send-back: the journaled resend comes due (1 s) and
    reaches the consumer from the retry topic around the time its local re-submit (3 s)
    runs. Whichever comes second is not consumed."""
    listener = FailingFirst(1)
    faults = replace(FAULTS, resubmit_delay_ms=3000)
    consumer, engine = _consumer(
        redis_server, real_redis, retry_store, tmp_path, listener=listener, faults=faults
    )

    def back_at_once(stage: str, _messages: Sequence[MessageExt]) -> None:
        if stage == "resubmit" and not retry_store.running:
            retry_store.start()

    keys = [f"ORDER_{n}" for n in range(6)]
    try:
        retry_store.kill()
        engine.on_stage = back_at_once
        producer = Producer("p", client=real_redis)
        origins = {producer.send(new_message("orders", b"{}", keys=key)).msg_id for key in keys}
        eventually(lambda: all(listener.succeeded[k] for k in keys), timeout=60)
        eventually(lambda: engine.pending() == 0, timeout=30, what="no retry pending")
        time.sleep(3)
        assert consumer.stats.resubmitted >= 1
        assert listener.succeeded == dict.fromkeys(keys, 1), listener.succeeded
        assert engine.pending() == 0
        audit = audit_states(engine, origins, done=origins)
        assert audit.ok, audit.describe()
    finally:
        consumer.shutdown()
        engine.close()


def test_a_message_failing_from_the_retry_topic_during_the_outage_keeps_one_chain(
    redis_server: RedisServer, real_redis: redis.Redis, retry_store: RedisServer, tmp_path: Path
) -> None:
    """The first failure is sent back while Redis is up; the retry side dies as the retried
    copy is consumed, so its failures are re-submitted locally on the retry topic's own
    process queue, where the journaled resend takes its place and is consumed."""

    killed = threading.Lock()

    class DiesOnRetry(FailingFirst):
        def __call__(
            self, messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
        ) -> ConsumeConcurrentlyStatus:
            if messages[0].reconsume_times > 0 and killed.acquire(blocking=False):
                retry_store.kill()  # once: the first retried delivery
            return super().__call__(messages, context)

    listener = DiesOnRetry(3)
    consumer, engine = _consumer(
        redis_server, real_redis, retry_store, tmp_path, listener=listener, faults=FAULTS
    )
    keys = [f"ORDER_{n}" for n in range(4)]
    try:
        producer = Producer("p", client=real_redis)
        origins = {producer.send(new_message("orders", b"{}", keys=key)).msg_id for key in keys}
        # a key retried from %RETRY% fails twice more, locally, then succeeds: all while down
        eventually(lambda: any(listener.succeeded.values()), timeout=60)
        assert not retry_store.running
        retry_store.start()
        eventually(lambda: all(listener.succeeded[k] for k in keys), timeout=60)
        eventually(lambda: engine.pending() == 0, timeout=30, what="no retry pending")
        time.sleep(3)
        assert listener.succeeded == dict.fromkeys(keys, 1), listener.succeeded
        assert engine.pending() == 0
        assert engine.dlq.count() == 0
        audit = audit_states(engine, origins, done=origins)
        assert audit.ok, audit.describe()
    finally:
        consumer.shutdown()
        engine.close()
