"""The push consumer's building blocks on a real redis-server, one behaviour per test.

Topics and offsets, average allocation, heartbeats and leaving, tag filtering,
``ack_index``, broadcasting's drop-on-failure, flow control, the local offset
file's backup.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_backends import RealRedis
from waiting import FAST, eventually

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry.consumer import (
    ConsumerSettings,
    LocalFileOffsetStore,
    Membership,
    MessageQueue,
    ProcessQueue,
    Producer,
    PushConsumer,
    ReadOffsetType,
    SendFailed,
    TopicStore,
    allocate_averagely,
    consumer_offsets,
    new_message,
    pull,
    reset_offsets,
)
from idem.retry.consumer.offset_store import reset_epoch_key, reset_marks_key
from idem.retry.dlq import DeadLetterTable
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt
from idem.retry.status import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    MessageModel,
)

pytestmark = pytest.mark.integration


class Recorder:
    """A listener that records what it got and answers with ``answer``."""

    def __init__(
        self,
        answer: Callable[
            [Sequence[MessageExt], ConsumeConcurrentlyContext], ConsumeConcurrentlyStatus
        ]
        | None = None,
    ) -> None:
        self.seen: list[MessageExt] = []
        self.lock = threading.Lock()
        self.answer = answer

    def __call__(
        self, messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        with self.lock:
            self.seen.extend(messages)
        if self.answer is not None:
            return self.answer(messages, context)
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

    def keys(self) -> list[str]:
        with self.lock:
            return [m.keys or "" for m in self.seen]


@pytest.fixture
def config(real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path) -> IdemConfig:
    TopicStore(real_redis).create_topic("orders", 4)
    return IdemConfig(
        group=f"b-{uuid.uuid4().hex[:8]}",
        redis_url=redis_server.url,
        data_dir=str(tmp_path),
        delay_levels="1s 1s 1s",
    )


def start(
    config: IdemConfig,
    listener: Recorder,
    consumers: list[PushConsumer],
    *,
    settings: ConsumerSettings = FAST,
    name: str | None = None,
    sub_expression: str = "*",
) -> PushConsumer:
    consumer = PushConsumer(config, settings=settings, instance_name=name)
    consumer.subscribe("orders", sub_expression)
    consumer.register_message_listener_concurrently(listener)
    consumers.append(consumer.start())
    return consumer


def test_offsets_are_dense_and_searchable_by_time(real_redis: redis.Redis) -> None:
    clock = ManualClock()
    topics = TopicStore(real_redis, clock=clock)
    topics.create_topic("ledger", 1)
    mq = MessageQueue("ledger", 0)
    first = topics.put(mq, [new_message("ledger", b"a", keys="A")])
    clock.advance(10)
    later = topics.put(
        mq, [new_message("ledger", b"b", keys="B"), new_message("ledger", b"c", keys="C")]
    )
    assert first + later == [0, 1, 2]
    assert (topics.min_offset(mq), topics.max_offset(mq)) == (0, 3)
    assert topics.search_offset(mq, clock.now_ms()) == 1
    assert [m.keys for m in topics.pull(mq, 1).messages] == ["B", "C"]
    assert topics.pull(mq, 7).status.value == "OFFSET_ILLEGAL"


def test_allocate_averagely_matches_rocketmq() -> None:
    mqs = [MessageQueue("t", i) for i in range(8)]
    shares = {c: allocate_averagely(c, mqs, ["c1", "c2", "c3"]) for c in ("c1", "c2", "c3")}
    assert [[mq.queue_id for mq in shares[c]] for c in ("c1", "c2", "c3")] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7],
    ]
    assert allocate_averagely("c9", mqs, ["c1"]) == []
    assert [mq.queue_id for mq in allocate_averagely("c2", mqs[:2], ["c1", "c2", "c3"])] == [1]


def test_heartbeats_expire_and_leave_bump_the_epoch(real_redis: redis.Redis) -> None:
    clock = ManualClock()
    a = Membership(real_redis, "g", "a", expire_ms=1000, clock=clock)
    b = Membership(real_redis, "g", "b", expire_ms=1000, clock=clock)
    assert a.beat().client_ids == ("a",)
    joined = b.beat()
    assert joined.changed
    assert joined.client_ids == ("a", "b")
    clock.advance(2)
    expired = a.beat()  # b went silent
    assert expired.changed
    assert expired.client_ids == ("a",)
    assert expired.epoch > joined.epoch
    assert a.leave().client_ids == ()


def test_the_group_shares_the_queues_and_hands_them_over(
    config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    one, two = Recorder(), Recorder()
    a = start(config, one, consumers, name="a")
    b = start(config, two, consumers, name="b")
    eventually(
        lambda: (
            {len([p for p in c.process_queues() if p.mq.topic == "orders"]) for c in (a, b)} == {2}
        )
    )
    b.shutdown()  # leaves: a takes every queue at once
    eventually(lambda: len([p for p in a.process_queues() if p.mq.topic == "orders"]) == 4)


def test_tags_filter_and_the_offset_still_advances(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    producer = Producer("p", client=real_redis)
    producer.send_batch(
        [new_message("orders", b"{}", keys=f"K{i}", tags="A" if i % 2 else "B") for i in range(8)]
    )
    got = Recorder()
    start(config, got, consumers, sub_expression="A")
    eventually(lambda: sum(consumer_offsets(real_redis, config.group).values()) == 8)
    assert sorted(got.keys()) == ["K1", "K3", "K5", "K7"]


def test_a_queue_entry_that_is_not_a_message_is_dead_lettered_and_the_queue_moves_on(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    """Something other than idem's producer wrote a bad entry into a queue: it must not stop
    the queue (before, every pull of the topic failed on it, forever), nor vanish unseen
    behind a tag filter: it becomes one DLQ row with its reason."""
    topics = TopicStore(real_redis)
    mq = MessageQueue("orders", 0)
    topics.put(mq, [new_message("orders", b"{}", keys="K0", tags="A")])
    real_redis.xadd(TopicStore.queue_key(mq), {"junk": b"\xff\x00"}, id="0-*")
    topics.put(mq, [new_message("orders", b"{}", keys="K2", tags="A")])
    got = Recorder()
    start(config, got, consumers, sub_expression="A")
    eventually(lambda: consumer_offsets(real_redis, config.group).get(mq) == 3)
    assert got.keys() == ["K0", "K2"]
    [letter] = DeadLetterTable(config.resolved_dlq_path, config.group).list()
    assert letter.msg_id == "UNDECODABLE-orders-0-1"
    assert letter.last_error is not None
    assert "undecodable: orders:0 offset 1 is not a message (KeyError" in letter.last_error


def test_a_retry_delivery_stranded_with_a_previous_owner_is_taken_over(
    real_redis: redis.Redis,
    config: IdemConfig,
    consumers: list[PushConsumer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A previous owner's read of %RETRY% that was in flight when the queue moved lands in
    its pending list after the new owner's takeover, and that owner may die. The new owner
    must take such deliveries over once they sit idle, or they are never consumed."""
    monkeypatch.setattr(pull, "RETAKE_IDLE_MS", 300, raising=False)
    got = Recorder()
    consumer = start(config, got, consumers)
    engine = consumer.engine
    assert engine is not None
    read = engine.poll_retry
    owner_reads = threading.Event()  # until set, the owner's reads of %RETRY% come back empty

    def owner_poll(name: str, count: int, block_ms: int | None = None) -> list[MessageExt]:
        if not owner_reads.is_set():
            time.sleep(0.02)
            return []
        return read(name, count, block_ms)

    monkeypatch.setattr(engine, "poll_retry", owner_poll)
    engine.send_back([MessageExt(topic="orders", msg_id="M1", keys="K1", body=b"{}")])
    stranded = eventually(lambda: read("a-previous-owner", 10), timeout=10)  # never acked
    assert [m.keys for m in stranded] == ["K1"]
    owner_reads.set()
    eventually(lambda: got.keys() == ["K1"], timeout=10)
    eventually(lambda: engine.pending() == 0, timeout=10)


def test_ack_index_sends_back_only_the_rest(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    def ack_two(
        messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        if messages[0].reconsume_times == 0:
            context.ack_index = 1  # the first two succeeded
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

    mq = MessageQueue("orders", 0)
    TopicStore(real_redis).put(mq, [new_message("orders", b"{}", keys=f"K{i}") for i in range(4)])
    got = Recorder(ack_two)
    settings = FAST.with_changes(consume_message_batch_max_size=4)
    consumer = start(config, got, consumers, settings=settings)
    eventually(lambda: len(got.seen) == 6)  # 4, then the 2 sent back
    again = sorted((m.keys or "", m.reconsume_times) for m in got.seen if m.reconsume_times)
    assert again == [("K2", 1), ("K3", 1)]
    assert consumer.stats.snapshot()["sent_back"] == 2


def test_broadcasting_drops_a_failed_message(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer], tmp_path: Path
) -> None:
    Producer("p", client=real_redis).send_batch(
        [new_message("orders", b"{}", keys=f"K{i}") for i in range(4)]
    )
    settings = FAST.with_changes(
        message_model=MessageModel.BROADCASTING, offset_store_dir=str(tmp_path / "offsets")
    )
    failing = Recorder(lambda m, c: ConsumeConcurrentlyStatus.RECONSUME_LATER)
    everyone = [failing, Recorder()]
    a = start(config, everyone[0], consumers, settings=settings, name="a")
    start(config, everyone[1], consumers, settings=settings, name="b")
    eventually(lambda: len(everyone[1].seen) == 4 and len(failing.seen) == 4)
    time.sleep(1.5)  # a retry would have come back by now ("1s 1s 1s")
    assert len(failing.seen) == 4  # each instance got every message once: no retry
    assert a.stats.snapshot()["broadcast_dropped"] == 4
    assert a.engine is None  # broadcasting never sends back


def test_flow_control_pauses_pulls_but_everything_arrives(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    Producer("p", client=real_redis).send_batch(
        [new_message("orders", b"x" * 100, keys=f"K{i}") for i in range(400)]
    )
    slow = Recorder(lambda m, c: (time.sleep(0.002), ConsumeConcurrentlyStatus.CONSUME_SUCCESS)[1])
    consumer = start(
        config,
        slow,
        consumers,
        settings=FAST.with_changes(pull_threshold_for_queue=10, pull_batch_size=8),
    )
    eventually(lambda: len(set(slow.keys())) == 400)
    assert consumer.stats.snapshot()["flow_control"] > 0


def test_process_queue_commits_the_smallest_offset_in_flight() -> None:
    pq = ProcessQueue(MessageQueue("t", 0))
    messages = [MessageExt(topic="t", msg_id=f"M{i}", queue_offset=i, body=b"xx") for i in range(5)]
    pq.put_messages(messages)
    assert pq.remove_messages(messages[1:3]) == 0  # message 0 is still in flight
    assert pq.remove_messages(messages[0:1]) == 3
    assert pq.remove_messages(messages[3:]) == 5  # empty: max + 1
    assert pq.msg_size == 0


def test_local_offset_file_falls_back_to_its_backup(tmp_path: Path) -> None:
    mq = MessageQueue("orders", 0)
    store = LocalFileOffsetStore(tmp_path, "client", "group")
    store.update_offset(mq, 5, False)
    store.persist_all([mq])
    store.update_offset(mq, 9, False)
    store.persist_all([mq])  # the 5 is in the backup now
    store.path.write_text("{not json")
    fresh = LocalFileOffsetStore(tmp_path, "client", "group")
    fresh.load()
    assert fresh.read_offset(mq, ReadOffsetType.READ_FROM_MEMORY) == 5


def test_an_offset_beyond_the_broker_is_reset_to_the_brokers(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    producer = Producer("p", client=real_redis)
    producer.send_batch([new_message("orders", b"{}", keys=f"OLD{i}") for i in range(8)])
    got = Recorder()
    consumer = start(config, got, consumers)
    eventually(lambda: sum(consumer_offsets(real_redis, config.group).values()) == 8)
    # the broker loses its queues (rebuilt empty): its offsets restart below the consumer's
    for mq in TopicStore(real_redis).message_queues("orders"):
        real_redis.delete(TopicStore.queue_key(mq))
    producer.send_batch([new_message("orders", b"{}", keys=f"NEW{i}") for i in range(4)])
    eventually(lambda: {f"NEW{i}" for i in range(4)} <= set(got.keys()))
    eventually(lambda: sum(consumer_offsets(real_redis, config.group).values()) == 4)
    assert consumer.stats.snapshot()["consumed_ok"] == 12


def test_entries_with_a_bad_body_or_a_key_that_is_not_unicode_are_dead_lettered(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    """A foreign producer's envelope whose body is not base64, or whose key is a lone
    surrogate (JSON's "\\udcff", which Redis, Arrow and Delta cannot hold): each becomes
    one DLQ row with its reason, and the queue moves on."""
    topics = TopicStore(real_redis)
    mq = MessageQueue("orders", 0)
    key = TopicStore.queue_key(mq)
    topics.put(mq, [new_message("orders", b"{}", keys="K0")])
    real_redis.xadd(key, {"m": '{"topic":"orders","msg_id":"B1","body":"*not base64*"}'}, id="0-*")
    real_redis.xadd(key, {"m": '{"topic":"orders","msg_id":"B2","keys":"K\\udcff"}'}, id="0-*")
    topics.put(mq, [new_message("orders", b"{}", keys="K3")])
    got = Recorder()
    start(config, got, consumers)
    eventually(lambda: consumer_offsets(real_redis, config.group).get(mq) == 4)
    assert got.keys() == ["K0", "K3"]
    letters = DeadLetterTable(config.resolved_dlq_path, config.group).list()
    errors = sorted(letter.last_error or "" for letter in letters)
    assert len(errors) == 2
    assert "body is not base64" in errors[0]
    assert "keys: not valid Unicode text" in errors[1]


def test_garbage_failure_properties_do_not_stop_a_send_back_or_a_dead_letter(
    real_redis: redis.Redis, config: IdemConfig
) -> None:
    engine = RetryEngine(config, client=real_redis)
    garbage = [
        {"IDEM_FIRST_FAILED_AT": "\u00b2"},  # a digit to str.isdigit, not to int()
        {"IDEM_FIRST_FAILED_AT": "99999999999999999"},  # past year 9999
        {"IDEM_ERRORS": '[{"at":100000000000000000,"type":"X","message":"m"}]'},
        {"IDEM_ERRORS": '[{"at":1,"type":"\\udcff","message":"m"}]'},
    ]
    bad = [
        MessageExt("orders", f"G{i}", b"{}", keys=f"K{i}", properties=p)
        for i, p in enumerate(garbage)
    ]
    good = MessageExt("orders", "OK", b"{}", keys="KOK")
    sent = engine.send_back([*bad, good])
    assert sent.acknowledged
    assert engine.pending() == 5
    dead = engine.dead_letter(bad, reason="bad input")
    assert len(dead.dead) == 4
    assert len(engine.dlq.list()) == 4


def test_a_reset_after_redis_lost_its_reset_bookkeeping_still_takes_effect(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    """Redis loses the reset counter and marks (FLUSHALL recovery, an older AOF, a lagging
    replica) while an instance remembers the epoch of an earlier reset: the next reset must
    still be newer than that, or the instance ignores it and writes its old offset back."""
    topics = TopicStore(real_redis)
    mq = MessageQueue("orders", 0)
    topics.put(mq, [new_message("orders", b"{}", keys=f"K{i}") for i in range(5)])
    got = Recorder()
    start(config, got, consumers)
    eventually(lambda: consumer_offsets(real_redis, config.group).get(mq) == 5)
    reset_offsets(real_redis, config.group, {mq: 3})
    eventually(lambda: len(got.keys()) == 7)
    real_redis.delete(reset_epoch_key(config.group), reset_marks_key(config.group))
    reset_offsets(real_redis, config.group, {mq: 0})  # replay everything
    eventually(lambda: len(got.keys()) == 12)
    eventually(lambda: consumer_offsets(real_redis, config.group).get(mq) == 5)


@pytest.mark.parametrize("orderly", [False, True], ids=["concurrently", "orderly"])
def test_a_consume_call_that_raises_ends_in_the_dlq_and_the_queue_goes_on(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer], orderly: bool
) -> None:
    """A layer raises instead of answering (a middleware bug; the dedup hook reading the
    key of a body nested past Python's recursion limit): the messages are retried and
    then dead-lettered with the exception, never dropped (orderly lost the call's
    messages) nor left to the consume timeout (concurrently held the offset that long)."""
    from idem.dedup import Dedup
    from idem.retry.consumer import BatchResult, ConsumeScope, DedupMiddleware
    from idem.retry.consumer.listener import CallNext
    from idem.retry.status import ConsumeOrderlyContext, ConsumeOrderlyStatus

    config = config.with_changes(max_reconsume_times=1)
    mq = MessageQueue("orders", 0)
    deep = b'{"order_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    bodies = {"K0": b'{"order_id": "K0"}', "BOOM": b'{"order_id": "BOOM"}', "DEEP": deep}
    bodies["NOTJSON"] = b"order_id=K2"
    bodies["K3"] = b'{"order_id": "K3"}'
    sent = [new_message("orders", body, keys=key) for key, body in bodies.items()]
    TopicStore(real_redis).put(mq, sent)
    key_of = {m.msg_id: m.keys for m in sent}

    def boom(
        messages: Sequence[MessageExt], scope: ConsumeScope, call_next: CallNext
    ) -> BatchResult:
        if any(m.keys == "BOOM" for m in messages):
            raise RuntimeError("boom")
        return call_next(messages)

    got: list[str] = []

    def concurrently(
        messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        got.extend(m.keys or "" for m in messages)
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

    def in_order(messages: Sequence[MessageExt], context: ConsumeOrderlyContext) -> object:
        got.extend(m.keys or "" for m in messages)
        return ConsumeOrderlyStatus.SUCCESS

    consumer = PushConsumer(config, settings=FAST)
    consumer.subscribe("orders")
    consumer.use(boom)
    consumer.use(DedupMiddleware(Dedup(config), key="body.order_id"))
    if orderly:
        consumer.register_message_listener_orderly(in_order)
    else:
        consumer.register_message_listener_concurrently(concurrently)
    consumers.append(consumer.start())
    eventually(lambda: consumer_offsets(real_redis, config.group).get(mq) == 5, timeout=30)
    letters = {}
    eventually(
        lambda: (
            letters.update(
                {
                    key_of[d.origin_msg_id]: d
                    for d in DeadLetterTable(config.resolved_dlq_path, config.group).list()
                }
            )
            or set(letters) == {"BOOM", "DEEP", "NOTJSON"}
        ),
        timeout=30,
        what="the three poison messages dead-lettered",
    )
    assert sorted(set(got)) == ["K0", "K3"]
    assert "RuntimeError: boom" in (letters["BOOM"].last_error or "")
    assert "body.order_id: cannot read the key: maximum recursion depth" in (
        letters["DEEP"].last_error or ""
    )
    assert "body.order_id: cannot read the key: the body is not JSON" in (
        letters["NOTJSON"].last_error or ""
    )


@pytest.mark.parametrize(
    "case",
    [
        ("ack_index", -5, "ack_index: -5 is outside -1..2147483647"),
        ("ack_index", "0", "ack_index: '0' is not a whole number"),
        ("delay_level_when_next_consume", "2", "delay_level_when_next_consume: '2' is not a"),
    ],
    ids=["ack-negative", "ack-text", "level-text"],
)
def test_a_bad_context_value_from_the_listener_ends_in_the_dlq_naming_it(
    real_redis: redis.Redis,
    config: IdemConfig,
    consumers: list[PushConsumer],
    case: tuple[str, object, str],
) -> None:
    """A bad value set by the listener is named, not a TypeError in the policy (which would
    fail every send-back and re-submit the message locally forever, holding its queue's
    offset back) nor an ``IndexError`` in the DLQ's reason."""
    field, value, why = case

    def mistaken(
        messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        setattr(context, field, value)
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

    mq = MessageQueue("orders", 0)
    TopicStore(real_redis).put(mq, [new_message("orders", b"{}", keys="K0")])
    got = Recorder(mistaken)
    start(config.with_changes(max_reconsume_times=1), got, consumers)
    table = DeadLetterTable(config.resolved_dlq_path, config.group)
    [letter] = eventually(table.list, timeout=20)
    assert letter.key == "K0"
    assert letter.last_error is not None
    assert f"ConfigError: {why}" in letter.last_error
    assert [m.reconsume_times for m in got.seen] == [0, 1]
    eventually(lambda: consumer_offsets(real_redis, config.group).get(mq) == 1)


@pytest.mark.parametrize(
    "chosen",
    [MessageQueue("orders", 7), MessageQueue("elsewhere", 0), None],
    ids=["queue-id-past-the-topic", "another-topic", "none"],
)
def test_a_selector_choosing_a_queue_the_topic_lacks_is_refused(
    real_redis: redis.Redis, config: IdemConfig, chosen: MessageQueue | None
) -> None:
    """The message must not go into a stream no consumer reads with send saying SEND_OK."""
    producer = Producer("p", client=real_redis)
    with pytest.raises(SendFailed) as refused:
        producer.send(
            new_message("orders", b"{}", keys="K0"), selector=lambda mqs, message, arg: chosen
        )
    assert str(refused.value) == (
        f"selector: chose {chosen!r}, not one of the 4 queue(s) of topic 'orders' (queue ids 0..3)"
    )
    topics = TopicStore(real_redis)
    assert [topics.max_offset(mq) for mq in topics.message_queues("orders")] == [0, 0, 0, 0]
    assert list(real_redis.scan_iter("*elsewhere*")) == []


def test_two_messages_carrying_the_same_origin_id_are_both_retried_and_dead_lettered(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    """Forwarded messages may carry a copied ``ORIGIN_MESSAGE_ID``; the second one's retry
    collapsed into the first's, so it was never retried nor dead-lettered: lost."""
    shared = {"ORIGIN_MESSAGE_ID": "FORWARDED-FROM"}
    mq = MessageQueue("orders", 0)
    TopicStore(real_redis).put(
        mq, [new_message("orders", b"{}", keys=k, properties=shared) for k in ("O1", "O2")]
    )
    got = Recorder(lambda messages, context: ConsumeConcurrentlyStatus.RECONSUME_LATER)
    start(config.with_changes(max_reconsume_times=1), got, consumers)
    table = DeadLetterTable(config.resolved_dlq_path, config.group)
    eventually(lambda: len(table.list()) == 2, timeout=20)
    assert sorted(letter.key for letter in table.list()) == ["O1", "O2"]
    assert sorted((m.keys or "", m.reconsume_times) for m in got.seen) == [
        ("O1", 0),
        ("O1", 1),
        ("O2", 0),
        ("O2", 1),
    ]


def test_the_consumers_max_reconsume_times_applies_to_a_concurrent_listener(
    real_redis: redis.Redis, config: IdemConfig, consumers: list[PushConsumer]
) -> None:
    """``ConsumerSettings(max_reconsume_times=0)`` was read only by orderly consumers: a
    concurrent one retried on the group's limit (16 here) instead of dead-lettering."""
    TopicStore(real_redis).put(MessageQueue("orders", 0), [new_message("orders", b"{}", keys="K")])
    got = Recorder(lambda messages, context: ConsumeConcurrentlyStatus.RECONSUME_LATER)
    start(config, got, consumers, settings=FAST.with_changes(max_reconsume_times=0))
    table = DeadLetterTable(config.resolved_dlq_path, config.group)
    [letter] = eventually(table.list, timeout=20)
    assert (letter.key, letter.reconsume_times) == ("K", 0)
    time.sleep(1.5)  # a retry would be due after the 1 s level
    assert [m.reconsume_times for m in got.seen] == [0]


class _StoresDuringTheRead(redis.Redis):
    """A client of the same redis-server that stores a producer's message right after any
    ``XRANGE`` of its own finds the queue empty (the moment of the race)."""

    def __init__(self, url: str, producer: redis.Redis, mq: MessageQueue) -> None:
        pool = redis.ConnectionPool.from_url(url)
        super().__init__(connection_pool=pool)
        self.producer, self.mq = producer, mq

    def xrange(self, name: Any, *args: Any, **kwargs: Any) -> Any:
        entries = super().xrange(name, *args, **kwargs)
        if not entries:
            TopicStore(self.producer).put(self.mq, [new_message("orders", b"{}", keys="RACE")])
        return entries


def test_a_message_stored_while_the_oldest_offset_is_read_is_not_skipped(
    real_redis: redis.Redis, redis_server: RedisServer
) -> None:
    """An empty queue's minimum was read in two steps (no oldest entry, then the next
    offset): a message stored between them got an offset below the answer, and a consumer
    reset to it skipped the message (seen in CI: ``pull offset 2 is outside [1, 1];
    resetting to 1``, and NEW2 never arrived)."""
    mq = MessageQueue("orders", 0)
    topics = TopicStore(real_redis)
    topics.create_topic("orders", 1)
    racing = TopicStore(_StoresDuringTheRead(redis_server.url, real_redis, mq))
    low = racing.min_offset(mq)
    stored = [m.queue_offset for m in topics.read_many({mq: 0}, 10).get(mq, [])]
    assert all(low <= offset for offset in stored), (low, stored)  # a reset to low reads them


def test_the_oldest_offset_of_a_queue_is_read_in_one_snapshot(real_backend: RealRedis) -> None:
    """The bounds of a queue, on a redis-server and on a Cluster (whose transaction replies
    come back raw): never written, written, emptied with its ids kept, lost."""
    topics = TopicStore(real_backend.client)
    topics.create_topic("bounds", 1)
    mq = MessageQueue("bounds", 0)
    assert (topics.min_offset(mq), topics.max_offset(mq)) == (0, 0)  # never written
    topics.put(mq, [new_message("bounds", b"{}", keys=f"K{i}") for i in range(3)])
    assert (topics.min_offset(mq), topics.max_offset(mq)) == (0, 3)
    real_backend.client.xtrim(TopicStore.queue_key(mq), maxlen=0)  # emptied, ids kept
    assert (topics.min_offset(mq), topics.max_offset(mq)) == (3, 3)
    real_backend.client.delete(TopicStore.queue_key(mq))  # the broker lost the queue
    assert (topics.min_offset(mq), topics.max_offset(mq)) == (0, 0)
