"""Where a consumer's offsets start and how far they move: no message is skipped.

On fakeredis; the consumer objects are built but not started (no threads).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import SimpleNamespace

import fakeredis
import pytest

from idem.config import IdemConfig
from idem.retry import MessageExt
from idem.retry.consumer import (
    ConsumerSettings,
    MessageQueue,
    ProcessQueue,
    PushConsumer,
    TopicStore,
)
from idem.retry.consumer.concurrently import ConcurrentlyService
from idem.retry.consumer.offset_store import ReadOffsetType
from idem.retry.consumer.rebalance import RebalanceImpl
from idem.retry.status import MessageModel

pytestmark = pytest.mark.unit


def _consumer(
    tmp_path: Path, client: fakeredis.FakeRedis, group: str = "CID_offsets", **settings: object
) -> PushConsumer:
    return PushConsumer(
        IdemConfig(group=group, data_dir=str(tmp_path)),
        settings=ConsumerSettings(**settings),  # type: ignore[arg-type]
        client=client,
        run_schedule_service=False,
    )


def _messages(mq: MessageQueue, offsets: range, tags: str = "A") -> list[MessageExt]:
    return [
        MessageExt(mq.topic, f"m{o}", b"{}", keys=f"K{o}", tags=tags, queue_offset=o)
        for o in offsets
    ]


def test_a_filtered_out_message_never_moves_the_offset_past_one_awaiting_its_commit(
    tmp_path: Path,
) -> None:
    """Offsets 0-2 were consumed and wait for their group-committed ledger write; offset 3
    does not match the tag filter. The offset must stay at 0 until they are durable."""
    consumer = _consumer(tmp_path, fakeredis.FakeRedis())
    mq = MessageQueue("orders", 0)
    pq = ProcessQueue(mq)
    consumed = _messages(mq, range(3))
    pq.put_messages(consumed)
    pq.defer(consumed)
    consumer._on_filtered(mq, pq, 4)
    assert consumer.offset_store.read_offset(mq, ReadOffsetType.READ_FROM_MEMORY) == 0
    empty = ProcessQueue(MessageQueue("orders", 1))
    consumer._on_filtered(empty.mq, empty, 4)  # nothing in flight: past the filtered ones
    assert consumer.offset_store.read_offset(empty.mq, ReadOffsetType.READ_FROM_MEMORY) == 4


def test_a_queue_new_to_an_existing_group_starts_at_its_first_message(tmp_path: Path) -> None:
    """The topic grows a queue and producers fill it before the rebalance hands it out:
    a group that has offsets consumes those messages; a new group starts at the end."""
    client = fakeredis.FakeRedis()
    topics = TopicStore(client)
    topics.create_topic("orders", 1)
    q0, q1 = MessageQueue("orders", 0), MessageQueue("orders", 1)
    consumer = _consumer(tmp_path, client)  # CONSUME_FROM_LAST_OFFSET, the default
    assert consumer.compute_pull_from_where(q0) == 0
    consumer.offset_store.persist_all([q0])
    topics.create_topic("orders", 2)
    topics.put(q1, _messages(q1, range(5)))
    assert consumer.compute_pull_from_where(q1) == 0
    newcomer = _consumer(tmp_path, client, group="CID_new")
    assert newcomer.compute_pull_from_where(q1) == 5


def test_a_topic_new_to_an_existing_group_follows_consume_from_where(tmp_path: Path) -> None:
    """The group has consumed "orders" for a while and now subscribes to "refunds",
    whose history is long: CONSUME_FROM_LAST_OFFSET starts it at the end, not at 0."""
    client = fakeredis.FakeRedis()
    topics = TopicStore(client)
    topics.create_topic("orders", 1)
    topics.create_topic("refunds", 1)
    orders, refunds = MessageQueue("orders", 0), MessageQueue("refunds", 0)
    topics.put(refunds, _messages(refunds, range(500)))
    consumer = _consumer(tmp_path, client)
    consumer.compute_pull_from_where(orders)
    consumer.offset_store.persist_all([orders])
    assert consumer.compute_pull_from_where(refunds) == 500


def test_a_stored_offset_that_is_not_a_number_is_ignored_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = fakeredis.FakeRedis()
    topics = TopicStore(client)
    topics.create_topic("orders", 1)
    mq = MessageQueue("orders", 0)
    topics.put(mq, _messages(mq, range(3)))
    consumer = _consumer(tmp_path, client)
    client.hset(consumer.offset_store.key, str(mq), "\x00garbage")  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING):
        assert consumer.compute_pull_from_where(mq) == 0  # from the start: nothing skipped
    assert "not a number" in caplog.text


def test_a_broadcasting_consumer_finds_its_offsets_after_a_restart(tmp_path: Path) -> None:
    """Without an instance name the offset file is DEFAULT's (as RocketMQ's), not a random
    name's that the restarted process would never find."""
    settings = {
        "message_model": MessageModel.BROADCASTING,
        "offset_store_dir": str(tmp_path / "offsets"),
    }
    client = fakeredis.FakeRedis()
    mq = MessageQueue("orders", 0)
    first = _consumer(tmp_path, client, **settings)
    first.offset_store.update_offset(mq, 7, False)
    first.offset_store.persist_all([mq])
    restarted = _consumer(tmp_path, client, **settings)
    restarted.offset_store.load()
    assert restarted.compute_pull_from_where(mq) == 7


def test_a_dropped_process_queue_never_replaces_the_watched_one() -> None:
    """A queue reset replaces its process queue; the old one's delayed re-submit must not
    take the new one's place in the consume-timeout watchdog."""
    service = ConcurrentlyService(SimpleNamespace(settings=ConsumerSettings(), client_id="c"))  # type: ignore[arg-type]
    try:
        mq = MessageQueue("orders", 0)
        old, new = ProcessQueue(mq), ProcessQueue(mq)
        old.dropped = True
        service.watch(mq, new)
        service.submit([], old, mq)
        assert service.watched() == [(mq, new)]
        # The re-submit passed its check before the drop and registers after the new one:
        # a watched live process queue is never replaced.
        old.dropped = False
        service.watch(mq, old)
        assert service.watched() == [(mq, new)]
    finally:
        service.executor.shutdown()


def test_an_offset_commit_in_flight_when_a_reset_drops_the_queue_never_lands_after_it(
    tmp_path: Path,
) -> None:
    """A consume thread has checked that its queue is assigned and is writing offset 10
    when a reset moves the queue back to 0: the reset must win."""
    consumer = _consumer(tmp_path, fakeredis.FakeRedis())
    mq = MessageQueue("orders", 0)
    pq = ProcessQueue(mq)
    rebalance = RebalanceImpl(
        client_id="c", model=MessageModel.CLUSTERING, topics=["orders"], hooks=consumer
    )
    rebalance.table[mq] = pq
    consumer.rebalance = rebalance
    store = consumer.offset_store
    writing, go_on = threading.Event(), threading.Event()
    update = store.update_offset

    def slow_first_update(queue: MessageQueue, offset: int, increase_only: bool) -> None:
        if offset == 10:
            writing.set()
            go_on.wait(5)
        update(queue, offset, increase_only)

    store.update_offset = slow_first_update  # type: ignore[method-assign]
    committer = threading.Thread(
        target=consumer.commit_offset, args=(mq, pq), kwargs={"offset": 10, "increase_only": True}
    )
    committer.start()
    assert writing.wait(5)
    threading.Timer(0.3, go_on.set).start()  # the commit finishes while the reset waits
    consumer.reset_offsets({mq: 0})
    committer.join(5)
    assert store.read_offset(mq, ReadOffsetType.READ_FROM_MEMORY) == 0


def test_a_new_groups_start_at_the_last_offset_survives_a_crash_before_the_first_persist(
    tmp_path: Path,
) -> None:
    """CONSUME_FROM_LAST_OFFSET starts a new group at the end of the queue. The instance
    dies before its first timed persist; three messages arrive; the restarted instance
    must start where the first one did, not at the new end (which skips the three)."""
    client = fakeredis.FakeRedis()
    topics = TopicStore(client)
    topics.create_topic("orders", 1)
    mq = MessageQueue("orders", 0)
    topics.put(mq, _messages(mq, range(5)))
    assert _consumer(tmp_path, client).compute_pull_from_where(mq) == 5
    topics.put(mq, _messages(mq, range(5, 8)))
    assert _consumer(tmp_path, client).compute_pull_from_where(mq) == 5


@pytest.mark.parametrize("model", [MessageModel.CLUSTERING, MessageModel.BROADCASTING])
def test_a_new_group_starts_every_queue_of_a_topic_at_its_last_offset(
    tmp_path: Path, model: MessageModel
) -> None:
    """CONSUME_FROM_LAST_OFFSET on a topic with history: no queue replays it. The first
    queue assigned records every queue's start, so the queues started after it (here or
    by another instance) do not take that record for a group already consuming the topic."""
    client = fakeredis.FakeRedis()
    topics = TopicStore(client)
    topics.create_topic("orders", 4)
    queues = topics.message_queues("orders")
    for n, mq in enumerate(queues):
        topics.put(mq, _messages(mq, range(3 + n)))
    first = _consumer(tmp_path, client, message_model=model)
    assert first.compute_pull_from_where(queues[0]) == 3
    assert first.compute_pull_from_where(queues[1]) == 4
    for mq in queues[2:]:  # messages arrive before the other queues are started
        topics.put(mq, _messages(mq, range(3 + mq.queue_id, 10)))
    second = first if model is MessageModel.BROADCASTING else _consumer(tmp_path, client)
    assert second.compute_pull_from_where(queues[2]) == 5
    assert second.compute_pull_from_where(queues[3]) == 6


def test_an_instance_that_read_no_offset_just_before_another_started_the_topic_takes_its_start(
    tmp_path: Path,
) -> None:
    """B reads no offset for queue 1; A then starts the new topic (recording every queue's
    last offset); B must start queue 1 where A recorded, not replay it from the first."""
    client = fakeredis.FakeRedis()
    topics = TopicStore(client)
    topics.create_topic("orders", 2)
    queues = topics.message_queues("orders")
    for mq in queues:
        topics.put(mq, _messages(mq, range(5)))
    a, b = _consumer(tmp_path, client), _consumer(tmp_path, client)
    read = b.offset_store.read_offset

    def read_then_a_starts(mq: MessageQueue, read_type: ReadOffsetType) -> int:
        offset = read(mq, read_type)
        assert a.compute_pull_from_where(queues[0]) == 5
        return offset

    b.offset_store.read_offset = read_then_a_starts  # type: ignore[method-assign]
    assert b.compute_pull_from_where(queues[1]) == 5
