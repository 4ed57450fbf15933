"""The resend path on a real redis-server: concurrent schedule services, FLUSHALL + rebuild,
reclaim of stale deliveries, and the ``idem schedule`` / ``idem retry`` commands.

Every test ends with the invariant: each message is in exactly one of done / retrying / dead.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from idem.cli import main as idem_main
from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.errors import ConfigError
from idem.redis_server import RedisServer
from idem.retry import (
    DeadLetterStatus,
    MessageExt,
    RetryEngine,
    RetryTopic,
    RocketMQLadder,
    SendBackStatus,
    audit_states,
    stop_after_elapsed,
)
from idem.retry.errors import JournalError
from idem.retry.journal import SMALL_FILES_TO_COMPACT
from idem.spark.dlq import Selection, replay

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, server: RedisServer, group: str, **kw: object) -> IdemConfig:
    return IdemConfig(group=group, redis_url=server.url, data_dir=str(tmp_path), **kw)  # type: ignore[arg-type]


def _messages(n: int, prefix: str = "M") -> list[MessageExt]:
    return [
        MessageExt(
            topic="TopicTest", msg_id=f"{prefix}{i}", keys=f"ORDER_{prefix}{i}", body=b'{"row": 1}'
        )
        for i in range(n)
    ]


def _cli_args(config: IdemConfig, server: RedisServer, data_dir: Path) -> list[str]:
    """The ``idem`` options naming the test's group, Redis and data directory."""
    return ["--group", config.group, "--redis-url", server.url, "--data-dir", str(data_dir)]


def _assert_invariant(engine: RetryEngine, expected: set[str], done: set[str]) -> None:
    audit = audit_states(engine, expected, done)
    assert audit.ok, audit.describe()


def test_two_schedule_services_on_one_group_deliver_each_message_once(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    config = _config(tmp_path, redis_server, "CID_two", delay_levels="20ms 40ms 60ms 80ms")
    producer = RetryEngine(config)
    services = [
        RetryEngine(config).schedule_service(batch_size=50, name=f"svc-{i}") for i in range(2)
    ]
    consumer = RetryEngine(config)
    seen: Counter[str] = Counter()
    stop = threading.Event()

    def consume() -> None:
        while not stop.is_set() or consumer.pending():
            batch = consumer.poll_retry("consumer-1", 500, block_ms=20)
            seen.update(m.origin_msg_id for m in batch)
            if batch:
                consumer.ack(batch)

    worker = threading.Thread(target=consume)
    for service in services:
        service.start()
    worker.start()
    expected: set[str] = set()
    try:
        for round_ in range(10):
            batch = _messages(100, f"r{round_}-")
            expected |= {m.msg_id for m in batch}
            result = producer.send_back(batch, delay_level=1 + round_ % 4)
            assert len(result.scheduled) == 100
            time.sleep(0.01)
        deadline = time.monotonic() + 20
        while producer.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        worker.join(10)
        for service in services:
            service.stop()
    assert set(seen) == expected
    assert set(seen.values()) == {1}, "a message was delivered twice"
    assert sum(s.moved_total for s in services) == 1000
    assert all(s.moved_total > 0 for s in services), "both services should have worked"
    _assert_invariant(producer, expected, set(seen))


def test_flushall_after_1000_send_backs_then_rebuild(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    config = _config(tmp_path, redis_server, "CID_flush")
    engine = RetryEngine(config, clock=clock)
    expected = set()
    for start in range(0, 1000, 100):
        batch = _messages(100, f"b{start}-")
        expected |= {m.msg_id for m in batch}
        assert engine.send_back(batch, app_id="rebuild-test", txn_version=start).acknowledged
    # 300 come due, are delivered and done before Redis loses everything
    clock.advance(10)
    assert engine.tick() == 1000
    done = engine.poll_retry("c1", 300)
    engine.ack(done)
    assert engine.pending() == 700
    real_redis.flushall()
    # Redis alone would answer 0 and an --available-now run would stop: the engine
    # rebuilds from the journal before it counts
    assert real_redis.dbsize() == 0
    assert engine.pending() == 700
    assert idem_main(["retry", "rebuild", *_cli_args(config, redis_server, tmp_path)]) == 0
    assert engine.pending() == 700
    delivered = list(done)
    engine.tick()
    while batch := engine.poll_retry("c2", 250):
        delivered += batch
        engine.ack(batch)
    counts = Counter(m.origin_msg_id for m in delivered)
    assert set(counts) == expected, "a message was lost"
    assert set(counts.values()) == {1}, "a message was delivered twice"
    _assert_invariant(engine, expected, set(counts))


def test_a_running_service_rebuilds_redis_after_flushall(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    config = _config(tmp_path, redis_server, "CID_lost", delay_levels="300ms")
    engine = RetryEngine(config)
    with engine.schedule_service():
        engine.send_back(_messages(100), delay_level=1)
        real_redis.flushall()  # before anything came due: Redis knows nothing any more
        delivered: list[MessageExt] = []
        deadline = time.monotonic() + 10
        while len(delivered) < 100 and time.monotonic() < deadline:
            batch = engine.poll_retry("c", 200, block_ms=50)
            delivered += batch
            engine.ack(batch)
    counts = Counter(m.origin_msg_id for m in delivered)
    assert set(counts) == {f"M{i}" for i in range(100)}
    assert set(counts.values()) == {1}
    _assert_invariant(engine, set(counts), set(counts))


def test_a_dead_consumers_messages_are_reclaimed(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    engine = RetryEngine(_config(tmp_path, redis_server, "CID_reclaim"), clock=clock)
    engine.send_back(_messages(3), delay_level=1)
    clock.advance(1)
    engine.tick()
    topic = RetryTopic(engine.store, reclaim_idle_ms=100)
    assert len(topic.read("crashed-consumer", 10)) == 3  # and then it dies without acking
    assert topic.read("survivor", 10) == []
    time.sleep(0.15)
    taken_over = topic.read("survivor", 10)
    assert sorted(m.origin_msg_id for m in taken_over) == ["M0", "M1", "M2"]
    assert all(m.topic == "TopicTest" for m in taken_over)
    engine.ack(taken_over)
    _assert_invariant(engine, {"M0", "M1", "M2"}, {"M0", "M1", "M2"})


def _held_twice(
    engine: RetryEngine, clock: ManualClock
) -> tuple[MessageExt, MessageExt, RetryTopic]:
    """M0 sent back and delivered to a slow consumer, then taken over by a survivor: the
    two copies of the one delivery, and the topic they were read from."""
    engine.send_back(_messages(1), delay_level=1)
    clock.advance(1)
    engine.tick()
    topic = RetryTopic(engine.store, reclaim_idle_ms=50)
    (first,) = topic.read("slow-consumer", 10)
    time.sleep(0.1)
    (taken,) = topic.read("survivor", 10)
    assert taken.msg_id == first.msg_id
    return first, taken, topic


def test_two_holders_of_one_delivery_sending_it_back_place_one_retry(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    # one consumer's listener fails the retry; another, which took the delivery over, finds
    # the key busy: one delivery, so one message on the ladder, not two chains
    engine = RetryEngine(_config(tmp_path, redis_server, "CID_two_holders"), clock=clock)
    first, taken, topic = _held_twice(engine, clock)
    failed = engine.send_back([first], delay_level=1).outcomes[0]
    busy = engine.send_back_busy([taken], delay_level=1).outcomes[0]
    assert failed.status is busy.status is SendBackStatus.SCHEDULED
    live = [e for e in engine.store.live_entries() if e.origin_msg_id == "M0"]
    assert [e.msg_id for e in live] == [failed.new_msg_id]
    clock.advance(1)
    engine.tick()
    (again,) = topic.read("survivor", 10)
    assert topic.read("survivor", 10) == []
    engine.ack([again])
    _assert_invariant(engine, {"M0"}, {"M0"})


def _live(engine: RetryEngine, origin: str) -> list[str]:
    """Msg ids of the live retries of ``origin``, as Redis and as the journal hold them."""
    in_redis = sorted(e.msg_id for e in engine.store.live_entries() if e.origin_msg_id == origin)
    in_journal = sorted(m for m, e in engine.journal.live().items() if e.origin_msg_id == origin)
    assert in_redis == in_journal, "Redis and the journal disagree"
    return in_redis


def test_a_delivery_redelivered_after_its_retry_moved_on_starts_no_second_chain(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    # M0 fails, its retry fails too (the chain is at its second copy), then M0 is delivered
    # again (its offset was not persisted) and fails: the chain goes on in one message
    engine = RetryEngine(_config(tmp_path, redis_server, "CID_redelivered"), clock=clock)
    (original,) = _messages(1)
    engine.send_back([original], delay_level=1)
    clock.advance(1)
    engine.tick()
    (first,) = engine.poll_retry("c", 10)
    second = engine.send_back([first], delay_level=1).outcomes[0].new_msg_id
    again = engine.send_back([original], delay_level=1).outcomes[0]
    assert again.status is SendBackStatus.SCHEDULED
    assert _live(engine, "M0") == [second]
    clock.advance(1)
    engine.tick()
    (last,) = engine.poll_retry("c", 10)
    assert last.msg_id == second
    engine.ack([last])
    clock.advance(1)
    engine.tick()
    assert engine.poll_retry("c", 10) == []
    _assert_invariant(engine, {"M0"}, {"M0"})


def test_a_late_copy_sent_back_after_its_chain_ended_places_nothing(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    # two holders of one retry delivery: one fails it, and its resend is consumed; the
    # other, late, finds the key busy and sends its copy back: the chain has ended
    engine = RetryEngine(_config(tmp_path, redis_server, "CID_late_copy"), clock=clock)
    first, late, _topic = _held_twice(engine, clock)
    engine.send_back([first], delay_level=1)
    clock.advance(1)
    engine.tick()
    (resend,) = engine.poll_retry("survivor", 10)
    engine.ack([resend])
    assert engine.send_back_busy([late], delay_level=1).outcomes[0].status is (
        SendBackStatus.SCHEDULED
    )
    assert _live(engine, "M0") == []
    clock.advance(1)
    engine.tick()
    assert engine.poll_retry("survivor", 10) == []
    _assert_invariant(engine, {"M0"}, {"M0"})


def test_a_dead_letter_replayed_twice_is_placed_twice(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    # the first replay's copy fails again (replaced by its resend, which is consumed); the
    # letter, chosen again, is placed again: a replay starts a chain of its own
    engine = RetryEngine(_config(tmp_path, redis_server, "CID_replay_twice"), clock=clock)
    engine.send_back(_messages(1), delay_level=-1)
    replay(engine, Selection(everything=True))
    clock.advance(1)
    engine.tick()
    (copy,) = engine.poll_retry("c", 10)
    engine.send_back([copy], delay_level=1)
    clock.advance(1)
    engine.tick()
    engine.ack(engine.poll_retry("c", 10))
    result = replay(engine, Selection(everything=True, include_replayed=True))
    assert (result.selected, result.sent) == (1, 1)
    assert len(_live(engine, "M0")) == 1
    clock.advance(1)
    engine.tick()
    (again,) = engine.poll_retry("c", 10)
    assert again.origin_msg_id == "M0"
    assert again.msg_id != copy.msg_id


def test_concurrent_send_backs_of_one_process_share_journal_commits(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    # eight consume threads each sending 25 failed messages back one at a time
    engine = RetryEngine(_config(tmp_path, redis_server, "CID_combined"), clock=clock)
    messages = _messages(200)
    errors: list[BaseException] = []
    outcomes: dict[str, SendBackStatus] = {}

    def consume_thread(mine: list[MessageExt]) -> None:
        try:
            for message in mine:
                (outcome,) = engine.send_back([message], delay_level=1).outcomes
                outcomes[outcome.msg_id] = outcome.status
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=consume_thread, args=(messages[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    # every call got its own message's outcome back
    assert outcomes == {m.msg_id: SendBackStatus.SCHEDULED for m in messages}
    commits = engine.journal.latest_version()
    assert commits is not None
    assert commits < 200, f"{commits + 1} commits for 200 send-backs"
    clock.advance(1)
    engine.tick()
    delivered = engine.poll_retry("c", 1000)
    assert sorted(m.origin_msg_id for m in delivered) == sorted(m.msg_id for m in messages)
    engine.ack(delivered)
    _assert_invariant(engine, {m.msg_id for m in messages}, {m.msg_id for m in messages})
    print(f"200 send-backs from 8 threads in {commits + 1} journal commits")


def test_compacting_the_journals_files_keeps_its_events_and_what_a_rebuild_finds(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    # a consumer's send-backs and acknowledgements, one message per call: a file each
    engine = RetryEngine(_config(tmp_path, redis_server, "CID_files"), clock=clock)
    messages = _messages(SMALL_FILES_TO_COMPACT + 20)
    for message in messages:
        engine.send_back([message], delay_level=1)
    clock.advance(1)
    engine.tick()
    for delivered in engine.poll_retry("c", 30):
        engine.ack([delivered])  # 30 done, the rest still retrying
    before = engine.journal.events()
    live = sorted(engine.journal.live())
    assert engine.journal.small_files() >= SMALL_FILES_TO_COMPACT
    replaced = engine.maybe_compact_journal_files()
    assert replaced >= SMALL_FILES_TO_COMPACT
    assert engine.journal.small_files() <= 2
    assert engine.maybe_compact_journal_files() == 0  # nothing left worth it
    assert engine.journal.events() == before
    assert sorted(engine.journal.live()) == live
    real_redis.flushall()  # Redis rebuilt from the compacted journal: the same messages
    engine.sync()
    assert sorted(e.msg_id for e in engine.store.live_entries()) == live
    clock.advance(1)
    engine.tick()
    rest = engine.poll_retry("c", 1000)
    assert len(rest) == len(messages) - 30
    engine.ack(rest)
    _assert_invariant(engine, {m.msg_id for m in messages}, {m.msg_id for m in messages})


@pytest.mark.parametrize(
    ("stop", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["sigterm", "sigint"]
)
def test_idem_schedule_command_runs_until_terminated(
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    stop: signal.Signals,
    code: int,
) -> None:
    """A stop is clean either way; Ctrl-C (SIGINT) is exit 130 as for every idem command
    (the schedule service answered 0)."""
    config = _config(tmp_path, redis_server, f"CID_cli_{code}", delay_levels="100ms 200ms")
    engine = RetryEngine(config)
    command = [
        sys.executable,
        "-m",
        "idem.cli",
        "schedule",
        *_cli_args(config, redis_server, tmp_path),
        "--delay-levels",
        "100ms 200ms",
    ]
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        engine.send_back(_messages(50), delay_level=2)
        delivered: list[MessageExt] = []
        deadline = time.monotonic() + 30
        while len(delivered) < 50 and time.monotonic() < deadline:
            batch = engine.poll_retry("c", 100, block_ms=50)
            delivered += batch
            engine.ack(batch)
    finally:
        process.send_signal(stop)
        _out, err = process.communicate(timeout=20)
    assert process.returncode == code, err
    assert "moved 50 message(s)" in err
    assert sorted(m.origin_msg_id for m in delivered) == sorted(f"M{i}" for i in range(50))
    assert idem_main(["retry", "stats", *_cli_args(config, redis_server, tmp_path)]) == 0
    _assert_invariant(engine, {f"M{i}" for i in range(50)}, {f"M{i}" for i in range(50)})


def test_retry_engine_refuses_an_evicting_redis(tmp_path: Path) -> None:
    from idem.errors import UnsafeRedisConfig
    from idem.redis_server import RedisServer
    from idem.retry import RetryEngine

    with RedisServer(maxmemory_policy="volatile-lru") as server:
        engine = RetryEngine(
            IdemConfig(group="orders", redis_url=server.url, data_dir=str(tmp_path))
        )
        with pytest.raises(UnsafeRedisConfig, match="volatile-lru"):
            engine.check()


def test_a_replayed_dead_letter_that_dies_again_at_once_stays_dead(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    # A policy that gives up after an hour: the replay of an old dead letter dies again
    # on its first send-back. Its row must stay DEAD (listed, replayable once fixed),
    # not be marked REPLAYED.
    clock = ManualClock()
    policy = RocketMQLadder().composed() | stop_after_elapsed(3_600_000)
    engine = RetryEngine(
        _config(tmp_path, redis_server, "redie"), client=real_redis, clock=clock, policy=policy
    )
    engine.send_back(_messages(1))
    clock.advance(2 * 3600)
    engine.tick()
    assert engine.send_back(engine.poll_retry("c", 10)).dead
    clock.advance(60)
    result = replay(engine, Selection(everything=True))
    assert (result.dead_again, result.marked) == (1, 0)
    [row] = engine.dlq.list()
    assert row.status is DeadLetterStatus.DEAD
    assert engine.pending() == 0


def test_a_recreated_journal_is_refused_until_redis_is_rebuilt_from_it(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    # The journal is wiped and starts again at version 0 while Redis's cursor stands at
    # the old journal's later version: applying from that cursor would skip the new
    # journal's events for good, send-backs reported SCHEDULED and never delivered.
    config = _config(tmp_path, redis_server, "moved")
    RetryEngine(config, client=real_redis, clock=ManualClock()).send_back(_messages(3))
    shutil.rmtree(config.resolved_journal_path)
    engine = RetryEngine(config, client=real_redis, clock=ManualClock())
    with pytest.raises(JournalError, match="idem retry rebuild --group moved"):
        engine.send_back(_messages(2, prefix="N"))
    # From then on a send-back is refused before it journals: re-submitted attempts do not
    # pile up in the journal, to be scheduled all at once after the rebuild.
    refused = engine.send_back(_messages(2, prefix="R"))
    assert [o.status for o in refused.outcomes] == [SendBackStatus.RESUBMIT_LATER] * 2
    engine.rebuild()  # what the error asks for: Redis now follows this journal
    again = engine.send_back(_messages(2, prefix="N"))
    assert [o.status for o in again.outcomes] == [SendBackStatus.SCHEDULED] * 2
    assert engine.pending() == 2


def test_one_journal_or_dlq_path_for_two_groups_is_refused(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    orders = _config(tmp_path, redis_server, "orders")
    shared = {
        "journal_path": orders.resolved_journal_path,
        "dlq_path": orders.resolved_dlq_path,
    }
    first = RetryEngine(orders, client=real_redis, clock=ManualClock())
    first.send_back(_messages(1))
    first.dead_letter(_messages(1, prefix="D"), reason="poison")
    payments = _config(tmp_path, redis_server, "payments", **shared)
    other = RetryEngine(payments, client=real_redis, clock=ManualClock())
    with pytest.raises(ConfigError, match=r"journal_path: .* not the retry journal of group"):
        other.send_back(_messages(1, prefix="P"))
    with pytest.raises(ConfigError, match=r"dlq_path: .* is '%DLQ%orders', not '%DLQ%payments'"):
        other.dlq.list()
    assert first.pending() == 1  # orders' retry is untouched


def test_an_error_text_that_is_not_valid_unicode_is_stored_escaped(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    # A sink quoted a JSON value with a lone surrogate in its error: the message must still
    # go on its ladder and, at the end, into the DLQ (it was refused for good before).
    engine = RetryEngine(_config(tmp_path, redis_server, "surrogate"), client=real_redis)
    error = ValueError("order \ud800 not found")
    [message] = _messages(1)
    sent = engine.send_back([message], errors={message.msg_id: error})
    assert [o.status for o in sent.outcomes] == [SendBackStatus.SCHEDULED]
    dead = engine.send_back([message], delay_level=-1, errors={message.msg_id: error})
    assert [o.status for o in dead.outcomes] == [SendBackStatus.DEAD]
    [letter] = engine.dlq.list()
    assert letter.last_error == "ValueError: order \\ud800 not found"
