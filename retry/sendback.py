"""The send-back processor: the broker's ``CONSUMER_SEND_MSG_BACK`` rules, with no I/O.

For a failed message it decides, through the group's :class:`RetryPolicy`:

- delay level ``< 0``, or ``reconsume_times >= max_reconsume_times`` (16):
  the message goes to ``%DLQ%<group>`` (so does one whose ``reconsume_times`` is
  already at the ``int32`` limit the journal and the DLQ store, under a policy
  that never gives up);
- otherwise a new message is built: a new msg id, ``ORIGIN_MESSAGE_ID`` kept,
  ``RETRY_TOPIC`` = the original topic, ``RECONSUME_TIME`` / ``reconsume_times``
  + 1, ``MAX_RECONSUME_TIMES``; it is stored in ``SCHEDULE_TOPIC_XXXX`` queue
  ``level - 1`` with ``REAL_TOPIC`` = ``%RETRY%<group>`` and ``REAL_QID`` = 0
  until it is due (level 0 meaning ``3 + reconsume_times``).

A *busy* message (its key is claimed by another owner with a live lease) did not
fail: :meth:`SendBackProcessor.process_busy` schedules it again after a short
delay with ``reconsume_times`` unchanged and does not dead-letter it for that.

Either way a message larger than ``max_message_bytes`` (RocketMQ's
``maxMessageSize``, 4 MiB) is dead-lettered instead of scheduled, with a reason
naming its size and the limit: the broker refuses such a message, and Redis
could not take its wire form past ``proto-max-bulk-len`` (a message journaled
but refused by Redis would stop the journal's sync at it).
"""

from __future__ import annotations

from dataclasses import dataclass

from idem.clock import SYSTEM_CLOCK, Clock
from idem.config import DEFAULT_MAX_MESSAGE_BYTES
from idem.delay_levels import DEFAULT_MAX_RECONSUME_TIMES, DelayLevels
from idem.retry.dlq import DeadLetter
from idem.retry.message import (
    INT32_MAX,
    SCHEDULE_TOPIC,
    TIMER_QUEUE,
    TIMER_TOPIC,
    FailureRecord,
    MessageConst,
    MessageExt,
    failure_properties,
    first_failed_at,
    new_msg_id,
    retry_topic,
    with_failure,
)
from idem.retry.policy import DeliveryState, RetryPolicy, RocketMQLadder

REAL_QUEUE_ID = 0
"""``%RETRY%<group>`` has one queue (``retryQueueNums = 1``)."""

BUSY_DELAY_LEVEL = 1
"""Delay level of a busy send-back: the first level (1 s by default)."""


@dataclass(frozen=True, slots=True)
class Scheduled:
    """A send-back that will be redelivered: ``message`` waits in ``queue_id`` until ``due_ms``."""

    original: MessageExt
    message: MessageExt
    level: int
    queue_id: str
    delay_ms: int
    due_ms: int
    wire: str
    """``message.to_wire()``: what the journal and Redis store (measured against the limit)."""


@dataclass(frozen=True, slots=True)
class DeadLettered:
    """A send-back that ends in ``%DLQ%<group>``."""

    original: MessageExt
    letter: DeadLetter


SendBackDecision = Scheduled | DeadLettered


def _base64_len(size: int) -> int:
    return 4 * ((size + 2) // 3)


def oversize_reason(message: MessageExt, wire: str, max_message_bytes: int) -> str | None:
    """Why ``message`` (with its wire form ``wire``) is too large to schedule; ``None``: it fits.

    As RocketMQ: the body against ``maxMessageSize`` (the producer's check), then the whole
    message (the broker's): the body plus the rest of the envelope (topic, keys, properties).
    The body's base64 expansion on the wire is idem's, so it does not count.
    """
    body = len(message.body)
    if body > max_message_bytes:
        return f"body: {body} bytes is over max_message_bytes ({max_message_bytes} bytes)"
    wire_bytes = len(wire) if wire.isascii() else len(wire.encode())
    rest = wire_bytes - _base64_len(body)
    if body + rest > max_message_bytes:
        return (
            f"message: {body + rest} bytes (body {body}, topic, keys and properties {rest}) "
            f"is over max_message_bytes ({max_message_bytes} bytes)"
        )
    return None


class SendBackProcessor:
    """Broker-side send-back for one consumer group."""

    def __init__(
        self,
        group: str,
        *,
        policy: RetryPolicy | None = None,
        levels: DelayLevels | None = None,
        max_reconsume_times: int = DEFAULT_MAX_RECONSUME_TIMES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.group = group
        self.levels = levels or DelayLevels.parse()
        self.max_reconsume_times = max_reconsume_times
        self.max_message_bytes = max_message_bytes
        self.policy: RetryPolicy = policy or RocketMQLadder(self.levels, max_reconsume_times)
        self.clock = clock
        self.retry_topic = retry_topic(group)

    def process(
        self,
        message: MessageExt,
        *,
        delay_level: int = 0,
        error: str | BaseException | None = None,
        reason: str | None = None,
        now_ms: int | None = None,
    ) -> SendBackDecision:
        """Decide where ``message`` goes after a failed consume.

        ``reason``, when the message is dead-lettered, is the DLQ row's reason in
        place of the policy's (the caller knows why better, e.g. a limit it applied).
        ``now_ms``: the instant of the send-back (default: the clock's, read now), so
        the messages of one call fall due together.
        """
        now = self.clock.now_ms() if now_ms is None else now_ms
        failure = FailureRecord.of(error, now)
        state = DeliveryState(
            key=message.keys,
            reconsume_times=message.reconsume_times,
            first_seen_ms=first_failed_at(message, now),
            now_ms=now,
            last_error=failure.message,
            requested_level=delay_level,
            topic=message.retry_topic_origin,
        )
        decision = self.policy(state)
        if decision.delay is None:
            why = decision.reason if reason is None else reason
            return self._dead(message, with_failure(message, failure), why, now)
        if message.reconsume_times >= INT32_MAX:
            # a policy that never gives up: the resend could not be journaled nor stored
            why = f"reconsume_times: {message.reconsume_times} + 1 is over the limit {INT32_MAX}"
            return self._dead(message, with_failure(message, failure), why, now)

        delay = decision.delay
        due = now + delay.delay_ms
        reconsume_times = message.reconsume_times + 1
        props = failure_properties(message, failure)
        msg_id = new_msg_id(self.group, message.msg_id)
        scheduled = self._build(
            message,
            msg_id,
            reconsume_times=reconsume_times,
            level=delay.level,
            due=due,
            extra=props,
        )
        wire = scheduled.to_wire()
        too_large = oversize_reason(scheduled, wire, self.max_message_bytes)
        if too_large is not None:
            return self._dead(message, with_failure(message, failure), too_large, now)
        return Scheduled(
            original=message,
            message=scheduled,
            level=delay.level,
            queue_id=str(delay.level - 1) if delay.level > 0 else TIMER_QUEUE,
            delay_ms=delay.delay_ms,
            due_ms=due,
            wire=wire,
        )

    def _dead(
        self, original: MessageExt, message: MessageExt, reason: str, now: int
    ) -> DeadLettered:
        letter = DeadLetter.of(self.group, message, reason=reason, dead_at_ms=now)
        return DeadLettered(original=original, letter=letter)

    def process_busy(
        self,
        message: MessageExt,
        *,
        delay_level: int = BUSY_DELAY_LEVEL,
        now_ms: int | None = None,
    ) -> SendBackDecision:
        """Schedule ``message`` again because its key is busy: not a failure.

        ``reconsume_times`` and the failure history are kept (a key that is only
        busy is never dead-lettered for it); the delay is ``delay_level``
        (clamped to the ladder, default 1); the new msg id is derived from
        ``message.msg_id`` (:func:`~idem.retry.message.new_msg_id`, as a failure's
        resend of that copy would be: one copy is placed once). Only a
        message over ``max_message_bytes`` is dead-lettered (no path could
        schedule it), its history unchanged. ``now_ms`` as for :meth:`process`.
        """
        now = self.clock.now_ms() if now_ms is None else now_ms
        level = min(max(delay_level, 1), self.levels.max_level)
        delay_ms = self.levels.delay_ms(level)
        due = now + delay_ms
        scheduled = self._build(
            message,
            new_msg_id(self.group, message.msg_id),
            reconsume_times=message.reconsume_times,
            level=level,
            due=due,
            extra={},
        )
        wire = scheduled.to_wire()
        too_large = oversize_reason(scheduled, wire, self.max_message_bytes)
        if too_large is not None:  # the reason is its error: it failed no consume
            failed = with_failure(message, FailureRecord.of(too_large, now))
            return self._dead(message, failed, too_large, now)
        return Scheduled(
            original=message,
            message=scheduled,
            level=level,
            queue_id=str(level - 1),
            delay_ms=delay_ms,
            due_ms=due,
            wire=wire,
        )

    def _build(
        self,
        message: MessageExt,
        msg_id: str,
        *,
        reconsume_times: int,
        level: int,
        due: int,
        extra: dict[str, str],
    ) -> MessageExt:
        """The resent message, waiting in its schedule queue (level) or the timer (0)."""
        props = dict(message.properties)
        props.update(extra)
        props.update(
            {
                MessageConst.PROPERTY_RETRY_TOPIC: message.retry_topic_origin,
                MessageConst.PROPERTY_ORIGIN_MESSAGE_ID: message.origin_msg_id,
                MessageConst.PROPERTY_RECONSUME_TIME: str(reconsume_times),
                MessageConst.PROPERTY_MAX_RECONSUME_TIMES: str(self.max_reconsume_times),
                MessageConst.PROPERTY_REAL_TOPIC: self.retry_topic,
                MessageConst.PROPERTY_REAL_QUEUE_ID: str(REAL_QUEUE_ID),
            }
        )
        if level > 0:
            topic, schedule_qid = SCHEDULE_TOPIC, level - 1
            props[MessageConst.PROPERTY_DELAY_TIME_LEVEL] = str(level)
            props.pop(MessageConst.PROPERTY_TIMER_DELIVER_MS, None)
        else:
            topic, schedule_qid = TIMER_TOPIC, 0
            props[MessageConst.PROPERTY_TIMER_DELIVER_MS] = str(due)
            props.pop(MessageConst.PROPERTY_DELAY_TIME_LEVEL, None)
        return MessageExt(
            topic=topic,
            msg_id=msg_id,
            body=message.body,
            keys=message.keys,
            tags=message.tags,
            queue_id=schedule_qid,
            queue_offset=0,
            born_timestamp=message.born_timestamp,
            store_timestamp=self.clock.now_ms(),
            reconsume_times=reconsume_times,
            properties=props,
        )
