"""The retry journal: Redis is an index over it and can always be rebuilt from it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import fakeredis
import pytest
from deltalake import write_deltalake
from deltalake.transaction import CommitProperties, Transaction

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.retry import (
    JournalEvent,
    JournalEventType,
    JournalPosition,
    MessageExt,
    RetryEngine,
    audit_states,
)
from idem.retry import journal as journal_module
from idem.retry.journal import live_messages, plan
from idem.retry.store import APPLY_CHUNK, Op

pytestmark = pytest.mark.unit

S, A = JournalEventType.SCHEDULED, JournalEventType.ACKED


def _engine(
    tmp_path: Path, clock: ManualClock, client: fakeredis.FakeRedis | None = None
) -> RetryEngine:
    config = IdemConfig(group="CID_journal", data_dir=str(tmp_path))
    return RetryEngine(config, client=client or fakeredis.FakeRedis(), clock=clock)


def _messages(n: int, prefix: str = "M") -> list[MessageExt]:
    return [MessageExt(topic="T", msg_id=f"{prefix}{i}", keys=f"K{i}") for i in range(n)]


def _drain(engine: RetryEngine, clock: ManualClock) -> list[MessageExt]:
    clock.advance(3 * 3600)
    engine.tick()
    delivered = engine.poll_retry("c", 100_000)
    engine.ack(delivered)
    return delivered


def test_plan_does_not_schedule_what_a_later_event_removes() -> None:
    def pos(n: int) -> JournalPosition:
        return JournalPosition(n, 0)

    events = [
        (pos(0), JournalEvent(S, "A", "o1", queue_id="2", due_ms=5, wire="{}")),
        (pos(1), JournalEvent(A, "A", "o1")),
        (pos(2), JournalEvent(S, "A", "o1", queue_id="2", due_ms=9, wire="{}")),
        (pos(3), JournalEvent(S, "B", "o2", queue_id="2", due_ms=5, wire="{}")),
        (pos(4), JournalEvent(S, "C", "o2", queue_id="3", due_ms=7, wire="{}", replaces="B")),
    ]
    kinds = [[(op.kind, op.msg_id, op.replaces) for op in step] for step in plan(events)]
    assert kinds == [[], [("R", "A", "")], [("S", "A", "")], [], [("S", "C", "B")]]
    assert sorted(live_messages(e for _p, e in events)) == ["A", "C"]


def test_flushall_loses_time_not_messages(tmp_path: Path, clock: ManualClock) -> None:
    engine = _engine(tmp_path, clock)
    engine.send_back(_messages(50))
    clock.advance(10)
    engine.tick()
    first = engine.poll_retry("c", 10)
    engine.ack(first)
    assert engine.pending() == 40
    engine.client.flushall()
    # counting finds the cursor gone and replays the journal first: acked ones stay done
    assert engine.pending() == 40
    assert engine.tick() == 40
    delivered = engine.poll_retry("c", 100)
    assert {m.origin_msg_id for m in delivered} == {f"M{i}" for i in range(10, 50)}
    assert engine.pending() == 40
    engine.ack(delivered)
    done = {m.origin_msg_id for m in first + delivered}
    audit = audit_states(engine, {f"M{i}" for i in range(50)}, done)
    assert audit.ok, audit.describe()


def test_a_replayed_batch_is_journaled_once_and_never_resurrected(
    tmp_path: Path, clock: ManualClock
) -> None:
    engine = _engine(tmp_path, clock)
    batch = _messages(5)
    engine.send_back(batch, app_id="query-1", txn_version=7)
    version = engine.journal.latest_version()
    engine.send_back(batch, app_id="query-1", txn_version=7)  # Spark replays batch 7
    assert engine.journal.latest_version() == version
    assert engine.pending() == 5
    delivered = _drain(engine, clock)
    assert len(delivered) == 5
    engine.send_back(batch, app_id="query-1", txn_version=7)  # replayed once more, later
    assert engine.pending() == 0
    assert _drain(engine, clock) == []


def test_a_replay_that_sends_back_more_journals_only_what_the_first_attempt_lacked(
    tmp_path: Path, clock: ManualClock
) -> None:
    """A replayed batch may fail other rows: those are journaled (in a commit of their own),
    the ones the first attempt journaled are not brought back after they were consumed."""
    engine = _engine(tmp_path, clock)
    engine.send_back(_messages(3), app_id="query-1", txn_version=7)  # M0..M2
    assert len(_drain(engine, clock)) == 3  # consumed and acked since
    replay = _messages(5)[1:]  # the replay fails M1..M4
    engine.send_back(replay, app_id="query-1", txn_version=7)
    assert engine.pending() == 2  # M3 and M4, and not M1, M2 again
    engine.client.flushall()  # journaled, not only applied to Redis
    assert {m.origin_msg_id for m in _drain(engine, clock)} == {"M3", "M4"}
    before = engine.journal.latest_version()
    engine.send_back(replay, app_id="query-1", txn_version=7)  # replayed once more
    assert engine.journal.latest_version() == before
    assert engine.pending() == 0


def test_a_replay_of_a_batch_journaled_without_commit_info_reads_the_journal_whole(
    tmp_path: Path, clock: ManualClock
) -> None:
    """Journals written before batches carried their commit info: the replay finds the
    batch's events by the rows' app_id and txn_version instead."""
    engine = _engine(tmp_path, clock)
    engine.send_back(_messages(1, prefix="X"), app_id="other", txn_version=1)
    journal = engine.journal
    first = [engine._event(d, clock.now_ms()) for d in map(engine.processor.process, _messages(2))]
    table = journal._load()
    assert table is not None
    write_deltalake(
        table,
        journal._rows(first, "query-1", 7),
        mode="append",
        commit_properties=CommitProperties(app_transactions=[Transaction("query-1", 7)]),
    )
    engine.sync()
    engine.send_back(_messages(3), app_id="query-1", txn_version=7)
    scheduled = [e.origin_msg_id for e in journal.events() if e.event == S]
    assert sorted(scheduled) == ["M0", "M1", "M2", "X0"]


def test_a_replay_that_dead_letters_more_writes_the_new_letters_once(
    tmp_path: Path, clock: ManualClock
) -> None:
    engine = _engine(tmp_path, clock)
    engine.send_back(_messages(2), delay_level=-1, app_id="query-1", txn_version=3)
    engine.send_back(_messages(3), delay_level=-1, app_id="query-1", txn_version=3)
    letters = sorted(letter.origin_msg_id for letter in engine.dlq.list())
    assert letters == ["M0", "M1", "M2"]
    events = [e for e in engine.journal.events() if e.event == JournalEventType.DEAD]
    assert sorted(e.origin_msg_id for e in events) == ["M0", "M1", "M2"]


def test_a_rebuild_cut_short_finishes_its_base_before_moving_to_a_newer_one(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebuild dies after the first row of base B1; then that row's message is acked
    (journaled; Redis never heard) and a newer base B2 is written without it. The next
    sync must finish B1 and apply the ack that followed it, not lay B2 over B1's first row:
    the acked message would be delivered again."""
    monkeypatch.setattr(journal_module, "APPLY_CHUNK", 1)
    engine = _engine(tmp_path, clock)
    engine.send_back(_messages(3))
    base = engine.compact_journal()
    assert base is not None
    engine.client.flushall()  # Redis lost: the next sync rebuilds from B1
    store = engine.store
    real_apply = store.apply
    applied: list[str] = []

    def dies_after_one(ops: Sequence[Op], *, expect: str | None, new: str) -> object:
        if applied:
            raise RuntimeError("the rebuilding process died")
        applied.append(new)
        return real_apply(ops, expect=expect, new=new)

    monkeypatch.setattr(store, "apply", dies_after_one)
    with pytest.raises(RuntimeError):
        engine.journal.sync(store)
    monkeypatch.setattr(store, "apply", real_apply)
    assert store.pending() == 1
    first = base.live[0]
    engine.journal.append([JournalEvent(A, first.msg_id, first.origin_msg_id, first.key)])
    assert engine.compact_journal() is not None  # B2: the two others
    engine.journal.sync(store)
    assert engine.pending() == 2
    delivered = {m.origin_msg_id for m in _drain(engine, clock)}
    assert delivered == {"M0", "M1", "M2"} - {first.origin_msg_id}


def test_two_engines_share_one_journal_and_one_redis(tmp_path: Path, clock: ManualClock) -> None:
    server = fakeredis.FakeServer()
    one = _engine(tmp_path, clock, fakeredis.FakeRedis(server=server))
    two = _engine(tmp_path, clock, fakeredis.FakeRedis(server=server))
    one.send_back(_messages(3, "a"))
    two.send_back(_messages(3, "b"))
    one.send_back(_messages(3, "c"))
    assert one.pending() == 9
    delivered = _drain(two, clock)
    assert sorted(m.origin_msg_id for m in delivered) == sorted(
        f"{p}{i}" for p in "abc" for i in range(3)
    )
    assert one.pending() == 0
    one.client.flushall()
    one.sync()
    assert one.pending() == 0  # everything was acked: nothing comes back


def test_a_big_commit_is_applied_in_chunks(tmp_path: Path, clock: ManualClock) -> None:
    engine = _engine(tmp_path, clock)
    n = APPLY_CHUNK * 2 + 17
    engine.send_back(_messages(n), delay_level=1)
    assert engine.pending() == n
    engine.client.flushall()
    result = engine.rebuild()
    assert result.scheduled == n
    assert engine.store.cursor() == f"{engine.journal.latest_version() + 1}:0"  # type: ignore[operator]
    assert len(_drain(engine, clock)) == n


def test_rebuild_keeps_the_original_due_times(tmp_path: Path, clock: ManualClock) -> None:
    engine = _engine(tmp_path, clock)
    (outcome,) = engine.send_back(_messages(1), delay_level=5).outcomes  # 1 min
    clock.advance(30)
    engine.client.flushall()
    engine.rebuild()
    assert engine.next_due_ms() == outcome.due_ms
    clock.advance(29.999)
    assert engine.tick() == 0
    clock.advance(0.001)
    assert engine.tick() == 1
