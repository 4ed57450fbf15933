"""RetryEngine's paths when things fail: client-side resend, re-submit after 5 s, Delta down.

Redis outages here are fakeredis's own disconnect switch (the integration tier kills a real
redis-server); Delta outages are a journal path that cannot be a table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import fakeredis
import pytest

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.retry import (
    FaultTolerance,
    JournalError,
    MessageExt,
    RetryEngine,
    SendBackStatus,
    audit_states,
)

pytestmark = pytest.mark.unit

QUICK = FaultTolerance(
    redis_attempts=2, fallback_attempts=2, delta_attempts=2, wait_initial_s=0.001, wait_max_s=0.002
)


def _engine(
    tmp_path: Path, clock: ManualClock, server: fakeredis.FakeServer, **kw: object
) -> RetryEngine:
    config = IdemConfig(group="CID_engine", data_dir=str(tmp_path), **kw.pop("config", {}))  # type: ignore[arg-type]
    return RetryEngine(
        config, client=fakeredis.FakeRedis(server=server), clock=clock, faults=QUICK, **kw
    )  # type: ignore[arg-type]


def _messages(n: int) -> list[MessageExt]:
    return [MessageExt(topic="T", msg_id=f"M{i}", keys=f"K{i}") for i in range(n)]


def _drain(engine: RetryEngine, clock: ManualClock) -> list[MessageExt]:
    clock.advance(3 * 3600)
    engine.tick()
    delivered = engine.poll_retry("c", 1000)
    engine.ack(delivered)
    return delivered


def test_redis_down_for_the_send_back_uses_the_client_side_resend(
    tmp_path: Path, clock: ManualClock
) -> None:
    server = fakeredis.FakeServer()
    stages: list[str] = []

    def observe(stage: str, _messages: Sequence[MessageExt]) -> None:
        stages.append(stage)
        if stage == "fallback":
            server.connected = True  # Redis is back by the time the client resends

    engine = _engine(tmp_path, clock, server, on_stage=observe)
    engine.pending()  # connect and load scripts while Redis is up
    server.connected = False
    result = engine.send_back(_messages(5))
    assert [o.status for o in result.outcomes] == [SendBackStatus.FALLBACK] * 5
    assert result.acknowledged
    assert stages == ["journaled", "fallback"]
    assert engine.pending() == 5
    delivered = _drain(engine, clock)
    assert sorted(m.origin_msg_id for m in delivered) == [f"M{i}" for i in range(5)]
    audit = audit_states(engine, [f"M{i}" for i in range(5)], [m.origin_msg_id for m in delivered])
    assert audit.ok, audit.describe()


def test_every_path_failing_asks_for_a_resubmit_in_5s_and_loses_nothing(
    tmp_path: Path, clock: ManualClock
) -> None:
    server = fakeredis.FakeServer()
    engine = _engine(tmp_path, clock, server)
    engine.pending()
    server.connected = False
    result = engine.send_back(_messages(3))
    assert [o.status for o in result.outcomes] == [SendBackStatus.RESUBMIT_LATER] * 3
    assert not result.acknowledged
    assert {o.resubmit_at_ms for o in result.outcomes} == {clock.now_ms() + 5000}
    server.connected = True
    # whether or not the caller re-submits, the journal already holds the messages
    again = engine.send_back(_messages(3))
    assert [o.status for o in again.outcomes] == [SendBackStatus.SCHEDULED] * 3
    delivered = _drain(engine, clock)
    assert sorted(m.origin_msg_id for m in delivered) == ["M0", "M1", "M2"]


def test_a_caller_that_never_resubmits_loses_nothing(tmp_path: Path, clock: ManualClock) -> None:
    server = fakeredis.FakeServer()
    engine = _engine(tmp_path, clock, server)
    engine.pending()
    server.connected = False
    assert not engine.send_back(_messages(3)).acknowledged
    server.connected = True
    clock.advance(2)  # the next sync (here: the tick's) applies the journal
    delivered = _drain(engine, clock)
    assert sorted(m.origin_msg_id for m in delivered) == ["M0", "M1", "M2"]


def test_dead_letters_survive_a_redis_outage(tmp_path: Path, clock: ManualClock) -> None:
    server = fakeredis.FakeServer()
    engine = _engine(tmp_path, clock, server)
    engine.pending()
    server.connected = False
    result = engine.send_back(_messages(2), delay_level=-1)
    assert [o.status for o in result.outcomes] == [SendBackStatus.DEAD] * 2
    server.connected = True
    assert {letter.origin_msg_id for letter in engine.dlq.list()} == {"M0", "M1"}


def test_delta_down_acknowledges_nothing(tmp_path: Path, clock: ManualClock) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the journal should be")
    server = fakeredis.FakeServer()
    engine = _engine(tmp_path, clock, server, config={"journal_path": str(blocker / "journal")})
    result = engine.send_back(_messages(2))
    assert [o.status for o in result.outcomes] == [SendBackStatus.RESUBMIT_LATER] * 2
    assert engine.pending() == 0  # not journaled, so not scheduled either
    with pytest.raises(JournalError, match="retry journal append"):
        engine.ack(_messages(1))


def test_exponential_policy_is_delivered_by_the_timer_queue(
    tmp_path: Path, clock: ManualClock
) -> None:
    from idem.retry import ExponentialRetryPolicy

    server = fakeredis.FakeServer()
    engine = _engine(tmp_path, clock, server, policy=ExponentialRetryPolicy(initial_ms=2000))
    message = MessageExt(topic="T", msg_id="M", keys="K")
    for delay_s in (2, 4, 8):
        (outcome,) = engine.send_back([message]).outcomes
        assert outcome.due_ms == clock.now_ms() + delay_s * 1000
        clock.advance(delay_s - 0.001)
        assert engine.tick() == 0
        clock.advance(0.001)
        assert engine.tick() == 1
        (message,) = engine.poll_retry("c", 10)
    assert message.reconsume_times == 3


class _TickingClock(ManualClock):
    """A clock that moves a millisecond at every reading, as a real one does under load."""

    def now_ms(self) -> int:
        self.advance(0.001)
        return super().now_ms()


@pytest.mark.parametrize("busy", [False, True], ids=["failed", "busy"])
def test_the_messages_of_one_send_back_fall_due_together(tmp_path: Path, busy: bool) -> None:
    clock = _TickingClock()
    engine = _engine(tmp_path, clock, fakeredis.FakeServer())
    send = engine.send_back_busy if busy else engine.send_back
    assert len(send(_messages(5), delay_level=2).scheduled) == 5
    due = {event.due_ms for event in engine.journal.events()}
    assert len(due) == 1, f"one call, {len(due)} due times: {sorted(due)}"
