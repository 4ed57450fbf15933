"""The retry topic ``%RETRY%<group>``: a Redis stream read by the group's consumer group.

A consumer reads new entries (``XREADGROUP``) and first takes over entries another
consumer has held longer than the consume timeout (``XAUTOCLAIM``): a consumer
that died mid-batch does not strand its messages. On read, a message is turned
back from its schedule form (``messageTimeup``: topic = ``REAL_TOPIC``) and then
``reset_retry_topic`` restores the topic it was first published to
(``RETRY_TOPIC``), exactly as a RocketMQ clustering consumer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import redis

from idem.retry.message import MessageConst, MessageExt, retry_topic
from idem.retry.store import Op, ScheduleStore

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
        queue_id=int(raw_qid) if raw_qid.isdigit() else 0,
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


class RetryTopic:
    """Consumer-group reads of ``%RETRY%<group>`` (read, reclaim, raw ack)."""

    def __init__(self, store: ScheduleStore, *, reclaim_idle_ms: int) -> None:
        self.store = store
        self.client = store.client
        self.group = store.group
        self.key = store.keys.stream
        self.reclaim_idle_ms = reclaim_idle_ms
        self.name = retry_topic(self.group)

    def ensure_group(self) -> None:
        """Create the consumer group (from the start of the stream) if it is missing."""
        try:
            self.client.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def entries_to_messages(self, entries: Sequence[Any] | None) -> list[MessageExt]:
        """Stream entries (``XRANGE`` / ``XREADGROUP`` replies) as the consumer sees them.

        Each lands in its real topic (``message_timeup``) with the original topic
        restored (``reset_retry_topic``); entries deleted while pending are skipped.
        """
        out: list[MessageExt] = []
        for entry_id, fields in entries or ():
            if not fields:  # deleted while pending
                continue
            sid = _text(entry_id)
            values = {_text(k): v for k, v in fields.items()}
            message = MessageExt.from_wire(values["m"])
            landed = message_timeup(
                message,
                queue_offset=int(_text(values.get("o", b"0"))),
                store_timestamp=int(sid.split("-", 1)[0]),
            )
            out.append(reset_retry_topic(landed, self.group))
        return out

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
        return self.entries_to_messages(entries)

    def ack(self, messages: Sequence[MessageExt]) -> int:
        """Remove ``messages`` from the topic in Redis only (not journaled).

        Use :meth:`idem.retry.RetryEngine.ack` for a durable acknowledgement; this is
        the raw primitive it ends in.
        """
        result = self.store.apply_direct([Op("R", m.msg_id) for m in messages])
        return result.removed
