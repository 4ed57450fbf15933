"""The producer: ``send`` with RocketMQ's retries, and messages with keys and tags.

``retry_times_when_send_failed`` (default 2) resends a message whose send
failed — including one that *timed out after the broker stored it*. The resend
keeps the msg id (RocketMQ's client-side ``UNIQ_KEY``) and goes to another
queue, so the broker then holds the same message twice: redelivery case C1.
That is RocketMQ's behaviour, kept on purpose; the consumer's dedup hook
absorbs it.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import redis

from idem.clock import SYSTEM_CLOCK, Clock
from idem.errors import ConfigError
from idem.redis_client import connect
from idem.redis_cluster import RedisClient
from idem.retry.consumer.errors import SendFailed
from idem.retry.consumer.topics import MessageQueue, TopicStore
from idem.retry.message import MessageConst, MessageExt

log = logging.getLogger(__name__)

PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX = "UNIQ_KEY"
"""The property holding the client-generated msg id (kept across producer retries)."""

DEFAULT_SEND_MSG_TIMEOUT_MS = 3000
"""``sendMsgTimeout``."""

DEFAULT_RETRY_TIMES_WHEN_SEND_FAILED = 2
"""``retryTimesWhenSendFailed``: a failed synchronous send is tried up to 1 + 2 times."""

SEND_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.TryAgainError,
)
"""Failures after which the outcome is unknown: the message may have been stored."""

_COUNTER = itertools.count()
_PREFIX = f"{os.getpid() & 0xFFFF:04X}{uuid.uuid4().hex[:12].upper()}"


def new_msg_id() -> str:
    """A client-generated unique msg id (``MessageClientIDSetter.createUniqID``)."""
    return f"{_PREFIX}{next(_COUNTER) & 0xFFFFFFFFFFFFFFFF:016X}"


def new_message(
    topic: str,
    body: bytes,
    *,
    keys: str | None = None,
    tags: str | None = None,
    properties: Mapping[str, str] | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> MessageExt:
    """A message to send: ``keys`` is the business key, ``tags`` the filter tag."""
    msg_id = new_msg_id()
    props = dict(properties or {})
    props[PROPERTY_UNIQ_CLIENT_MESSAGE_ID_KEYIDX] = msg_id
    if keys is not None:
        props[MessageConst.PROPERTY_KEYS] = keys
    if tags is not None:
        props[MessageConst.PROPERTY_TAGS] = tags
    return MessageExt(
        topic=topic,
        msg_id=msg_id,
        body=body,
        keys=keys,
        tags=tags,
        born_timestamp=clock.now_ms(),
        properties=props,
    )


class SendStatus(StrEnum):
    """``SendStatus`` (only ``SEND_OK`` here: Redis has no flush-slave states)."""

    SEND_OK = "SEND_OK"


@dataclass(frozen=True, slots=True)
class SendResult:
    """Where a message was stored, and how many attempts it took."""

    status: SendStatus
    msg_id: str
    message_queue: MessageQueue
    queue_offset: int
    attempts: int


class MessageQueueSelector(Protocol):
    """Chooses the queue of a message (``MessageQueueSelector``), e.g. by order id."""

    def __call__(
        self, mqs: Sequence[MessageQueue], message: MessageExt, arg: object
    ) -> MessageQueue:
        """The queue for ``message``."""
        ...


def select_message_queue_by_hash(
    mqs: Sequence[MessageQueue], message: MessageExt, arg: object
) -> MessageQueue:
    """``SelectMessageQueueByHash``: the same ``arg`` (e.g. order id) always lands in one queue."""
    return mqs[zlib.crc32(str(arg).encode()) % len(mqs)]


class Producer:
    """Sends messages of ``group`` to topics (``DefaultMQProducer``)."""

    def __init__(
        self,
        group: str,
        *,
        redis_url: str | None = None,
        client: RedisClient | None = None,
        send_msg_timeout_ms: int = DEFAULT_SEND_MSG_TIMEOUT_MS,
        retry_times_when_send_failed: int = DEFAULT_RETRY_TIMES_WHEN_SEND_FAILED,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if (redis_url is None) == (client is None):
            raise ConfigError("Producer: pass exactly one of redis_url= or client=")
        if send_msg_timeout_ms < 1:
            raise ConfigError(f"send_msg_timeout_ms: must be >= 1, got {send_msg_timeout_ms}")
        if retry_times_when_send_failed < 0:
            raise ConfigError(
                f"retry_times_when_send_failed: must be >= 0, got {retry_times_when_send_failed}"
            )
        self.group = group
        self.send_msg_timeout_ms = send_msg_timeout_ms
        self.retry_times_when_send_failed = retry_times_when_send_failed
        self.clock = clock
        if client is None:
            assert redis_url is not None
            timeout_s = send_msg_timeout_ms / 1000
            # the producer owns its retries: redis-py must not resend on its own
            client = connect(
                redis_url, connect_timeout=timeout_s, read_timeout=timeout_s, retries=0
            )
            self._owns_client = True
        else:
            self._owns_client = False
        self.client = client
        self.topics = TopicStore(client, clock=clock)
        self._which_queue = itertools.count()
        self._lock = threading.Lock()

    def _next_queue(self, mqs: Sequence[MessageQueue], avoid: MessageQueue | None) -> MessageQueue:
        with self._lock:
            for _ in range(len(mqs)):
                mq = mqs[next(self._which_queue) % len(mqs)]
                if mq != avoid or len(mqs) == 1:
                    return mq
        return mqs[0]

    @staticmethod
    def _selected(
        selector: MessageQueueSelector,
        mqs: Sequence[MessageQueue],
        message: MessageExt,
        arg: object,
    ) -> MessageQueue:
        """The selector's queue, refused unless it is one of the topic's (a stream nobody
        reads would take the message and answer ``SEND_OK``)."""
        mq = selector(mqs, message, arg)
        if mq not in mqs:
            raise SendFailed(
                f"selector: chose {mq!r}, not one of the {len(mqs)} queue(s) of topic "
                f"{message.topic!r} (queue ids 0..{len(mqs) - 1})"
            )
        return mq

    def send(
        self,
        message: MessageExt,
        *,
        selector: MessageQueueSelector | None = None,
        arg: object = None,
    ) -> SendResult:
        """Store ``message`` in one queue of its topic, retrying a failed attempt.

        A timeout is an unknown outcome: the broker may have stored the message.
        It is sent again anyway (RocketMQ does), to another queue unless a
        ``selector`` pins the queue. Raises :class:`SendFailed` when every attempt
        failed.
        """
        mqs = self.topics.message_queues(message.topic, cached=True)
        if not mqs:
            raise SendFailed(f"topic {message.topic!r} does not exist (create_topic first)")
        attempts = 1 + self.retry_times_when_send_failed
        last: MessageQueue | None = None
        error: BaseException | None = None
        for attempt in range(1, attempts + 1):
            mq = (
                self._selected(selector, mqs, message, arg)
                if selector
                else self._next_queue(mqs, last)
            )
            try:
                offset = self.topics.put(mq, [message])[0]
            except SEND_TRANSIENT as exc:
                log.warning(
                    "send of %s to %s failed (attempt %d/%d): %s",
                    message.msg_id,
                    mq,
                    attempt,
                    attempts,
                    exc,
                )
                error, last = exc, mq
                continue
            return SendResult(SendStatus.SEND_OK, message.msg_id, mq, offset, attempt)
        raise SendFailed(
            f"send of {message.msg_id} to {message.topic!r} failed after {attempts} attempt(s): "
            f"{error}"
        ) from error

    def send_batch(self, messages: Sequence[MessageExt]) -> list[SendResult]:
        """Send many messages round-robin over their topic's queues, one round trip per queue.

        A loader for tests and benchmarks: a failed round trip raises (no retries).
        Results are in the order of ``messages``.
        """
        by_queue: dict[MessageQueue, list[int]] = {}
        for index, message in enumerate(messages):
            mqs = self.topics.message_queues(message.topic, cached=True)
            if not mqs:
                raise SendFailed(f"topic {message.topic!r} does not exist (create_topic first)")
            by_queue.setdefault(self._next_queue(mqs, None), []).append(index)
        results: dict[int, SendResult] = {}
        for mq, indices in by_queue.items():
            offsets = self.topics.put(mq, [messages[i] for i in indices])
            for i, offset in zip(indices, offsets, strict=True):
                results[i] = SendResult(SendStatus.SEND_OK, messages[i].msg_id, mq, offset, 1)
        return [results[i] for i in range(len(messages))]

    def shutdown(self) -> None:
        """Close the connection pool if the producer built it."""
        if self._owns_client:
            self.client.close()
