"""A process killed (SIGKILL) between the dead-letter write and the journal append, while
it dead-letters messages it read from ``%RETRY%<group>``: after recovery each message is
dead (one DLQ row) or live on the retry ladder, never both, and never consumed once dead:
after ``idem retry rebuild``, after ``RetryEngine.recover``, when a push consumer of
the group simply starts again, and when ``idem run`` of the group starts.

Real redis-server, real Delta tables; the crash is a real SIGKILL of a child process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from retry_helpers import drain
from waiting import FAST, eventually

from idem.cli import main as cli_main
from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry import MessageExt, RetryEngine, audit_states
from idem.retry.consumer import PushConsumer, TopicStore
from idem.retry.status import ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus

pytestmark = pytest.mark.integration

GROUP = "CID_crash_dlq"
RECLAIM_MS = 1000

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from idem.config import IdemConfig
    from idem.retry import RetryEngine

    url, data_dir, crash_at = sys.argv[1:4]

    def crash(stage, _messages):
        if stage == crash_at:
            os.kill(os.getpid(), signal.SIGKILL)

    config = IdemConfig(group=sys.argv[4], redis_url=url, data_dir=data_dir,
                        consume_timeout_ms=int(sys.argv[6]))
    engine = RetryEngine(config, on_stage=crash)
    retried = engine.poll_retry("child", 100)
    assert len(retried) == int(sys.argv[5]), len(retried)
    # the listener failed every one of them: the last rung dead-letters, the others climb
    engine.send_back(retried, errors={m.msg_id: "listener failed" for m in retried})
    """
)


def _ladder(engine: RetryEngine, clock: ManualClock) -> tuple[set[str], set[str]]:
    """Put 10 messages on their last rung and 10 lower on the ladder, due now in
    ``%RETRY%<group>``; returns (origins that die at their next failure, the others)."""
    last = [
        MessageExt(topic="TopicTest", msg_id=f"L{i}", keys=f"ORDER_L{i}", reconsume_times=15)
        for i in range(10)
    ]
    low = [
        MessageExt(topic="TopicTest", msg_id=f"A{i}", keys=f"ORDER_A{i}", reconsume_times=2)
        for i in range(10)
    ]
    assert engine.send_back(last + low).acknowledged
    clock.advance(3 * 3600)
    assert engine.tick() == 20
    return {m.msg_id for m in last}, {m.msg_id for m in low}


def _crash_child(server: RedisServer, data_dir: Path, crash_at: str) -> None:
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            server.url,
            str(data_dir),
            crash_at,
            GROUP,
            "20",
            str(RECLAIM_MS),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert child.returncode == -9, child.stderr  # killed at the stage, as a crash


def _audit_cli(common: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    """``idem retry audit --json``: its exit code and what it printed."""
    capsys.readouterr()
    code = cli_main(["retry", "audit", "--json", *common])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("recovery", ["rebuild", "restart"])
def test_a_crash_between_the_dlq_write_and_the_journal_leaves_no_message_dead_and_live(
    recovery: str,
    tmp_path: Path,
    redis_server: RedisServer,
    clock: ManualClock,
    capsys: pytest.CaptureFixture[str],
) -> None:
    redis_server.client().flushall()
    data_dir = tmp_path / "data"
    # a read left unacknowledged by the killed process is reclaimed after 1 s (not 15 min)
    config = IdemConfig(
        group=GROUP,
        redis_url=redis_server.url,
        data_dir=str(data_dir),
        consume_timeout_ms=RECLAIM_MS,
    )
    engine = RetryEngine(config, clock=clock)
    dying, climbing = _ladder(engine, clock)
    expected = dying | climbing

    _crash_child(redis_server, data_dir, "dead_lettered")
    assert {d.origin_msg_id for d in engine.dlq.list()} == dying  # the DLQ write landed
    common = ["--group", GROUP, "--redis-url", redis_server.url, "--data-dir", str(data_dir)]
    code, found = _audit_cli(common, capsys)
    assert code == 1  # idem retry audit sees them dead and retrying
    assert set(found["retrying_and_dead"]) == dying

    if recovery == "rebuild":
        assert cli_main(["retry", "rebuild", *common]) == 0
    else:  # a consumer of the group starts again, Redis kept what it had
        engine.close()
        engine = RetryEngine(config, clock=clock)
        engine.recover()

    code, found = _audit_cli(common, capsys)
    assert (code, found["retrying_and_dead"], found["redis_vs_journal"]) == (0, [], [])
    assert found["dead"] == len(dying)
    audit = audit_states(engine, expected, done=set())
    assert not audit.doubled, audit.describe()
    assert audit.ok, audit.describe()
    assert audit.dead == dying
    letters = Counter(d.origin_msg_id for d in engine.dlq.list())
    assert set(letters.values()) == {1}, letters  # one row per dead message

    # the group consumes on (the killed child's reads reclaimed): the dead ones never come
    # back, the others do, once each
    time.sleep(RECLAIM_MS / 1000 + 0.3)
    delivered = drain(engine, clock, after_s=3 * 3600)
    done = Counter(m.origin_msg_id for m in delivered)
    assert not set(done) & dying, f"dead letters consumed again: {sorted(set(done) & dying)}"
    assert set(done) == climbing, done
    assert set(done.values()) == {1}, done
    audit = audit_states(engine, expected, done=set(done))
    assert audit.ok, audit.describe()
    engine.close()


def test_a_push_consumer_started_after_the_crash_never_consumes_a_dead_letter(
    tmp_path: Path, redis_server: RedisServer, clock: ManualClock
) -> None:
    redis_server.client().flushall()
    data_dir = tmp_path / "data"
    config = IdemConfig(
        group=GROUP,
        redis_url=redis_server.url,
        data_dir=str(data_dir),
        consume_timeout_ms=RECLAIM_MS,
    )
    engine = RetryEngine(config, clock=clock)
    dying, climbing = _ladder(engine, clock)
    _crash_child(redis_server, data_dir, "dead_lettered")

    # an instance of the group starts on the same Redis and journal: it reclaims what the
    # killed one had read and not acknowledged
    TopicStore(redis_server.client()).create_topic("TopicTest", 1)
    consumed: list[str] = []

    def listener(
        messages: Sequence[MessageExt], _context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        consumed.extend(m.origin_msg_id for m in messages)
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

    consumer = PushConsumer(config, settings=FAST, client=redis_server.client())
    consumer.subscribe("TopicTest")
    consumer.register_message_listener_concurrently(listener)
    consumer.start()
    try:
        eventually(lambda: climbing <= set(consumed), timeout=60, what="the live retries")
        time.sleep(2 * RECLAIM_MS / 1000)  # a dead letter still pending would be reclaimed
    finally:
        consumer.shutdown()
    assert not set(consumed) & dying, f"dead letters consumed: {sorted(set(consumed) & dying)}"
    assert Counter(consumed) == dict.fromkeys(climbing, 1)
    audit = audit_states(engine, dying | climbing, done=climbing)
    assert audit.ok, audit.describe()
    assert Counter(d.origin_msg_id for d in engine.dlq.list()) == dict.fromkeys(dying, 1)
    engine.close()


@pytest.mark.spark
def test_idem_run_started_after_the_crash_leaves_no_message_dead_and_retrying(
    spark: SparkSession,
    tmp_path: Path,
    redis_server: RedisServer,
    clock: ManualClock,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``idem run`` of the group starts on the same Redis and journal: before its query
    runs, the dead-letterings the killed process cut short are finished."""
    redis_server.client().flushall()
    data_dir = tmp_path / "data"
    config = IdemConfig(group=GROUP, redis_url=redis_server.url, data_dir=str(data_dir))
    engine = RetryEngine(config, clock=clock)
    dying, _climbing = _ladder(engine, clock)
    _crash_child(redis_server, data_dir, "dead_lettered")
    common = ["--group", GROUP, "--redis-url", redis_server.url, "--data-dir", str(data_dir)]
    assert _audit_cli(common, capsys)[0] == 1  # dead and retrying

    source = tmp_path / "in"
    source.mkdir()
    (source / "part-0.json").write_text(json.dumps({"order_id": "ORDER_NEW", "amount": 1}) + "\n")
    run = ["run", "--source", str(source), "--key", "order_id", *common,
           "--sink-delta", str(tmp_path / "sink"), "--available-now", "--timeout", "3"]  # fmt: skip
    assert cli_main(run) == 0

    code, found = _audit_cli(common, capsys)
    assert (code, found["retrying_and_dead"], found["redis_vs_journal"]) == (0, [], [])
    assert found["dead"] == len(dying)
    letters = Counter(d.origin_msg_id for d in engine.dlq.list())
    assert letters == Counter(dict.fromkeys(dying, 1))  # one row per dead message
    engine.close()
