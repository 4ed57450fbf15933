"""The resend path when a real redis-server answers with an error instead of going away.

A full Redis (``maxmemory`` reached under the ``noeviction`` policy idem requires)
refuses every write with ``OOM``; a message larger than Redis's
``proto-max-bulk-len`` is refused with a protocol error. Neither may stop the
schedule service, escape ``send_back`` as redis-py's exception, or wedge the
group: scheduled retries are delivered once Redis has room again, and a message
too large to schedule is dead-lettered with its reason.

Each test that delivers ends with the invariant: every message is done, retrying or dead, once.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from retry_helpers import drain

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry import (
    FaultTolerance,
    JournalEventType,
    MessageExt,
    RetryEngine,
    SendBackStatus,
    audit_states,
)

pytestmark = pytest.mark.integration

FAULTS = FaultTolerance(redis_attempts=2, fallback_attempts=2, wait_initial_s=0.01, wait_max_s=0.05)


@contextmanager
def _redis_full(client: redis.Redis) -> Iterator[None]:
    """Redis out of memory (every write refused with OOM) until the block ends."""
    before = client.config_get("maxmemory")["maxmemory"]
    client.config_set("maxmemory", "1")
    try:
        yield
    finally:
        client.config_set("maxmemory", before)


def _config(tmp_path: Path, server: RedisServer, group: str, **kw: object) -> IdemConfig:
    return IdemConfig(group=group, redis_url=server.url, data_dir=str(tmp_path), **kw)  # type: ignore[arg-type]


def _messages(n: int, prefix: str = "M", body: bytes = b'{"row": 1}') -> list[MessageExt]:
    return [
        MessageExt(topic="TopicTest", msg_id=f"{prefix}{i}", keys=f"ORDER_{prefix}{i}", body=body)
        for i in range(n)
    ]


def _consume(engine: RetryEngine, want: int, *, within_s: float) -> list[MessageExt]:
    """Poll and ack the retry topic until ``want`` messages came (or time is up)."""
    delivered: list[MessageExt] = []
    deadline = time.monotonic() + within_s
    while len(delivered) < want and time.monotonic() < deadline:
        batch = engine.poll_retry("consumer-1", 100, block_ms=50)
        delivered += batch
        if batch:
            engine.ack(batch)
    return delivered


def _assert_delivered_once(delivered: Sequence[MessageExt], expected: set[str]) -> None:
    counts = Counter(m.origin_msg_id for m in delivered)
    assert set(counts) == expected, f"lost: {sorted(expected - set(counts))[:5]}"
    assert set(counts.values()) == {1}, "a message was delivered twice"


# -- the schedule service -----------------------------------------------------------------


def test_a_schedule_service_outlives_a_full_redis_and_delivers_once_it_has_room(
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = RetryEngine(_config(tmp_path, redis_server, "CID_oom", delay_levels="300ms"))
    service = engine.schedule_service(max_idle_ms=100)
    expected = {f"M{i}" for i in range(20)}
    with caplog.at_level(logging.WARNING, logger="idem.retry.schedule"), service:
        assert len(engine.send_back(_messages(20), delay_level=1).scheduled) == 20
        with _redis_full(real_redis):
            time.sleep(1.5)  # due after 300 ms: every move meanwhile is refused
            assert real_redis.xlen(engine.store.keys.stream) == 0
            assert "OutOfMemoryError" in caplog.text  # the service did run into it
        delivered = _consume(engine, 20, within_s=15)
        assert service.alive
    _assert_delivered_once(delivered, expected)
    audit = audit_states(engine, expected, expected)
    assert audit.ok, audit.describe()


def test_a_schedule_service_started_on_a_full_redis_rebuilds_once_it_has_room(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    engine = RetryEngine(_config(tmp_path, redis_server, "CID_oom_start", delay_levels="300ms"))
    assert len(engine.send_back(_messages(20), delay_level=1).scheduled) == 20
    real_redis.flushall()  # Redis lost the group: the service's first sync must rebuild it
    service = engine.schedule_service(max_idle_ms=100, sync_interval_ms=200)
    expected = {f"M{i}" for i in range(20)}
    with _redis_full(real_redis):
        service.start()  # its first sync (the rebuild) and every move are refused
        time.sleep(1.0)
    try:
        delivered = _consume(engine, 20, within_s=15)
        assert service.alive
    finally:
        service.stop()
    _assert_delivered_once(delivered, expected)
    audit = audit_states(engine, expected, expected)
    assert audit.ok, audit.describe()


CRASHING_SCHEDULE = textwrap.dedent(
    """
    import sys
    from idem.cli import main
    from idem.retry.schedule import ScheduleService

    def bug(self, now):
        raise RuntimeError("a bug in the moving loop")

    ScheduleService._move = bug  # not Redis's nor idem's error: the thread ends
    sys.exit(main(sys.argv[1:]))
    """
)


def test_idem_schedule_exits_non_zero_when_its_service_stops(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    command = [
        sys.executable,
        "-c",
        CRASHING_SCHEDULE,
        "schedule",
        "--group",
        "CID_cli_dies",
        "--redis-url",
        redis_server.url,
        "--data-dir",
        str(tmp_path),
    ]
    child = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,  # without the check, the process would run on, moving nothing
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert child.returncode == 1, child.stderr
    assert (
        "the schedule service of group CID_cli_dies stopped: "
        "RuntimeError: a bug in the moving loop; exiting"
    ) in child.stderr


# -- send-back ----------------------------------------------------------------------------


def test_send_back_into_a_full_redis_asks_for_a_resubmit_and_loses_nothing(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    engine = RetryEngine(
        _config(tmp_path, redis_server, "CID_oom_send"), clock=clock, faults=FAULTS
    )
    dead = MessageExt(topic="TopicTest", msg_id="D0", keys="ORDER_D0", reconsume_times=16)
    with _redis_full(real_redis):
        result = engine.send_back([*_messages(10), dead])
    assert [o.status for o in result.outcomes] == [SendBackStatus.RESUBMIT_LATER] * 10 + [
        SendBackStatus.DEAD
    ]
    assert not result.acknowledged
    assert [letter.origin_msg_id for letter in engine.dlq.list()] == ["D0"]
    # the caller never re-submits: the journal has the messages, the next sync applies them
    delivered = drain(engine, clock, after_s=3 * 3600)
    expected = {f"M{i}" for i in range(10)}
    _assert_delivered_once(delivered, expected)
    audit = audit_states(engine, expected | {"D0"}, expected)
    assert audit.ok, audit.describe()


@pytest.mark.parametrize("path", ["failed", "busy"])
def test_a_message_over_max_message_bytes_is_dead_lettered_with_its_size(
    path: str,
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    clock: ManualClock,
) -> None:
    engine = RetryEngine(_config(tmp_path, redis_server, "CID_big"), clock=clock)
    size = 4 * 1024 * 1024 + 1  # RocketMQ's maxMessageSize (the default limit), plus one byte
    big = MessageExt(topic="TopicTest", msg_id="BIG", keys="ORDER_BIG", body=b"x" * size)
    batch = [*_messages(2, "A"), big, *_messages(2, "B")]
    send = engine.send_back if path == "failed" else engine.send_back_busy
    result = send(batch)
    assert [o.status for o in result.outcomes] == [SendBackStatus.SCHEDULED] * 2 + [
        SendBackStatus.DEAD
    ] + [SendBackStatus.SCHEDULED] * 2
    reason = "body: 4194305 bytes is over max_message_bytes (4194304 bytes)"
    assert result.outcomes[2].reason == reason
    (letter,) = engine.dlq.list()
    assert (letter.origin_msg_id, letter.reason, letter.body) == ("BIG", reason, big.body)
    # `idem dlq show` prints an error for it either way (a busy key failed no consume)
    assert letter.last_error is not None
    assert (reason in letter.last_error) == (path == "busy")
    journaled = {e.origin_msg_id for e in engine.journal.events() if e.wire is not None}
    assert "BIG" not in journaled  # nothing for Redis to refuse
    delivered = drain(engine, clock, after_s=3 * 3600)
    expected = {"A0", "A1", "B0", "B1"}
    _assert_delivered_once(delivered, expected)
    audit = audit_states(engine, expected | {"BIG"}, expected)
    assert audit.ok, audit.describe()


def test_a_limit_below_redis_proto_max_bulk_len_keeps_the_group_moving(
    tmp_path: Path, clock: ManualClock
) -> None:
    with RedisServer(extra={"proto-max-bulk-len": "1mb"}) as server:
        environ = {
            "IDEM_GROUP": "CID_bulk",
            "IDEM_REDIS_URL": server.url,
            "IDEM_DATA_DIR": str(tmp_path),
            "IDEM_MAX_MESSAGE_BYTES": str(512 * 1024),  # 4/3 of it stays under 1mb
        }
        engine = RetryEngine(IdemConfig.from_env(environ), clock=clock, faults=FAULTS)
        # its wire (the body in base64) would be ~1.2 MB: over what this Redis takes
        big = MessageExt(topic="TopicTest", msg_id="BIG", keys="ORDER_BIG", body=b"x" * 900_000)
        first = engine.send_back([*_messages(2, "A"), big])
        assert [o.status for o in first.outcomes] == [
            SendBackStatus.SCHEDULED,
            SendBackStatus.SCHEDULED,
            SendBackStatus.DEAD,
        ]
        assert first.outcomes[2].reason == (
            "body: 900000 bytes is over max_message_bytes (524288 bytes)"
        )
        clock.advance(20)
        assert engine.tick() == 2
        taken = engine.poll_retry("c", 10)
        assert engine.ack(taken) == 2
        later = engine.send_back(_messages(2, "C"))
        assert [o.status for o in later.outcomes] == [SendBackStatus.SCHEDULED] * 2
        delivered = [*taken, *drain(engine, clock, after_s=3 * 3600)]
        expected = {"A0", "A1", "C0", "C1"}
        _assert_delivered_once(delivered, expected)
        assert engine.store.cursor() == f"{engine.journal.latest_version() + 1}:0"  # type: ignore[operator]
        assert [letter.reason for letter in engine.dlq.list()] == [first.outcomes[2].reason]
        audit = audit_states(engine, expected | {"BIG"}, expected)
        assert audit.ok, audit.describe()
        engine.close()


def test_a_message_whose_properties_make_it_too_large_is_dead_lettered(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    engine = RetryEngine(
        _config(tmp_path, redis_server, "CID_big_props", max_message_bytes=64 * 1024),
        clock=clock,
    )
    # a small body, but properties that make the message larger than the limit
    heavy = MessageExt(
        topic="TopicTest", msg_id="HEAVY", keys="ORDER_HEAVY", properties={"note": "y" * 70_000}
    )
    (outcome,) = engine.send_back([heavy]).outcomes
    assert outcome.status is SendBackStatus.DEAD
    assert outcome.reason.startswith("message: ")
    assert "is over max_message_bytes (65536 bytes)" in outcome.reason
    events = [(e.event, e.origin_msg_id) for e in engine.journal.events()]
    assert events == [(JournalEventType.DEAD, "HEAVY")]
    assert [letter.origin_msg_id for letter in engine.dlq.list()] == ["HEAVY"]
    assert engine.pending() == 0
