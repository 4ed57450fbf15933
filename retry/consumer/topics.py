"""Topics with N queues on Redis streams: the broker's commit log and consume queues.

Every queue of a topic is one stream, and all of a topic's keys share the hash
tag ``{<topic>}`` so one ``XREAD`` pulls every queue of a topic, also on Redis
Cluster:

==========================================  ======  =======================================
``rmq:topic:{<topic>}:meta``                HASH    ``queues`` -> number of queues
``rmq:topic:{<topic>}:q:<queue id>``        STREAM  the queue; entry id ``0-<offset + 1>``
==========================================  ======  =======================================

A message's queue offset is dense (0, 1, 2, ...), as in a RocketMQ consume
queue: the stream entry ids are ``0-1, 0-2, ...`` (Redis assigns the sequence
with ``XADD 0-*``), so "pull from offset ``o``" is ``XREAD ... 0-<o>``. The
entry holds the message's JSON wire form (never pickle) and its store time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, cast

import redis

from idem.clock import SYSTEM_CLOCK, Clock
from idem.errors import ConfigError, SerializationError
from idem.redis_cluster import RedisClient
from idem.retry.message import MessageConst, MessageExt

UNDECODABLE = MessageConst.PROPERTY_UNDECODABLE
"""Property of a placeholder for a queue entry that is not a message: the reason."""

DEFAULT_QUEUE_NUMS = 4
"""``defaultTopicQueueNums``: queues of a topic created without saying how many."""

MAX_QUEUE_NUMS = 1024
"""Most queues a topic may have."""


@dataclass(frozen=True, order=True, slots=True)
class MessageQueue:
    """One queue of a topic (RocketMQ's ``MessageQueue``; the broker is the Redis server)."""

    topic: str
    queue_id: int

    def __str__(self) -> str:
        return f"{self.topic}:{self.queue_id}"

    @classmethod
    def parse(cls, text: str) -> MessageQueue:
        """Inverse of ``str()``: ``"<topic>:<queue id>"``."""
        topic, _, qid = text.rpartition(":")
        if not topic or not qid.isdigit():
            raise ValueError(f"message queue: {text!r} is not '<topic>:<queue id>'")
        return cls(topic, int(qid))


class PullStatus(StrEnum):
    """What a pull found (``PullStatus``)."""

    FOUND = "FOUND"
    NO_NEW_MSG = "NO_NEW_MSG"
    OFFSET_ILLEGAL = "OFFSET_ILLEGAL"


@dataclass(frozen=True, slots=True)
class PullResult:
    """Messages from one queue and where the next pull starts."""

    status: PullStatus
    next_begin_offset: int
    min_offset: int
    max_offset: int
    messages: tuple[MessageExt, ...] = ()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _offset_of(entry_id: Any) -> int:
    return int(_text(entry_id).split("-", 1)[1]) - 1


def _next_offset(info: Any) -> int:
    """The offset after a stream's last generated id, from an ``XINFO STREAM`` reply (a
    Cluster's transaction leaves it raw: pairs, or a dict of bytes)."""
    pairs = info.items() if isinstance(info, dict) else zip(info[::2], info[1::2], strict=True)
    fields = {_text(k): v for k, v in pairs}
    return _offset_of(fields["last-generated-id"]) + 1


class TopicStore:
    """Topics, their queues, and the messages in them (the broker's side)."""

    def __init__(self, client: RedisClient, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.client = client
        self.clock = clock
        self._queue_nums: dict[str, int] = {}

    # -- names ---------------------------------------------------------------------------

    @staticmethod
    def meta_key(topic: str) -> str:
        """The topic's metadata hash."""
        return f"rmq:topic:{{{topic}}}:meta"

    @staticmethod
    def queue_key(mq: MessageQueue) -> str:
        """The stream of one queue."""
        return f"rmq:topic:{{{mq.topic}}}:q:{mq.queue_id}"

    # -- topics --------------------------------------------------------------------------

    def create_topic(self, topic: str, queues: int = DEFAULT_QUEUE_NUMS) -> None:
        """Create ``topic`` with ``queues`` queues (more queues may be added later, never fewer)."""
        if not topic or any(c in topic for c in "{}:\n"):
            raise ConfigError(f"topic: {topic!r} must be non-empty without '{{', '}}', ':'")
        if isinstance(queues, bool) or not 1 <= queues <= MAX_QUEUE_NUMS:
            raise ConfigError(f"queues: {queues!r} is outside 1..{MAX_QUEUE_NUMS}")
        current = self.queue_nums(topic, cached=False)
        if queues < current:
            raise ConfigError(f"queues: topic {topic!r} has {current} queues; cannot shrink")
        self.client.hset(self.meta_key(topic), "queues", queues)
        self._queue_nums[topic] = queues

    def queue_nums(self, topic: str, *, cached: bool = True) -> int:
        """How many queues ``topic`` has (0: the topic does not exist)."""
        if cached and topic in self._queue_nums:
            return self._queue_nums[topic]
        raw = self.client.hget(self.meta_key(topic), "queues")
        count = int(_text(raw)) if raw is not None else 0
        if count:
            self._queue_nums[topic] = count
        return count

    def message_queues(self, topic: str, *, cached: bool = False) -> list[MessageQueue]:
        """Every queue of ``topic`` (``fetchSubscribeMessageQueues``), sorted."""
        return [MessageQueue(topic, i) for i in range(self.queue_nums(topic, cached=cached))]

    # -- writing -------------------------------------------------------------------------

    def put(self, mq: MessageQueue, messages: Sequence[MessageExt]) -> list[int]:
        """Append ``messages`` to ``mq`` in one round trip; returns their queue offsets."""
        if not messages:
            return []
        now = self.clock.now_ms()
        pipe = self.client.pipeline(transaction=False)
        key = self.queue_key(mq)
        for message in messages:
            pipe.xadd(key, {"m": message.to_wire(), "t": now}, id="0-*")
        return [_offset_of(entry_id) for entry_id in pipe.execute()]

    # -- reading -------------------------------------------------------------------------

    def _message(self, mq: MessageQueue, entry_id: Any, fields: Mapping[Any, Any]) -> MessageExt:
        values = {_text(k): v for k, v in fields.items()}
        offset = _offset_of(entry_id)
        try:
            data = json.loads(values["m"])
            data["queue_id"] = mq.queue_id
            data["queue_offset"] = offset
            data["store_timestamp"] = int(_text(values.get("t", b"0")))
            return MessageExt.from_dict(data)
        except (
            KeyError,
            TypeError,
            ValueError,
            UnicodeDecodeError,
            SerializationError,
            OverflowError,  # a number past any integer ("born_timestamp": 1e400)
            RecursionError,  # JSON nested past the interpreter's limit
        ) as exc:
            # Not a message idem's producer wrote: it still has its offset, so it must not
            # stop the queue. It goes on as a placeholder the consumer dead-letters.
            reason = (
                f"undecodable: {mq} offset {offset} is not a message ({type(exc).__name__}: {exc})"
            )
            return undecodable_message(mq, offset, values, reason)

    def read_many(
        self,
        offsets: Mapping[MessageQueue, int],
        count: int,
        block_ms: int | None = None,
        *,
        client: RedisClient | None = None,
    ) -> dict[MessageQueue, list[MessageExt]]:
        """Up to ``count`` messages per queue from each queue's next offset, in one ``XREAD``.

        Every queue must belong to one topic (one hash tag). ``block_ms`` waits for
        new messages when there are none (long polling).
        """
        if not offsets:
            return {}
        by_key = {self.queue_key(mq): mq for mq in offsets}
        streams = {key: f"0-{offsets[mq]}" for key, mq in by_key.items()}
        reply = (client or self.client).xread(cast(Any, streams), count=count, block=block_ms)
        out: dict[MessageQueue, list[MessageExt]] = {}
        for raw_key, entries in cast(list[Any], reply or []):
            mq = by_key[_text(raw_key)]
            out[mq] = [self._message(mq, eid, fields) for eid, fields in entries]
        return out

    def read_many_anchored(
        self,
        offsets: Mapping[MessageQueue, int],
        anchors: Mapping[MessageQueue, tuple[int, str]],
        count: int,
        block_ms: int | None = None,
        *,
        client: redis.Redis,
    ) -> tuple[dict[MessageQueue, list[MessageExt]], set[MessageQueue]]:
        """:meth:`read_many`, and in the same round trip the entry at each queue's anchor
        (the offset and msg id of the message last pulled from it); returns the messages
        and the queues whose anchor now holds another message. Such a queue was rewound
        (Redis lost data) and its offsets handed out again: its messages are not
        returned. A single server only (the anchors go in one pipeline with the read)."""
        if not offsets:
            return {}, set()
        pipe = client.pipeline(transaction=False)
        by_key = {self.queue_key(mq): mq for mq in offsets}
        streams = {key: f"0-{offsets[mq]}" for key, mq in by_key.items()}
        pipe.xread(cast(Any, streams), count=count, block=block_ms)
        # After the read, which may block: offsets are handed out in order, so a message
        # the read got past the anchor was written after whatever now holds the anchor.
        checked = [mq for mq in offsets if mq in anchors]
        for mq in checked:
            entry_id = f"0-{anchors[mq][0] + 1}"
            pipe.xrange(self.queue_key(mq), min=entry_id, max=entry_id)
        reply, *found = pipe.execute()
        rewound = {
            mq
            for mq, entries in zip(checked, found, strict=True)
            if entries and self._message(mq, *entries[0]).msg_id != anchors[mq][1]
        }
        out: dict[MessageQueue, list[MessageExt]] = {}
        for raw_key, entries in cast(list[Any], reply or []):
            mq = by_key[_text(raw_key)]
            if mq not in rewound:
                out[mq] = [self._message(mq, eid, fields) for eid, fields in entries]
        return out, rewound

    def pull(self, mq: MessageQueue, offset: int, max_nums: int = 32) -> PullResult:
        """``pullMessage`` of one queue from ``offset``, with the queue's bounds."""
        low, high = self.min_offset(mq), self.max_offset(mq)
        if offset < low or offset > high:
            return PullResult(PullStatus.OFFSET_ILLEGAL, min(max(offset, low), high), low, high)
        entries: list[Any] = cast(
            Any, self.client.xrange(self.queue_key(mq), min=f"0-{offset + 1}", count=max_nums)
        )
        messages = tuple(self._message(mq, eid, fields) for eid, fields in entries)
        if not messages:
            return PullResult(PullStatus.NO_NEW_MSG, offset, low, high)
        return PullResult(PullStatus.FOUND, messages[-1].queue_offset + 1, low, high, messages)

    def msg_id_at(self, mq: MessageQueue, offset: int) -> str | None:
        """The msg id of the message at ``offset`` of ``mq`` (``None``: no entry there)."""
        entry_id = f"0-{offset + 1}"
        entries: list[Any] = cast(
            Any, self.client.xrange(self.queue_key(mq), min=entry_id, max=entry_id)
        )
        return self._message(mq, *entries[0]).msg_id if entries else None

    def max_offset(self, mq: MessageQueue) -> int:
        """The offset the next message of ``mq`` will get (RocketMQ's max offset)."""
        last = self.client.xrevrange(self.queue_key(mq), count=1)
        return _offset_of(last[0][0]) + 1 if last else self._trimmed_max(mq)

    def _trimmed_max(self, mq: MessageQueue) -> int:
        try:
            info = self.client.xinfo_stream(self.queue_key(mq))
        except redis.ResponseError:
            return 0
        return _next_offset(info)

    def min_offset(self, mq: MessageQueue) -> int:
        """The offset of the oldest message still stored in ``mq`` (of an empty queue: the
        offset its next message will get).

        One snapshot (``MULTI``): read apart, a message added between "empty" and "the next
        offset" made the minimum pass that message, and a consumer reset there skipped it.
        """
        pipe = self.client.pipeline(transaction=True)
        pipe.xrange(self.queue_key(mq), count=1)
        pipe.xinfo_stream(self.queue_key(mq))
        first, info = pipe.execute(raise_on_error=False)
        if isinstance(first, list) and first:
            return _offset_of(first[0][0])
        if isinstance(info, Exception):  # no stream: nothing was ever stored
            return 0
        return _next_offset(info)

    def search_offset(self, mq: MessageQueue, timestamp_ms: int) -> int:
        """The first offset stored at or after ``timestamp_ms`` (``searchOffset``; bisection)."""
        low, high = self.min_offset(mq), self.max_offset(mq)
        key = self.queue_key(mq)
        while low < high:
            mid = (low + high) // 2
            entry: list[Any] = cast(Any, self.client.xrange(key, min=f"0-{mid + 1}", count=1))
            if not entry:
                return high
            fields = {_text(k): v for k, v in entry[0][1].items()}
            stored = int(_text(fields.get("t", b"0")))
            if stored < timestamp_ms:
                low = _offset_of(entry[0][0]) + 1
            else:
                high = mid
        return low

    def messages(self, mq: MessageQueue) -> list[MessageExt]:
        """Every stored message of ``mq`` (tests, tools)."""
        entries: list[Any] = cast(Any, self.client.xrange(self.queue_key(mq)))
        return [self._message(mq, eid, fields) for eid, fields in entries]


def undecodable_message(
    mq: MessageQueue, offset: int, values: Mapping[str, Any], reason: str
) -> MessageExt:
    """A placeholder at ``offset`` for an entry that is not a message: its fields as JSON
    (bytes decoded with replacement) for the DLQ row, and ``reason`` in its properties."""
    fields = {
        name: value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        for name, value in values.items()
    }
    return MessageExt(
        topic=mq.topic,
        msg_id=f"UNDECODABLE-{mq.topic}-{mq.queue_id}-{offset}",
        body=json.dumps(fields, ensure_ascii=False).encode("utf-8"),
        queue_id=mq.queue_id,
        queue_offset=offset,
        properties={UNDECODABLE: reason},
    )
