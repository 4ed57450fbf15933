"""The message model: RocketMQ's names, a stable JSON wire form, never pickle."""

from __future__ import annotations

import json
import pickle

import pytest

from idem.errors import SerializationError
from idem.retry import MessageConst, MessageExt, dlq_topic, new_msg_id, retry_topic
from idem.retry.message import FailureRecord, failure_history, first_failed_at, with_failure

pytestmark = pytest.mark.unit


def _message(**changes: object) -> MessageExt:
    base = MessageExt(
        topic="orders",
        msg_id="7F0000010001",
        body=b"\x00\xffbinary body",
        keys="ORDERID_100",
        tags="TagA",
        queue_id=3,
        queue_offset=2101,
        born_timestamp=1_700_000_000_000,
        store_timestamp=1_700_000_000_005,
        reconsume_times=2,
        properties={MessageConst.PROPERTY_ORIGIN_MESSAGE_ID: "ORIGIN-1", "custom": "v"},
    )
    return base.evolve(**changes)


def test_wire_form_round_trips_every_field_and_is_plain_json() -> None:
    message = _message()
    wire = message.to_wire()
    data = json.loads(wire)
    assert data["body"] == "AP9iaW5hcnkgYm9keQ=="  # base64, not pickle
    assert data["properties"]["ORIGIN_MESSAGE_ID"] == "ORIGIN-1"
    assert MessageExt.from_wire(wire) == message
    assert MessageExt.from_wire(wire.encode()) == message


def test_property_names_are_rocketmqs() -> None:
    assert MessageConst.PROPERTY_RETRY_TOPIC == "RETRY_TOPIC"
    assert MessageConst.PROPERTY_REAL_TOPIC == "REAL_TOPIC"
    assert MessageConst.PROPERTY_REAL_QUEUE_ID == "REAL_QID"
    assert MessageConst.PROPERTY_ORIGIN_MESSAGE_ID == "ORIGIN_MESSAGE_ID"
    assert MessageConst.PROPERTY_RECONSUME_TIME == "RECONSUME_TIME"
    assert MessageConst.PROPERTY_MAX_RECONSUME_TIMES == "MAX_RECONSUME_TIMES"
    assert MessageConst.PROPERTY_DELAY_TIME_LEVEL == "DELAY"
    assert retry_topic("CID_JODIE_1") == "%RETRY%CID_JODIE_1"
    assert dlq_topic("CID_JODIE_1") == "%DLQ%CID_JODIE_1"


def test_origin_msg_id_falls_back_to_msg_id() -> None:
    assert _message().origin_msg_id == "ORIGIN-1"
    assert MessageExt(topic="t", msg_id="M1").origin_msg_id == "M1"


def test_message_is_immutable_including_properties() -> None:
    message = _message()
    with pytest.raises(AttributeError):
        message.topic = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        message.properties["x"] = "y"  # type: ignore[index]
    changed = message.with_properties(custom=None, added="1")
    assert "custom" not in changed.properties
    assert changed.properties["added"] == "1"
    assert message.properties["custom"] == "v"


@pytest.mark.parametrize(
    ("wire", "names"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"msg_id": "m", "body": ""}', "'topic' is missing"),
        ('{"topic": "t", "msg_id": "m", "body": "***"}', "not base64"),
        ('{"v": 99, "topic": "t", "msg_id": "m"}', "version 99"),
        ('{"topic": "t", "msg_id": "m", "reconsume_times": "x"}', "message envelope"),
    ],
)
def test_a_bad_envelope_says_what_is_wrong(wire: str, names: str) -> None:
    with pytest.raises(SerializationError, match=names):
        MessageExt.from_wire(wire)


def test_bad_fields_are_refused_with_the_field_name() -> None:
    with pytest.raises(ValueError, match="topic"):
        MessageExt(topic="", msg_id="m")
    with pytest.raises(TypeError, match="body"):
        MessageExt(topic="t", msg_id="m", body="text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reconsume_times"):
        MessageExt(topic="t", msg_id="m", reconsume_times=-1)


def test_a_pickle_is_refused_and_pickling_goes_through_the_json_form() -> None:
    message = _message()
    with pytest.raises(SerializationError):
        MessageExt.from_wire(pickle.dumps({"topic": "t", "msg_id": "m"}))
    # Spark may pickle driver objects: the message then travels as its JSON envelope.
    assert message.to_wire().encode() in pickle.dumps(message)
    assert pickle.loads(pickle.dumps(message)) == message  # noqa: S301 - our own bytes


def test_new_msg_id_is_new_per_resend_and_stable_per_resend() -> None:
    first = new_msg_id("g", "ORIGIN-1")
    assert first == new_msg_id("g", "ORIGIN-1")
    assert len({first, new_msg_id("g", first), new_msg_id("other", "ORIGIN-1")}) == 3
    assert len(first) == 32
    assert first == first.upper()


def test_failure_history_accumulates_and_keeps_the_first_failure_time() -> None:
    message = MessageExt(topic="t", msg_id="m")
    once = with_failure(message, FailureRecord.of(ValueError("bad amount"), 1000))
    twice = with_failure(once, FailureRecord.of("timeout", 2000))
    assert failure_history(twice) == (
        FailureRecord(1000, "ValueError", "bad amount"),
        FailureRecord(2000, "ConsumeFailed", "timeout"),
    )
    assert first_failed_at(twice, 9999) == 1000
    assert first_failed_at(message, 9999) == 9999
    garbage = message.with_properties(IDEM_ERRORS="{not a list")
    assert failure_history(garbage) == ()
