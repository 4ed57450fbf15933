"""Bad inputs to the resend path fail with an error naming the field and the limit
(fakeredis, injected clock), not with a crash further on or a busy loop."""

from __future__ import annotations

import json
from pathlib import Path

import fakeredis
import pytest

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.errors import ConfigError, SerializationError
from idem.retry import (
    ExponentialRetryPolicy,
    MessageConst,
    MessageExt,
    RetryEngine,
    RetryTopic,
    ScheduleService,
    SendBackStatus,
)
from idem.retry.consumer.topics import UNDECODABLE
from idem.retry.dlq import DeadLetterTable

pytestmark = pytest.mark.unit

INT32_MAX = 2**31 - 1


def _engine(tmp_path: Path, clock: ManualClock, **kw: object) -> RetryEngine:
    config = IdemConfig(group="CID_inputs", data_dir=str(tmp_path))
    return RetryEngine(config, client=fakeredis.FakeRedis(), clock=clock, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["--3", "²", "3x", "", "-", "12345678901"])
def test_a_delay_property_that_is_not_a_level_is_refused_naming_it(raw: str) -> None:
    message = MessageExt(topic="T", msg_id="M", properties={"DELAY": raw})
    with pytest.raises(ValueError, match=r"properties\['DELAY'\]: .* whole number") as info:
        _ = message.delay_level
    assert str(INT32_MAX) in str(info.value)


@pytest.mark.parametrize(("raw", "level"), [("3", 3), ("-1", -1), ("0", 0), (None, 0)])
def test_a_delay_property_that_is_a_level_is_read(raw: str | None, level: int) -> None:
    props = {} if raw is None else {MessageConst.PROPERTY_DELAY_TIME_LEVEL: raw}
    assert MessageExt(topic="T", msg_id="M", properties=props).delay_level == level


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("initial_ms", float("nan")),
        ("multiplier", float("nan")),
        ("max_ms", float("nan")),
        ("initial_ms", float("inf")),
        ("multiplier", float("inf")),
        ("max_ms", float("inf")),
    ],
)
def test_an_exponential_policy_that_is_not_finite_is_refused_naming_it(
    setting: str, value: float
) -> None:
    with pytest.raises(ConfigError, match=f"{setting}: must be a finite number"):
        ExponentialRetryPolicy(**{setting: value})  # type: ignore[arg-type]


def test_a_schedule_service_that_would_never_wait_is_refused(
    tmp_path: Path, clock: ManualClock
) -> None:
    engine = _engine(tmp_path, clock)
    for idle in (0, -5):
        with pytest.raises(ConfigError, match=r"max_idle_ms: must be a whole number >= 1"):
            engine.schedule_service(max_idle_ms=idle)
        with pytest.raises(ConfigError, match=r"max_idle_ms"):
            ScheduleService(engine.store, clock=clock, max_idle_ms=idle)
    assert engine.schedule_service(max_idle_ms=1).max_idle_ms == 1


def test_reconsume_times_over_int32_is_refused_where_the_message_is_built() -> None:
    with pytest.raises(ValueError, match=f"reconsume_times: .* over the limit {INT32_MAX}"):
        MessageExt(topic="T", msg_id="M", reconsume_times=INT32_MAX + 1)
    wire = MessageExt(topic="T", msg_id="M").to_dict()
    wire["reconsume_times"] = INT32_MAX + 1
    with pytest.raises(SerializationError, match="reconsume_times"):
        MessageExt.from_wire(json.dumps(wire))
    assert MessageExt(topic="T", msg_id="M", reconsume_times=INT32_MAX).reconsume_times > 0


def test_a_number_too_large_for_an_integer_is_refused_as_a_bad_envelope() -> None:
    """JSON's 1e400 is infinity: int() of it raised OverflowError, which no caller caught."""
    wire = MessageExt(topic="T", msg_id="M").to_wire()
    wire = wire.replace('"queue_offset":0', '"queue_offset":1e400')
    assert "1e400" in wire
    with pytest.raises(SerializationError, match="message envelope"):
        MessageExt.from_wire(wire)


def test_a_send_back_past_the_int32_limit_is_dead_lettered_naming_it(
    tmp_path: Path, clock: ManualClock
) -> None:
    """A policy that never gives up would resend with reconsume_times + 1, which the journal
    and the DLQ cannot store: the message is dead-lettered instead, with that reason."""
    never = ExponentialRetryPolicy(max_reconsume_times=10 * INT32_MAX)
    engine = _engine(tmp_path, clock, policy=never)
    worn = MessageExt(topic="T", msg_id="M", keys="K", reconsume_times=INT32_MAX)
    result = engine.send_back([worn])
    [outcome] = result.outcomes
    assert outcome.status is SendBackStatus.DEAD
    assert f"reconsume_times: {INT32_MAX} + 1 is over the limit {INT32_MAX}" in outcome.reason
    [letter] = DeadLetterTable(engine.config.resolved_dlq_path, engine.group).list()
    assert (letter.key, letter.reconsume_times) == ("K", INT32_MAX)


def test_retry_topic_entries_that_are_not_messages_are_dead_lettered_once(
    tmp_path: Path, clock: ManualClock
) -> None:
    """A bad queue offset, a field name that is not UTF-8 and a ``REAL_QID`` of "²" (int()
    refuses it): the first two entries are not messages and end as one DLQ row each, the
    third is a message and lands in queue 0; a bare topic (no engine) leaves them alone."""
    engine = _engine(tmp_path, clock)
    stream = engine.store.keys.stream
    good = MessageExt(topic="T", msg_id="G", keys="K", properties={"REAL_QID": "²"}).to_wire()
    bad_offset = engine.client.xadd(stream, {"m": good, "o": "x1"}).decode()
    bad_name = engine.client.xadd(stream, {b"\xff": b"1"}).decode()
    engine.client.xadd(stream, {"m": good, "o": "5"})
    bare = RetryTopic(engine.store, reclaim_idle_ms=1000)
    assert [m.msg_id for m in bare.range("0-0")] == ["G"]
    assert engine.client.xlen(stream) == 3
    [message] = engine.poll_retry("c", 10)
    assert (message.msg_id, message.queue_id, message.queue_offset) == ("G", 0, 5)
    letters = {
        d.msg_id: d for d in DeadLetterTable(engine.config.resolved_dlq_path, engine.group).list()
    }
    name = "%RETRY%CID_inputs"
    offset_letter = letters[f"UNDECODABLE-{name}-{bad_offset}"]
    assert "field 'o' (queue offset): 'x1' is not a whole number" in offset_letter.reason
    assert offset_letter.body == good.encode()
    name_letter = letters[f"UNDECODABLE-{name}-{bad_name}"]
    assert "it has no field 'm', only: \\xff" in name_letter.reason
    assert engine.client.xlen(stream) == 1  # the good one, delivered and not yet acked
    assert engine.poll_retry("c", 10) == []
    assert len(DeadLetterTable(engine.config.resolved_dlq_path, engine.group).list()) == 2


def test_the_undecodable_marker_is_the_consumers() -> None:
    assert MessageConst.PROPERTY_UNDECODABLE == UNDECODABLE


def test_a_retry_topic_entry_nested_past_the_recursion_limit_is_dead_lettered(
    tmp_path: Path, clock: ManualClock
) -> None:
    """As on an ordinary topic queue: JSON nested past the interpreter's limit raised
    RecursionError out of the read, and every poll of the retry topic failed on it."""
    engine = _engine(tmp_path, clock)
    stream = engine.store.keys.stream
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    entry = engine.client.xadd(stream, {"m": deep, "o": "0"}).decode()
    engine.client.xadd(stream, {"m": MessageExt(topic="T", msg_id="G", keys="K").to_wire()})
    [message] = engine.poll_retry("c", 10)
    assert message.msg_id == "G"
    [letter] = DeadLetterTable(engine.config.resolved_dlq_path, engine.group).list()
    assert letter.msg_id == f"UNDECODABLE-%RETRY%CID_inputs-{entry}"
    assert "RecursionError" in letter.reason
