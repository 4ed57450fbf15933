"""The schedule service on fakeredis with an injected clock: when, in what order, how often."""

from __future__ import annotations

from pathlib import Path

import fakeredis
import pytest

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.retry import MessageExt, RetryEngine, ScheduleService

pytestmark = pytest.mark.unit


def _engine(
    tmp_path: Path, clock: ManualClock, client: fakeredis.FakeRedis | None = None, **config: object
) -> RetryEngine:
    cfg = IdemConfig(group="CID_sched", data_dir=str(tmp_path), **config)  # type: ignore[arg-type]
    return RetryEngine(cfg, client=client or fakeredis.FakeRedis(), clock=clock)


def _messages(n: int, prefix: str = "M") -> list[MessageExt]:
    return [MessageExt(topic="T", msg_id=f"{prefix}{i}", keys=f"K{i}") for i in range(n)]


def test_each_level_is_delivered_on_its_own_delay(tmp_path: Path, clock: ManualClock) -> None:
    engine = _engine(tmp_path, clock)
    engine.send_back(_messages(1, "slow"), delay_level=4)  # 30 s
    clock.advance(1)
    engine.send_back(_messages(1, "fast"), delay_level=1)  # 1 s: due before the first one
    assert engine.next_due_ms() == clock.now_ms() + 1000
    clock.advance(1)
    assert engine.tick() == 1
    assert [m.origin_msg_id for m in engine.poll_retry("c", 10)] == ["fast0"]
    clock.advance(27.999)
    assert engine.tick() == 0
    clock.advance(0.001)
    assert engine.tick() == 1
    assert [m.origin_msg_id for m in engine.poll_retry("c", 10)] == ["slow0"]
    assert engine.next_due_ms() is None


def test_a_queue_keeps_fifo_order_and_moves_in_batches(tmp_path: Path, clock: ManualClock) -> None:
    engine = _engine(tmp_path, clock)
    service = engine.schedule_service(batch_size=250)
    for start in range(0, 1200, 300):
        engine.send_back(_messages(300, f"B{start}-"), delay_level=2)
        clock.advance(0.01)
    clock.advance(5)
    assert service.tick() == 1200
    delivered = engine.poll_retry("c", 2000)
    assert len(delivered) == 1200
    offsets = [m.queue_offset for m in delivered]
    assert offsets == sorted(offsets)
    assert [m.origin_msg_id for m in delivered[:2]] == ["B0-0", "B0-1"]
    progress = engine.stats().redis.progress
    assert progress["1:moved"] == "1200"


def test_two_services_on_one_group_move_each_message_once(
    tmp_path: Path, clock: ManualClock
) -> None:
    server = fakeredis.FakeServer()
    engine = _engine(tmp_path, clock, fakeredis.FakeRedis(server=server))
    other = _engine(tmp_path, clock, fakeredis.FakeRedis(server=server))
    first, second = engine.schedule_service(batch_size=7), other.schedule_service(batch_size=5)
    engine.send_back(_messages(100), delay_level=1)
    clock.advance(1)
    moved = 0
    while True:
        step = first.store.move_due(clock.now_ms(), 7).moved
        step += second.store.move_due(clock.now_ms(), 5).moved
        if not step:
            break
        moved += step
    assert moved == 100
    delivered = engine.poll_retry("c", 500)
    assert sorted(m.origin_msg_id for m in delivered) == sorted(f"M{i}" for i in range(100))


def test_a_message_removed_while_scheduled_is_dropped_when_due(
    tmp_path: Path, clock: ManualClock
) -> None:
    engine = _engine(tmp_path, clock)
    (outcome,) = engine.send_back(_messages(1)).outcomes
    scheduled = MessageExt(
        topic="T",
        msg_id=outcome.new_msg_id or "",
        keys="K0",
        properties={"ORIGIN_MESSAGE_ID": "M0"},
    )
    engine.ack([scheduled])  # e.g. the same key completed through another copy
    assert engine.pending() == 0
    clock.advance(60)
    assert engine.tick() == 0
    assert engine.poll_retry("c", 10) == []
    assert engine.next_due_ms() is None


def test_service_reports_the_next_due_time(tmp_path: Path, clock: ManualClock) -> None:
    engine = _engine(tmp_path, clock)
    service = ScheduleService(engine.store, clock=clock)
    engine.send_back(_messages(2), delay_level=3)
    assert service.tick() == 0
    assert service.next_due_ms == clock.now_ms() + 10_000
    clock.advance(10)
    assert service.tick() == 2
    assert service.next_due_ms is None
    assert service.moved_total == 2
