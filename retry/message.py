"""The message model: RocketMQ's ``MessageExt``, its property names and its wire form.

A message crosses Redis and Delta as a JSON envelope with the body in base64
(never pickle). Property names keep RocketMQ's spelling (``RETRY_TOPIC``,
``REAL_TOPIC``, ``ORIGIN_MESSAGE_ID``, ...) so a RocketMQ user reads them as is.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final

from idem.errors import SerializationError

WIRE_VERSION: Final = 1
"""Version of the JSON envelope written by :meth:`MessageExt.to_wire`."""

SCHEDULE_TOPIC: Final = "SCHEDULE_TOPIC_XXXX"
"""The topic a send-back waits in until its delay level is due (one queue per level)."""

TIMER_TOPIC: Final = "rmq_sys_wheel_timer"
"""RocketMQ 5's timer topic: where a message with a custom delay (not a level) waits."""

TIMER_QUEUE: Final = "timer"
"""Schedule queue id of custom delays (exponential policy); levels use ``level - 1``."""

INT32_MAX: Final = 2**31 - 1
"""The largest ``reconsume_times`` a message may carry, and the bound of its ``DELAY``
level: the retry journal and ``%DLQ%<group>`` store them as Arrow ``int32`` (a Java
``int`` in RocketMQ)."""


class MessageConst:
    """RocketMQ's property names (``org.apache.rocketmq.common.message.MessageConst``)."""

    PROPERTY_KEYS: Final = "KEYS"
    PROPERTY_TAGS: Final = "TAGS"
    PROPERTY_RETRY_TOPIC: Final = "RETRY_TOPIC"
    PROPERTY_REAL_TOPIC: Final = "REAL_TOPIC"
    PROPERTY_REAL_QUEUE_ID: Final = "REAL_QID"
    PROPERTY_ORIGIN_MESSAGE_ID: Final = "ORIGIN_MESSAGE_ID"
    PROPERTY_RECONSUME_TIME: Final = "RECONSUME_TIME"
    PROPERTY_MAX_RECONSUME_TIMES: Final = "MAX_RECONSUME_TIMES"
    PROPERTY_DELAY_TIME_LEVEL: Final = "DELAY"
    PROPERTY_TIMER_DELIVER_MS: Final = "TIMER_DELIVER_MS"
    # idem's own additions, prefixed so they never collide with RocketMQ's.
    PROPERTY_FIRST_FAILED_AT: Final = "IDEM_FIRST_FAILED_AT"
    PROPERTY_ERRORS: Final = "IDEM_ERRORS"
    PROPERTY_REPLAYED_BY: Final = "IDEM_REPLAYED_BY"
    """On a message replayed from ``%DLQ%<group>``: ``user@host`` that replayed it."""
    PROPERTY_REPLAYED_AT: Final = "IDEM_REPLAYED_AT"
    """On a message replayed from ``%DLQ%<group>``: when (epoch ms)."""
    PROPERTY_UNDECODABLE: Final = "IDEM_UNDECODABLE"
    """On a placeholder for a stored entry that is not a message: why (the same marker as
    :data:`idem.retry.consumer.topics.UNDECODABLE`)."""


def retry_topic(group: str) -> str:
    """``%RETRY%<group>``: the group's retry topic (``MixAll.getRetryTopic``)."""
    return f"%RETRY%{group}"


def dlq_topic(group: str) -> str:
    """``%DLQ%<group>``: the group's dead-letter topic (``MixAll.getDLQTopic``)."""
    return f"%DLQ%{group}"


def new_msg_id(group: str, failed_msg_id: str) -> str:
    """The msg id of the resend of the delivery ``failed_msg_id`` in ``group``.

    A new id on every resend, as the broker gives; derived rather than random so
    that a send-back repeated after an unknown outcome (timeout, crash) names the
    same message and is stored once. Derived from the failed delivery's own id, not
    its ``ORIGIN_MESSAGE_ID``: that is a property a producer may have copied onto
    different messages (forwarding a consumed one), and their resends must not merge.

    One id per failed delivery, whatever the reason it is sent back (a failed consume,
    a busy key, the consume timeout): two consumers that each hold a copy of one
    delivery (a local re-submit during a Redis outage, and the retry topic's copy
    taken over meanwhile) and each send it back place one message, not two chains.
    """
    digest = hashlib.blake2b(f"{group}\x00resend\x00{failed_msg_id}".encode(), digest_size=16)
    return digest.hexdigest().upper()


busy_msg_id = new_msg_id
"""The msg id of a delivery sent back because its key was busy: :func:`new_msg_id`."""


def _frozen(properties: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(properties))


def _check_text(field: str, value: str | None) -> None:
    """Refuse text that cannot be stored as UTF-8 (a lone surrogate, e.g. JSON's "\udcff"):
    Redis, Arrow and Delta could not hold the message, nor its dead letter."""
    if value is None or value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{field}: not valid Unicode text ({exc.reason} at character {exc.start})"
        ) from None


@dataclass(frozen=True, slots=True)
class MessageExt:
    """A message as the consumer sees it (RocketMQ's ``MessageExt``).

    ``keys`` is the business key (``Message.setKeys("ORDERID_100")``): the
    identity the dedup layer uses. ``msg_id`` changes on every resend;
    :attr:`origin_msg_id` does not.
    """

    topic: str
    msg_id: str
    body: bytes = b""
    keys: str | None = None
    tags: str | None = None
    queue_id: int = 0
    queue_offset: int = 0
    born_timestamp: int = 0
    store_timestamp: int = 0
    reconsume_times: int = 0
    properties: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.topic, str) or not self.topic:
            raise ValueError(f"topic: must be a non-empty string, got {self.topic!r}")
        if not isinstance(self.msg_id, str) or not self.msg_id:
            raise ValueError(f"msg_id: must be a non-empty string, got {self.msg_id!r}")
        if not isinstance(self.body, bytes):
            raise TypeError(f"body: must be bytes, got {type(self.body).__name__}")
        for name, text in (("keys", self.keys), ("tags", self.tags)):
            # a foreign producer's JSON may carry a number ("keys": 100): refused as bad
            # input (from_dict's SerializationError), not an AttributeError further on
            if text is not None and not isinstance(text, str):
                raise TypeError(f"{name}: must be a string or None, got {type(text).__name__}")
        if self.reconsume_times < 0:
            raise ValueError(f"reconsume_times: must be >= 0, got {self.reconsume_times}")
        if self.reconsume_times > INT32_MAX:
            # refused here, naming the limit, rather than as pyarrow's overflow when the
            # message is journaled or dead-lettered
            raise ValueError(
                f"reconsume_times: {self.reconsume_times} is over the limit {INT32_MAX}"
            )
        bad = [
            k
            for k, v in self.properties.items()
            if not isinstance(k, str) or not isinstance(v, str)
        ]
        if bad:
            raise TypeError(f"properties: keys and values must be strings (bad: {bad[:3]!r})")
        _check_text("topic", self.topic)
        _check_text("msg_id", self.msg_id)
        _check_text("keys", self.keys)
        _check_text("tags", self.tags)
        for name, value in self.properties.items():
            _check_text(f"properties[{name!r}]", name)
            _check_text(f"properties[{name!r}]", value)
        object.__setattr__(self, "properties", _frozen(self.properties))

    @property
    def origin_msg_id(self) -> str:
        """The id of the first delivery of this message (``ORIGIN_MESSAGE_ID`` or ``msg_id``)."""
        return self.properties.get(MessageConst.PROPERTY_ORIGIN_MESSAGE_ID) or self.msg_id

    @property
    def retry_topic_origin(self) -> str:
        """The topic the message was first published to (``RETRY_TOPIC`` or ``topic``)."""
        return self.properties.get(MessageConst.PROPERTY_RETRY_TOPIC) or self.topic

    @property
    def delay_level(self) -> int:
        """The ``DELAY`` property (0 when not scheduled by level).

        A value that is not a whole number of ASCII digits (an optional ``-`` first)
        within ``int32`` raises :class:`ValueError` naming the property and the limit.
        """
        raw = self.properties.get(MessageConst.PROPERTY_DELAY_TIME_LEVEL, "0")
        digits = raw.removeprefix("-")
        # isdigit() alone takes "²" and other digits int() refuses
        if digits.isascii() and digits.isdigit() and len(digits) <= len(str(INT32_MAX)):
            level = int(raw)
            if -INT32_MAX - 1 <= level <= INT32_MAX:
                return level
        raise ValueError(
            f"properties[{MessageConst.PROPERTY_DELAY_TIME_LEVEL!r}]: {raw!r} is not a delay "
            f"level (a whole number in ASCII digits, from {-INT32_MAX - 1} to {INT32_MAX})"
        )

    def with_properties(self, **changes: str | None) -> MessageExt:
        """A copy with properties set (a ``None`` value removes the property)."""
        props = dict(self.properties)
        for name, value in changes.items():
            if value is None:
                props.pop(name, None)
            else:
                props[name] = value
        return replace(self, properties=props)

    def evolve(self, **changes: Any) -> MessageExt:
        """A copy with fields changed (``dataclasses.replace``)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready envelope (body base64)."""
        return {
            "v": WIRE_VERSION,
            "topic": self.topic,
            "queue_id": self.queue_id,
            "queue_offset": self.queue_offset,
            "msg_id": self.msg_id,
            "keys": self.keys,
            "tags": self.tags,
            "body": base64.b64encode(self.body).decode("ascii"),
            "born_timestamp": self.born_timestamp,
            "store_timestamp": self.store_timestamp,
            "reconsume_times": self.reconsume_times,
            "properties": dict(self.properties),
        }

    def to_wire(self) -> str:
        """The stable wire form: a compact JSON envelope with the body in base64."""
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MessageExt:
        """Inverse of :meth:`to_dict`; a malformed envelope raises :class:`SerializationError`."""
        version = data.get("v", WIRE_VERSION)
        if version != WIRE_VERSION:
            raise SerializationError(f"message envelope: version {version!r} is not supported")
        try:
            body = base64.b64decode(data.get("body") or "", validate=True)
        except (binascii.Error, TypeError, ValueError) as exc:
            raise SerializationError(f"message envelope: body is not base64 ({exc})") from None
        try:
            return cls(
                topic=data["topic"],
                msg_id=data["msg_id"],
                body=body,
                keys=data.get("keys"),
                tags=data.get("tags"),
                queue_id=int(data.get("queue_id", 0)),
                queue_offset=int(data.get("queue_offset", 0)),
                born_timestamp=int(data.get("born_timestamp", 0)),
                store_timestamp=int(data.get("store_timestamp", 0)),
                reconsume_times=int(data.get("reconsume_times", 0)),
                properties=dict(data.get("properties") or {}),
            )
        except KeyError as exc:
            missing = exc.args[0]
            raise SerializationError(f"message envelope: field {missing!r} is missing") from None
        except (TypeError, ValueError, OverflowError) as exc:
            # OverflowError: JSON's 1e400 is a float infinity, which int() refuses so
            raise SerializationError(f"message envelope: {exc}") from None

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # Spark may pickle driver objects; the message itself still travels as its JSON form.
        return (MessageExt.from_wire, (self.to_wire(),))

    @classmethod
    def from_wire(cls, wire: str | bytes) -> MessageExt:
        """Parse the JSON envelope written by :meth:`to_wire`."""
        try:
            data = json.loads(wire)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SerializationError(f"message envelope: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise SerializationError("message envelope: expected a JSON object")
        return cls.from_dict(data)


MAX_ERROR_HISTORY: Final = 32
"""How many failures a message carries in ``IDEM_ERRORS`` (oldest dropped first)."""

MAX_ERROR_MESSAGE_CHARS: Final = 2000
"""Longest error text kept per failure."""


@dataclass(frozen=True, slots=True)
class FailureRecord:
    """One failed consume: when, what kind, what it said (a DLQ row's ``errors`` entry)."""

    at_ms: int
    type: str
    message: str

    @classmethod
    def of(cls, error: str | BaseException | None, at_ms: int) -> FailureRecord:
        """From an exception (its class name and text) or a plain reason string."""
        if isinstance(error, BaseException):
            return cls(at_ms, type(error).__name__, _storable(str(error)))
        text = "RECONSUME_LATER" if error is None else str(error)
        return cls(at_ms, "ConsumeFailed", _storable(text))


def _storable(text: str) -> str:
    """Error text as it can be stored (cut to :data:`MAX_ERROR_MESSAGE_CHARS`; a lone
    surrogate, e.g. from a JSON value the sink quoted, written as ``\\ud800``)."""
    text = text[:MAX_ERROR_MESSAGE_CHARS]
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


MAX_TIMESTAMP_MS: Final = 253_402_300_799_999
"""The last millisecond of year 9999: later "times" are garbage, not dates."""


def failure_history(message: MessageExt) -> tuple[FailureRecord, ...]:
    """The failures recorded on ``message`` (``IDEM_ERRORS``), oldest first."""
    raw = message.properties.get(MessageConst.PROPERTY_ERRORS)
    if not raw:
        return ()
    try:
        records = []
        for item in json.loads(raw):
            at, kind, text = int(item["at"]), str(item["type"]), str(item["message"])
            if not 0 <= at <= MAX_TIMESTAMP_MS:
                raise ValueError(f"at: {at} is not a time")
            kind.encode("utf-8")  # a lone surrogate from a JSON escape raises here
            text.encode("utf-8")
            records.append(FailureRecord(at, kind, text))
        return tuple(records)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return ()  # a foreign producer's garbage must not stop a send-back


def first_failed_at(message: MessageExt, default_ms: int) -> int:
    """When the message first failed (``IDEM_FIRST_FAILED_AT``), else ``default_ms`` (also
    for a value that is not a plausible time: a foreign producer's garbage)."""
    raw = message.properties.get(MessageConst.PROPERTY_FIRST_FAILED_AT, "")
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_TIMESTAMP_MS:
        return default_ms
    return int(raw)


def failure_properties(message: MessageExt, failure: FailureRecord) -> dict[str, str]:
    """The ``IDEM_ERRORS`` / ``IDEM_FIRST_FAILED_AT`` values after ``failure``."""
    history = [*failure_history(message), failure][-MAX_ERROR_HISTORY:]
    encoded = json.dumps(
        [{"at": f.at_ms, "type": f.type, "message": f.message} for f in history],
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return {
        MessageConst.PROPERTY_ERRORS: encoded,
        MessageConst.PROPERTY_FIRST_FAILED_AT: str(first_failed_at(message, failure.at_ms)),
    }


def with_failure(message: MessageExt, failure: FailureRecord) -> MessageExt:
    """``message`` with ``failure`` appended to its history (and the first failure stamped)."""
    return message.with_properties(**failure_properties(message, failure))
