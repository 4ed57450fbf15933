"""The consumer's dedup hook and the busy send-back, on fakeredis with real Delta tables.

Covers: a retried copy is never cut short by an older copy of the same key in one
call; a busy key comes back without counting toward ``max_reconsume_times``; a
group-committed key stays reserved, and its offset held back, until the ledger
commit is durable; a failed group commit gives the messages back.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from pathlib import Path

import fakeredis
import pytest

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.outcome import BatchClaim
from idem.retry import MessageExt, RetryEngine, busy_msg_id, retry_topic
from idem.retry.consumer import (
    BatchResult,
    ConsumeScope,
    DedupMiddleware,
    MessageQueue,
    ProcessQueue,
)
from idem.retry.consumer.group_claim import slice_claim
from idem.retry.store import REPLACED_KEPT_MS

pytestmark = pytest.mark.unit

GROUP = "CID_dedup_hook"


def _config(tmp_path: Path, **extra: object) -> IdemConfig:
    return IdemConfig(group=GROUP, data_dir=str(tmp_path), buckets=4, **extra)  # type: ignore[arg-type]


def _scope(*, retry: bool = False, defer: bool = False) -> ConsumeScope:
    mq = MessageQueue(retry_topic(GROUP), 0) if retry else MessageQueue("orders", 0)
    return ConsumeScope(mq=mq, client_id="c1", orderly=False, defer_acks=defer)


def _failing(messages: Sequence[MessageExt]) -> BatchResult:
    from idem.retry.consumer import Failure

    return BatchResult(
        len(messages), failed=dict.fromkeys(range(len(messages)), Failure("db down"))
    )


def _ok(messages: Sequence[MessageExt]) -> BatchResult:
    return BatchResult(len(messages))


def _deliver(engine: RetryEngine, clock: ManualClock) -> list[MessageExt]:
    clock.advance(3 * 3600)
    engine.tick()
    return engine.poll_retry("c1", 100)


def test_a_retried_copy_wins_over_an_older_copy_so_the_chain_goes_on(
    tmp_path: Path, clock: ManualClock
) -> None:
    server = fakeredis.FakeServer()
    config = _config(tmp_path)
    engine = RetryEngine(config, client=fakeredis.FakeRedis(server=server), clock=clock)
    dedup = Dedup(config, client=fakeredis.FakeRedis(server=server), clock=clock)
    fresh = MessageExt(topic="orders", msg_id="M0", keys="ORDER-1", body=b"{}")
    # M0 fails twice (retry copies at reconsume 1, then 2); M0 is then redelivered, after
    # the resend path forgot the first copy's replacement, and fails again: copies at
    # reconsume 1 and 2 of the same key are live together.
    engine.send_back([fresh])
    engine.send_back(_deliver(engine, clock))
    clock.advance(REPLACED_KEPT_MS / 1000 + 1)
    engine.send_back([fresh])
    copies = sorted(_deliver(engine, clock), key=lambda m: m.reconsume_times)
    assert [m.reconsume_times for m in copies] == [1, 2]
    # the older copy stands first in the queue
    batch = [m.evolve(queue_offset=n) for n, m in enumerate(copies)]

    hook = DedupMiddleware(dedup, owner="c1")
    result = hook(batch, _scope(retry=True), _failing)
    # what the consumer does with the answer: send back the failed, ack the rest
    engine.send_back(
        [batch[i] for i in result.failed],
        errors={batch[i].msg_id: "db down" for i in result.failed},
    )
    engine.ack([batch[i] for i in result.acked])

    assert hook.stats.duplicates["in_batch"] == 1
    live = _deliver(engine, clock)
    assert [(m.keys, m.reconsume_times) for m in live] == [("ORDER-1", 3)]
    assert engine.pending() == 1


def test_a_busy_key_is_sent_back_without_counting(tmp_path: Path, clock: ManualClock) -> None:
    config = _config(tmp_path, max_reconsume_times=2, delay_levels="1s 5s 10s")
    engine = RetryEngine(config, client=fakeredis.FakeRedis(), clock=clock)
    at_limit = MessageExt(
        topic="orders", msg_id="M0", keys="ORDER-1", body=b"{}", reconsume_times=2
    )
    outcome = engine.send_back_busy([at_limit])
    assert [o.status.value for o in outcome.outcomes] == ["SCHEDULED"]
    assert outcome.outcomes[0].delay_level == 1
    assert outcome.outcomes[0].due_ms == clock.now_ms() + 1000
    for _ in range(3):  # busy again and again: never dead-lettered, never counted
        (copy,) = _deliver(engine, clock)
        assert copy.reconsume_times == 2
        assert copy.keys == "ORDER-1"
        engine.send_back_busy([copy])
    assert engine.pending() == 1
    assert engine.dlq.count() == 0
    # a real failure still counts: at the limit it is dead-lettered
    (copy,) = _deliver(engine, clock)
    assert engine.send_back([copy]).outcomes[0].status.value == "DEAD"
    assert engine.pending() == 0


def test_a_repeated_busy_send_back_names_the_same_message(
    clock: ManualClock, tmp_path: Path
) -> None:
    engine = RetryEngine(_config(tmp_path), client=fakeredis.FakeRedis(), clock=clock)
    message = MessageExt(topic="orders", msg_id="M0", keys="ORDER-1", body=b"{}")
    first = engine.send_back_busy([message]).outcomes[0]
    again = engine.send_back_busy([message]).outcomes[0]
    assert first.new_msg_id == again.new_msg_id == busy_msg_id(GROUP, "M0")
    assert engine.pending() == 1


def test_the_hook_sends_busy_keys_back_as_not_counting(
    tmp_path: Path, clock: ManualClock, fake_redis: fakeredis.FakeRedis
) -> None:
    dedup = Dedup(_config(tmp_path), client=fake_redis, clock=clock)
    dedup.begin(["ORDER-1"], owner="someone-else")  # a live claim of another consumer
    hook = DedupMiddleware(dedup, owner="c1")
    message = MessageExt(topic="orders", msg_id="M0", keys="ORDER-1", body=b"{}")
    result = hook([message], _scope(), _ok)
    failure = result.failed[0]
    assert failure.transient
    assert not failure.counts
    assert failure.delay_level == 1
    assert hook.stats.busy == 1


def test_a_group_committed_key_stays_reserved_and_its_offset_held_until_durable(
    tmp_path: Path, clock: ManualClock, fake_redis: fakeredis.FakeRedis
) -> None:
    dedup = Dedup(_config(tmp_path), client=fake_redis, clock=clock)
    hook = DedupMiddleware(dedup, owner="c1", commit_interval_ms=60_000)
    mq = MessageQueue("orders", 0)
    pq = ProcessQueue(mq)
    first = [
        MessageExt(topic="orders", msg_id=f"M{i}", keys=f"ORDER-{i}", body=b"{}", queue_offset=i)
        for i in range(3)
    ]
    pq.put_messages(first)

    result = hook(first, _scope(defer=True), _ok)
    assert sorted(result.pending) == [0, 1, 2]
    assert pq.defer(first) == 3
    assert pq.remove_messages([]) == -1
    assert pq.first_offset() == 0
    assert dedup.ledger.version() < 0  # nothing durable yet

    # the same key again while its commit is pending: busy here, not consumed twice
    again = MessageExt(topic="orders", msg_id="M9", keys="ORDER-1", body=b"{}", queue_offset=9)
    second = hook([again], _scope(defer=True), _ok)
    assert not second.failed[0].counts

    assert hook.flush(5_000)
    deferred = result.pending[0]
    assert deferred.resolved
    assert deferred.wait(0) is None
    assert pq.settle(first) == 3  # the offset may now pass them
    assert sorted(dedup.ledger.window(0, None).keys.column("key").to_pylist()) == [
        "ORDER-0",
        "ORDER-1",
        "ORDER-2",
    ]
    third = hook([again], _scope(defer=True), _ok)
    assert not third.failed
    assert not third.pending
    assert hook.stats.duplicates["completed"] == 1


def test_a_failed_group_commit_gives_the_messages_back(
    tmp_path: Path, clock: ManualClock, fake_redis: fakeredis.FakeRedis
) -> None:
    dedup = Dedup(_config(tmp_path), client=fake_redis, clock=clock)
    hook = DedupMiddleware(dedup, owner="c1", commit_interval_ms=0)
    hook.committer.attempts = 1

    def broken(*_args: object, **_kw: object) -> object:
        raise OSError("disk full")

    dedup.complete = broken  # type: ignore[method-assign]
    message = MessageExt(topic="orders", msg_id="M0", keys="ORDER-1", body=b"{}")
    result = hook([message], _scope(defer=True), _ok)
    failure = result.pending[0].wait(5)
    assert failure is not None
    assert "disk full" in failure.reason
    assert failure.transient
    # the claim was given back: the next delivery is consumed again
    assert dedup.begin(["ORDER-1"], owner="c2").fresh == (0,)


def test_process_queue_holds_the_offset_for_awaiting_messages() -> None:
    pq = ProcessQueue(MessageQueue("orders", 0))
    messages = [MessageExt(topic="orders", msg_id=f"M{i}", queue_offset=i) for i in range(4)]
    pq.put_messages(messages)
    pq.defer(messages[:2])
    assert pq.msg_count == 2
    assert pq.awaiting_count == 2
    assert not pq.contains(messages[0])  # nor consumed or expired again
    assert pq.remove_messages(messages[2:]) == 0  # held at the first awaiting one
    back = pq.restore(messages[1:2])
    assert back == messages[1:2]
    assert pq.msg_count == 1
    assert pq.settle(messages[:1]) == 1
    assert pq.remove_messages(messages[1:2]) == 4


def test_slicing_a_shared_claim_covers_every_field() -> None:
    # a new BatchClaim field must be sliced too (group_claim.slice_claim)
    known = {
        "owner",
        "keys",
        "fingerprints",
        "fresh",
        "duplicates",
        "busy",
        "invalid",
        "mismatched",
        "retaken",
        "ledger_version",
        "reclaimed",
        "stored_fingerprints",
        "buckets",
        "held",
        "claimed_at_ms",
    }
    assert {f.name for f in dataclasses.fields(BatchClaim)} == known
    claim = BatchClaim(
        owner="o",
        keys=("a", "b", "c", "d"),
        fingerprints=("1", "2", "3", "4"),
        fresh=(0, 2, 3),
        duplicates={},
        busy=(1,),
        invalid=(),
        retaken=(3,),
        buckets=(5, -1, 7, 1),
        held=False,
        claimed_at_ms=1234,
    )
    part = slice_claim(claim, 2, 2)
    assert part.held is False
    assert part.claimed_at_ms == 1234
    assert part.keys == ("c", "d")
    assert part.buckets == (7, 1)
    assert part.fresh == (0, 1)
    assert part.retaken == (1,)
    assert part.busy == ()


def test_the_committed_offset_never_passes_an_unfinished_message_whatever_settles_first() -> None:
    """Random consume / defer / settle / restore against a model: the offset to commit is
    always the smallest offset cached or awaiting, or the largest put + 1."""
    rng = random.Random(5)
    pq = ProcessQueue(MessageQueue("orders", 0))
    messages = [MessageExt(topic="orders", msg_id=f"M{i}", queue_offset=i) for i in range(3000)]
    cached: set[int] = set()
    awaiting: set[int] = set()
    put = 0
    for _ in range(4000):
        step = rng.random()
        if step < 0.3 and put < len(messages):
            batch = messages[put : put + rng.randint(1, 40)]
            pq.put_messages(batch)
            cached.update(m.queue_offset for m in batch)
            put += len(batch)
        elif step < 0.55 and cached:
            chosen = rng.sample(sorted(cached), min(len(cached), rng.randint(1, 30)))
            assert pq.defer([messages[o] for o in chosen]) == len(chosen)
            cached.difference_update(chosen)
            awaiting.update(chosen)
        elif step < 0.85 and awaiting:
            chosen = rng.sample(sorted(awaiting), min(len(awaiting), rng.randint(1, 50)))
            pq.settle([messages[o] for o in chosen])
            awaiting.difference_update(chosen)
        elif step < 0.9 and awaiting:  # a failed commit: back to the cache, consumed again
            chosen = rng.sample(sorted(awaiting), 1)
            assert pq.restore([messages[o] for o in chosen]) == [messages[chosen[0]]]
            awaiting.difference_update(chosen)
            cached.update(chosen)
        elif cached:
            chosen = rng.sample(sorted(cached), min(len(cached), rng.randint(1, 20)))
            pq.remove_messages([messages[o] for o in chosen])
            cached.difference_update(chosen)
        live = cached | awaiting
        assert pq.first_offset() == (min(live) if live else None)
        assert pq.awaiting_count == len(awaiting)
    assert put > 1000  # the walk went far
    assert pq.awaiting_count + pq.msg_count == len(cached | awaiting)
