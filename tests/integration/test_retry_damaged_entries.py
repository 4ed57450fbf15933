"""Entries of ``%RETRY%<group>`` that are not idem messages, on a real redis-server.

Something other than idem (a script, a damaged AOF, another tool) may write into the
retry topic's stream. Such an entry must not stop the group's retries: before, every
read of the topic raised on it, and the push consumer's pull loop retried that read
forever, so the good retries around it were never consumed either. It must end as one
DLQ row with its reason (and its raw bytes as the body), and leave the topic.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import redis
from retry_helpers import RecordingListener
from waiting import FAST, eventually

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry.consumer import PushConsumer, TopicStore
from idem.retry.dlq import DeadLetter, DeadLetterTable
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt

pytestmark = pytest.mark.integration

NOT_JSON = b"\xff{not json"
NO_TOPIC = json.dumps({"v": 1, "msg_id": "FOREIGN", "body": ""}).encode()


@pytest.fixture
def config(real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path) -> IdemConfig:
    TopicStore(real_redis).create_topic("orders", 1)
    return IdemConfig(
        group=f"dmg-{uuid.uuid4().hex[:8]}",
        redis_url=redis_server.url,
        data_dir=str(tmp_path),
        delay_levels="1s 1s 1s",
    )


def _retry(engine: RetryEngine, clock: ManualClock, key: str) -> None:
    """Send ``key`` back and move it into the retry topic at once (the clock jumps)."""
    engine.send_back([MessageExt(topic="orders", msg_id=f"M-{key}", keys=key, body=b"{}")])
    clock.advance(3600)
    assert engine.tick() == 1


def _letters_by_body(config: IdemConfig) -> dict[bytes, DeadLetter]:
    return {d.body: d for d in DeadLetterTable(config.resolved_dlq_path, config.group).list()}


def test_damaged_retry_entries_are_dead_lettered_and_the_consumer_goes_on(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    """Damaged entries between good retries, one of them stranded with a previous owner
    (the consumer takes it over): the good ones are consumed once, each damaged entry is
    one DLQ row with its raw bytes and reason, and the topic ends empty."""
    clock = ManualClock()
    engine = RetryEngine(config, clock=clock)
    stream = engine.store.keys.stream
    _retry(engine, clock, "K1")
    engine.topic.ensure_group()
    stranded = real_redis.xadd(stream, {"m": NOT_JSON, "o": b"900"})
    # a previous owner read it and died: it is pending, never to be read by ">" again
    real_redis.xreadgroup(config.group, "a-previous-owner", {stream: ">"})
    no_m = real_redis.xadd(stream, {"junk": b"\xff\x00"})
    no_topic = real_redis.xadd(stream, {"m": NO_TOPIC, "o": b"901"})
    _retry(engine, clock, "K2")

    got = RecordingListener()
    consumer = PushConsumer(config, settings=FAST)
    consumer.subscribe("orders")
    consumer.register_message_listener_concurrently(got)
    consumers.append(consumer.start())

    letters = eventually(
        lambda: (found := _letters_by_body(config)) and len(found) >= 3 and found,
        timeout=30,
        what="three dead letters",
    )
    eventually(lambda: real_redis.xlen(stream) == 0, timeout=10, what="an empty retry topic")
    assert sorted(got.keys) == ["K1", "K2"]
    assert len(letters) == 3
    name = f"%RETRY%{config.group}"
    for body, entry_id, why in (
        (NOT_JSON, stranded, "not JSON"),
        (NO_TOPIC, no_topic, "field 'topic' is missing"),
    ):
        letter = letters[body]
        assert letter.topic == name
        assert letter.msg_id == f"UNDECODABLE-{name}-{entry_id.decode()}"
        assert f"{name} entry {entry_id.decode()} is not a message" in letter.reason
        assert why in letter.reason
        assert letter.last_error is not None
        assert why in letter.last_error
    [junk] = [d for body, d in letters.items() if body not in (NOT_JSON, NO_TOPIC)]
    assert junk.msg_id == f"UNDECODABLE-{name}-{no_m.decode()}"
    assert "has no field 'm'" in junk.reason
    assert json.loads(junk.body) == {"junk": "\\xff\x00"}  # the bad byte spelled out
    assert real_redis.xpending(stream, config.group)["pending"] == 0
    assert engine.pending() == 0


def test_poll_retry_dead_letters_a_damaged_entry_once_and_returns_the_good_ones(
    real_redis: redis.Redis, config: IdemConfig
) -> None:
    """The engine's own read: the good messages of the read come back, the damaged entry
    is dead-lettered and removed; reading again finds nothing (one DLQ row, not two)."""
    clock = ManualClock()
    engine = RetryEngine(config, clock=clock)
    _retry(engine, clock, "K1")
    damaged = real_redis.xadd(engine.store.keys.stream, {"m": NOT_JSON, "o": b"1"})
    _retry(engine, clock, "K2")
    assert [m.keys for m in engine.poll_retry("c", 10)] == ["K1", "K2"]
    assert engine.poll_retry("c", 10) == []
    [letter] = DeadLetterTable(config.resolved_dlq_path, config.group).list()
    assert letter.body == NOT_JSON
    assert f"entry {damaged.decode()} is not a message" in letter.reason
    assert real_redis.xlen(engine.store.keys.stream) == 2  # the good ones, not yet acked
