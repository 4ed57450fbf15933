"""Faults on the real thing: redis-server killed and restarted during send-backs, and a
process killed (SIGKILL) between the dead-letter write and the journal, then retried.

Every test ends with the invariant: each message is in exactly one of done / retrying / dead.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from retry_helpers import drain

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry import (
    FaultTolerance,
    MessageExt,
    RetryEngine,
    SendBackStatus,
    audit_states,
)

pytestmark = pytest.mark.integration

FAULTS = FaultTolerance(redis_attempts=2, fallback_attempts=3, wait_initial_s=0.01, wait_max_s=0.05)


@pytest.fixture
def aof_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server with an append-only file, to kill and restart."""
    (tmp_path / "redis").mkdir(exist_ok=True)
    server = RedisServer(appendonly=True, directory=tmp_path / "redis")
    server.start()
    yield server
    server.stop()


def _engine(tmp_path: Path, server: RedisServer, clock: ManualClock, **kw: object) -> RetryEngine:
    config = IdemConfig(group="CID_faults", redis_url=server.url, data_dir=str(tmp_path / "data"))
    return RetryEngine(config, clock=clock, faults=FAULTS, **kw)  # type: ignore[arg-type]


def _messages(n: int, prefix: str = "M") -> list[MessageExt]:
    return [
        MessageExt(topic="TopicTest", msg_id=f"{prefix}{i}", keys=f"ORDER_{prefix}{i}")
        for i in range(n)
    ]


def _assert_delivered_once(delivered: Sequence[MessageExt], expected: set[str]) -> None:
    counts = Counter(m.origin_msg_id for m in delivered)
    assert set(counts) == expected, f"lost: {sorted(expected - set(counts))[:5]}"
    assert set(counts.values()) == {1}, "a message was delivered twice"


def test_redis_down_during_send_back_takes_the_client_side_resend(
    tmp_path: Path, aof_server: RedisServer, clock: ManualClock
) -> None:
    stages: list[str] = []

    def observe(stage: str, _messages: Sequence[MessageExt]) -> None:
        stages.append(stage)
        if stage == "fallback":
            aof_server.start()  # back before the client resends

    engine = _engine(tmp_path, aof_server, clock, on_stage=observe)
    engine.send_back(_messages(10, "before-"))
    aof_server.kill()
    result = engine.send_back(_messages(10))
    assert {o.status for o in result.outcomes} == {SendBackStatus.FALLBACK}
    assert stages[-2:] == ["journaled", "fallback"]
    delivered = drain(engine, clock, after_s=3 * 3600)
    expected = {f"M{i}" for i in range(10)} | {f"before-{i}" for i in range(10)}
    _assert_delivered_once(delivered, expected)
    audit = audit_states(engine, expected, {m.origin_msg_id for m in delivered})
    assert audit.ok, audit.describe()


def test_redis_killed_and_restarted_during_1000_send_backs_loses_nothing(
    tmp_path: Path, aof_server: RedisServer, clock: ManualClock
) -> None:
    engine = _engine(tmp_path, aof_server, clock)
    outcomes: dict[str, SendBackStatus] = {}
    to_resubmit: list[MessageExt] = []
    expected: set[str] = set()

    outage_seen = threading.Event()

    def chaos() -> None:
        time.sleep(0.3)
        aof_server.kill()
        # Stay down until a caller has run into the outage (the client's own bounded
        # retries can outlast a short one on a loaded machine), at most 10 s.
        outage_seen.wait(timeout=10)
        aof_server.start()

    killer = threading.Thread(target=chaos)
    killer.start()
    for round_ in range(50):
        batch = _messages(20, f"r{round_}-")
        expected |= {m.msg_id for m in batch}
        result = engine.send_back(batch)
        outcomes.update((o.msg_id, o.status) for o in result.outcomes)
        if any(o.status is not SendBackStatus.SCHEDULED for o in result.outcomes):
            outage_seen.set()
        to_resubmit += [
            m
            for m, o in zip(batch, result.outcomes, strict=True)
            if o.status is SendBackStatus.RESUBMIT_LATER
        ]
        time.sleep(0.02)
    killer.join()
    statuses = Counter(outcomes.values())
    assert statuses[SendBackStatus.RESUBMIT_LATER] + statuses[SendBackStatus.FALLBACK] > 0, (
        f"the outage was not seen by the caller: {statuses}"
    )
    # the caller re-submits half of what it was told to; the journal covers the rest
    clock.advance(5)
    for message in to_resubmit[::2]:
        assert engine.send_back([message]).acknowledged
    delivered = drain(engine, clock, after_s=3 * 3600)
    _assert_delivered_once(delivered, expected)
    audit = audit_states(engine, expected, {m.origin_msg_id for m in delivered})
    assert audit.ok, audit.describe()


CRASHING_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from idem.config import IdemConfig
    from idem.clock import ManualClock
    from idem.retry import MessageExt, RetryEngine

    url, data_dir, crash_at = sys.argv[1:4]

    def crash(stage, _messages):
        if stage == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)

    engine = RetryEngine(IdemConfig(group="CID_faults", redis_url=url, data_dir=data_dir),
                         clock=ManualClock(), on_stage=crash)
    dead = [MessageExt(topic="TopicTest", msg_id=f"D{i}", keys=f"K{i}", reconsume_times=16)
            for i in range(20)]
    alive = [MessageExt(topic="TopicTest", msg_id=f"A{i}", keys=f"KA{i}") for i in range(20)]
    engine.send_back(dead + alive, app_id="batch-query", txn_version=41)
    """
)


@pytest.mark.parametrize("crash_at", ["dead_lettered", "journaled"])
def test_a_crash_inside_send_back_then_a_retry_leaves_one_row_per_dead_message(
    crash_at: str, tmp_path: Path, aof_server: RedisServer, clock: ManualClock
) -> None:
    data_dir = str(tmp_path / "data")
    child = subprocess.run(
        [sys.executable, "-c", CRASHING_CHILD, aof_server.url, data_dir, crash_at],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == -9, child.stderr  # killed at the stage, as a crash
    engine = _engine(tmp_path, aof_server, clock)
    if crash_at == "dead_lettered":
        assert engine.dlq.count() == 20  # the DLQ write landed, the journal did not
        assert engine.journal.latest_version() is None
    # the batch is replayed after the crash (same messages, same transaction ids)
    dead = [
        MessageExt(topic="TopicTest", msg_id=f"D{i}", keys=f"K{i}", reconsume_times=16)
        for i in range(20)
    ]
    alive = [MessageExt(topic="TopicTest", msg_id=f"A{i}", keys=f"KA{i}") for i in range(20)]
    result = engine.send_back(dead + alive, app_id="batch-query", txn_version=41)
    assert len(result.dead) == 20
    assert len(result.scheduled) == 20
    letters = engine.dlq.list()
    assert sorted(letter.origin_msg_id for letter in letters) == sorted(f"D{i}" for i in range(20))
    assert all(letter.reconsume_times == 16 for letter in letters)
    delivered = drain(engine, clock, after_s=3 * 3600)
    _assert_delivered_once(delivered, {f"A{i}" for i in range(20)})
    expected = {f"D{i}" for i in range(20)} | {f"A{i}" for i in range(20)}
    audit = audit_states(engine, expected, {m.origin_msg_id for m in delivered})
    assert audit.ok, audit.describe()
