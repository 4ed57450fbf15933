"""The retry topic ``%RETRY%<group>``: a Redis stream read by the group's consumer group.

A consumer reads new entries (``XREADGROUP``) and first takes over entries another
consumer has held longer than the consume timeout (``XAUTOCLAIM``): a consumer
that died mid-batch does not strand its messages. On read, a message is turned
back from its schedule form (``messageTimeup``: topic = ``REAL_TOPIC``) and then
``reset_retry_topic`` restores the topic it was first published to
(``RETRY_TOPIC``), exactly as a RocketMQ clustering consumer does.

An entry that is not an idem message (no ``m`` field, bytes that are not the wire
form: something else wrote it, or it was damaged) must not stop every reader of
the topic. It is decoded to a :class:`DamagedEntry`, a placeholder message with its
raw bytes and the reason, and handed to ``on_damaged`` (the engine dead-letters it,
then removes it from the topic), while the good entries around it read as usual.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import redis

from idem.errors import SerializationError
from idem.retry.message import MessageConst, MessageExt, retry_topic
from idem.retry.store import Op, ScheduleStore

log = logging.getLogger(__name__)

WIRE_FIELD: Final = "m"
"""The field of a retry topic entry that holds the message's wire form (``move.lua``)."""

_NOT_A_MESSAGE: tuple[type[Exception], ...] = (
    KeyError,
    TypeError,
    ValueError,
    UnicodeDecodeError,
    SerializationError,
    OverflowError,  # a number past any integer
    RecursionError,  # JSON nested past the interpreter's limit
)
"""What decoding an entry that is not an idem message raises (as on a topic queue)."""

_SCHEDULE_ONLY = (
    MessageConst.PROPERTY_REAL_TOPIC,
    MessageConst.PROPERTY_REAL_QUEUE_ID,
    MessageConst.PROPERTY_DELAY_TIME_LEVEL,
    MessageConst.PROPERTY_TIMER_DELIVER_MS,
)


def message_timeup(message: MessageExt, *, queue_offset: int, store_timestamp: int) -> MessageExt:
    """The scheduled message as it lands in its real topic (``ScheduleMessageService``)."""
    props = message.properties
    topic = props.get(MessageConst.PROPERTY_REAL_TOPIC) or message.topic
    raw_qid = props.get(MessageConst.PROPERTY_REAL_QUEUE_ID, "0")
    cleared = message.with_properties(**dict.fromkeys(_SCHEDULE_ONLY))
    return cleared.evolve(
        topic=topic,
        # isdigit() alone takes "²", which int() refuses
        queue_id=int(raw_qid) if raw_qid.isascii() and raw_qid.isdigit() else 0,
        queue_offset=queue_offset,
        store_timestamp=store_timestamp,
    )


def reset_retry_topic(message: MessageExt, group: str) -> MessageExt:
    """``resetRetryAndNamespace``: a message read from ``%RETRY%<group>`` regains its topic."""
    original = message.properties.get(MessageConst.PROPERTY_RETRY_TOPIC)
    if original and message.topic == retry_topic(group):
        return message.evolve(topic=original)
    return message


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _lossless_text(value: Any) -> str:
    """``value`` as text that can be stored whatever its bytes (``\\xff`` for a bad byte)."""
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8", "backslashreplace")
    return raw.decode("utf-8", "backslashreplace")


@dataclass(frozen=True, slots=True)
class DamagedEntry:
    """An entry of ``%RETRY%<group>`` that is not an idem message.

    ``message`` is its placeholder for the DLQ row: topic ``%RETRY%<group>``, msg id
    ``UNDECODABLE-%RETRY%<group>-<entry id>`` (the same on every read, so a repeated
    dead letter adds no row), the raw ``m`` bytes as the body (the entry's fields as
    JSON when it has no ``m``), and ``reason`` in its ``IDEM_UNDECODABLE`` property.
    """

    entry_id: str
    message: MessageExt
    reason: str


@dataclass(frozen=True, slots=True)
class RetryEntries:
    """Stream entries decoded: the messages, and the entries that are not messages."""

    messages: list[MessageExt]
    damaged: list[DamagedEntry]


DamagedHandler = Callable[[Sequence[DamagedEntry]], object]
"""What a consumer-group read does with entries that are not messages (see
:meth:`idem.retry.RetryEngine.dead_letter_damaged`)."""


class RetryTopic:
    """Consumer-group reads of ``%RETRY%<group>`` (read, reclaim, raw ack).

    ``on_damaged`` gets the entries of a consumer-group read that are not messages;
    without it they are logged and left where they are (pending, never acknowledged).
    """

    def __init__(
        self,
        store: ScheduleStore,
        *,
        reclaim_idle_ms: int,
        on_damaged: DamagedHandler | None = None,
    ) -> None:
        self.store = store
        self.client = store.client
        self.group = store.group
        self.key = store.keys.stream
        self.reclaim_idle_ms = reclaim_idle_ms
        self.name = retry_topic(self.group)
        self.on_damaged = on_damaged

    def ensure_group(self) -> None:
        """Create the consumer group (from the start of the stream) if it is missing."""
        try:
            self.client.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def decode(self, entries: Sequence[Any] | None) -> RetryEntries:
        """Stream entries (``XRANGE`` / ``XREADGROUP`` replies) as the consumer sees them.

        Each lands in its real topic (``message_timeup``) with the original topic
        restored (``reset_retry_topic``); entries deleted while pending are skipped;
        an entry that is not a message becomes a :class:`DamagedEntry`.
        """
        messages: list[MessageExt] = []
        damaged: list[DamagedEntry] = []
        for entry_id, fields in entries or ():
            if not fields:  # deleted while pending
                continue
            sid = _text(entry_id)
            try:
                messages.append(self._landed(sid, fields))
            except _NOT_A_MESSAGE as exc:
                damaged.append(self._damaged(sid, fields, exc))
        return RetryEntries(messages, damaged)

    def _landed(self, sid: str, fields: Mapping[Any, Any]) -> MessageExt:
        values = {_text(k): v for k, v in fields.items()}
        message = MessageExt.from_wire(values[WIRE_FIELD])
        offset = _text(values.get("o", b"0"))
        if not (offset.isascii() and offset.isdigit()):
            raise ValueError(f"field 'o' (queue offset): {offset!r} is not a whole number")
        landed = message_timeup(
            message, queue_offset=int(offset), store_timestamp=int(sid.split("-", 1)[0])
        )
        return reset_retry_topic(landed, self.group)

    def _damaged(self, sid: str, fields: Mapping[Any, Any], exc: Exception) -> DamagedEntry:
        values = {_lossless_text(k): v for k, v in fields.items()}
        wire = values.get(WIRE_FIELD)
        if wire is None:
            names = sorted(values)
            listed = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
            why = f"it has no field {WIRE_FIELD!r}, only: {listed}"
            # nothing else holds its bytes: its fields, as text that keeps every byte
            body = json.dumps(
                {name: _lossless_text(v) for name, v in values.items()}, ensure_ascii=False
            ).encode("utf-8")
        else:
            why = f"{type(exc).__name__}: {exc}"
            body = wire if isinstance(wire, bytes) else _lossless_text(wire).encode("utf-8")
        reason = _lossless_text(f"undecodable: {self.name} entry {sid} is not a message ({why})")
        placeholder = MessageExt(
            topic=self.name,
            msg_id=f"UNDECODABLE-{self.name}-{sid}",
            body=body,
            store_timestamp=int(sid.split("-", 1)[0]),
            properties={MessageConst.PROPERTY_UNDECODABLE: reason},
        )
        return DamagedEntry(sid, placeholder, reason)

    def entries_to_messages(self, entries: Sequence[Any] | None) -> list[MessageExt]:
        """The messages of entries a consumer-group read delivered (see :meth:`decode`).

        The entries that are not messages go to ``on_damaged`` first: they are
        delivered too (pending), and must end somewhere rather than be skipped.
        """
        decoded = self.decode(entries)
        if decoded.damaged:
            if self.on_damaged is not None:
                self.on_damaged(decoded.damaged)
            else:
                _left_in_place(decoded.damaged)
        return decoded.messages

    def read(self, consumer: str, count: int, block_ms: int | None = None) -> list[MessageExt]:
        """Up to ``count`` messages for ``consumer``: stale ones first, then new ones.

        ``block_ms`` waits for new entries when there are none (``None``: do not wait).
        """
        if count <= 0:
            return []
        try:
            return self._read(consumer, count, block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self.ensure_group()  # Redis lost the group (restart, FLUSHALL): recreate it
            return self._read(consumer, count, block_ms)

    def _read(self, consumer: str, count: int, block_ms: int | None) -> list[MessageExt]:
        reclaimed: list[Any] = self.client.xautoclaim(
            self.key,
            self.group,
            consumer,
            min_idle_time=self.reclaim_idle_ms,
            start_id="0-0",
            count=count,
        )
        messages = self.entries_to_messages(reclaimed[1])
        if len(messages) >= count:
            return messages
        block = block_ms if block_ms and not messages else None
        reply = self.client.xreadgroup(
            self.group, consumer, {self.key: ">"}, count=count - len(messages), block=block
        )
        for _stream, entries in cast(list[Any], reply or []):
            messages += self.entries_to_messages(entries)
        return messages

    _entries_to_messages = entries_to_messages  # the name idem.spark used first

    def range(self, after: str, until: str = "+", count: int | None = None) -> list[MessageExt]:
        """Messages with stream ids in ``(after, until]`` (``after="0-0"``: from the start)."""
        entries = self.client.xrange(
            self.key, min=f"({after}" if after != "0-0" else "-", max=until, count=count
        )
        decoded = self.decode(entries)
        _left_in_place(decoded.damaged)  # an inspection: it acknowledges nothing
        return decoded.messages

    def remove_entries(self, entry_ids: Sequence[str]) -> int:
        """Delete entries from the topic by stream id and acknowledge them; returns how many
        were there.

        For entries that are not messages (:class:`DamagedEntry`): no msg id names them
        in Redis nor in the journal, so :meth:`ack` cannot reach them.
        """
        if not entry_ids:
            return 0
        pipe = self.client.pipeline(transaction=True)
        # XDEL first: an entry deleted but still pending is dropped by the next XAUTOCLAIM;
        # one acknowledged but not deleted would stay in the stream, unread, for ever
        pipe.xdel(self.key, *entry_ids)
        pipe.xack(self.key, self.group, *entry_ids)
        deleted, _acked = pipe.execute()
        return int(deleted)

    def ack(self, messages: Sequence[MessageExt]) -> int:
        """Remove ``messages`` from the topic in Redis only (not journaled).

        Use :meth:`idem.retry.RetryEngine.ack` for a durable acknowledgement; this is
        the raw primitive it ends in.
        """
        result = self.store.apply_direct([Op("R", m.msg_id) for m in messages])
        return result.removed


def _left_in_place(damaged: Sequence[DamagedEntry]) -> None:
    for entry in damaged:
        log.warning("%s; left in the topic", entry.reason)
