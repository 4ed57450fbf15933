"""Consume statuses and contexts, with RocketMQ's rules for what a result means.

``ConsumeConcurrentlyStatus`` / ``ConsumeConcurrentlyContext`` (``ack_index``,
``delay_level_when_next_consume``) and ``ConsumeOrderlyStatus`` /
``ConsumeOrderlyContext`` keep RocketMQ's names. The functions here are the
client's ``processConsumeResult`` logic, without any I/O: which messages of a
batch are acknowledged and which are sent back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from idem.retry.message import MessageExt

log = logging.getLogger(__name__)

ACK_INDEX_ALL: Final = 2**31 - 1
"""RocketMQ's default ``ackIndex`` (``Integer.MAX_VALUE``): success acknowledges the whole batch."""

DEFAULT_SUSPEND_MS: Final = 1000
"""``suspendCurrentQueueTimeMillis``: how long an orderly queue pauses after a failure."""


class ConsumeConcurrentlyStatus(StrEnum):
    """What a concurrent listener returns."""

    CONSUME_SUCCESS = "CONSUME_SUCCESS"
    RECONSUME_LATER = "RECONSUME_LATER"


class ConsumeOrderlyStatus(StrEnum):
    """What an orderly listener returns."""

    SUCCESS = "SUCCESS"
    SUSPEND_CURRENT_QUEUE_A_MOMENT = "SUSPEND_CURRENT_QUEUE_A_MOMENT"


class MessageModel(StrEnum):
    """Clustering consumers retry failed messages; broadcasting consumers drop them."""

    CLUSTERING = "CLUSTERING"
    BROADCASTING = "BROADCASTING"


@dataclass(slots=True)
class ConsumeConcurrentlyContext:
    """Set by the listener to steer the send-back of a failed batch.

    ``delay_level_when_next_consume``: ``-1`` dead-letters at once, ``0`` lets the
    broker choose (``3 + reconsume_times``), ``> 0`` is the client's choice.
    ``ack_index``: on success, messages ``0..ack_index`` are acknowledged and the
    rest are sent back; on ``RECONSUME_LATER`` every message is sent back.
    """

    delay_level_when_next_consume: int = 0
    ack_index: int = ACK_INDEX_ALL


@dataclass(slots=True)
class ConsumeOrderlyContext:
    """Set by an orderly listener: ``suspend_current_queue_time_millis`` (``-1`` = default)."""

    auto_commit: bool = True
    suspend_current_queue_time_millis: int = -1


@dataclass(frozen=True, slots=True)
class ConsumeResult:
    """A batch split by its outcome."""

    acked: tuple[MessageExt, ...]
    send_back: tuple[MessageExt, ...]
    dropped: tuple[MessageExt, ...] = ()


ConcurrentListener = Callable[
    [Sequence[MessageExt], ConsumeConcurrentlyContext], "ConsumeConcurrentlyStatus | None"
]


def run_listener(
    listener: ConcurrentListener,
    messages: Sequence[MessageExt],
    context: ConsumeConcurrentlyContext,
) -> ConsumeConcurrentlyStatus:
    """Call ``listener``; an exception or ``None`` means ``RECONSUME_LATER``, as in RocketMQ."""
    try:
        status = listener(messages, context)
    except Exception:  # the listener's own failure: logged, never propagated
        log.warning(
            "listener failed; %d message(s) will be reconsumed later", len(messages), exc_info=True
        )
        return ConsumeConcurrentlyStatus.RECONSUME_LATER
    if status is None:
        return ConsumeConcurrentlyStatus.RECONSUME_LATER
    return ConsumeConcurrentlyStatus(status)


def split_consume_result(
    messages: Sequence[MessageExt],
    status: ConsumeConcurrentlyStatus,
    context: ConsumeConcurrentlyContext,
    model: MessageModel = MessageModel.CLUSTERING,
) -> ConsumeResult:
    """``processConsumeResult``: which messages are acknowledged and which are sent back.

    Success acknowledges ``0..ack_index`` (clamped to the batch); failure sets
    ``ack_index = -1``. Under broadcasting the rest are dropped (and logged).
    """
    size = len(messages)
    if status is ConsumeConcurrentlyStatus.CONSUME_SUCCESS:
        ack_index = min(context.ack_index, size - 1)
    else:
        ack_index = -1
    acked = tuple(messages[: ack_index + 1])
    rest = tuple(messages[ack_index + 1 :])
    if model is MessageModel.BROADCASTING:
        for message in rest:
            log.warning("BROADCASTING, the message consume failed, drop it: %s", message.msg_id)
        return ConsumeResult(acked=acked, send_back=(), dropped=rest)
    return ConsumeResult(acked=acked, send_back=rest)


class OrderlyAction(StrEnum):
    """What an orderly consumer does after its listener returned."""

    COMMIT = "COMMIT"
    SUSPEND = "SUSPEND"
    DEAD_LETTER = "DEAD_LETTER"


@dataclass(frozen=True, slots=True)
class OrderlyOutcome:
    """The orderly decision for a batch.

    ``COMMIT``: everything succeeded. ``SUSPEND``: the queue pauses ``suspend_ms``
    and ``retry`` (with ``reconsume_times`` incremented) is consumed again in
    place. ``dead`` holds the messages that reached the limit: they go to the
    dead-letter queue either way. ``DEAD_LETTER``: nothing is left to retry.
    """

    action: OrderlyAction
    retry: tuple[MessageExt, ...] = ()
    dead: tuple[MessageExt, ...] = ()
    suspend_ms: int = 0


def orderly_outcome(
    messages: Sequence[MessageExt],
    status: ConsumeOrderlyStatus,
    context: ConsumeOrderlyContext,
    *,
    max_reconsume_times: int,
) -> OrderlyOutcome:
    """``ConsumeMessageOrderlyService.checkReconsumeTimes``: local retries, then the DLQ."""
    if status is ConsumeOrderlyStatus.SUCCESS:
        return OrderlyOutcome(OrderlyAction.COMMIT)
    dead = tuple(m for m in messages if m.reconsume_times >= max_reconsume_times)
    retry = tuple(
        m.evolve(reconsume_times=m.reconsume_times + 1)
        for m in messages
        if m.reconsume_times < max_reconsume_times
    )
    if not retry:
        return OrderlyOutcome(OrderlyAction.DEAD_LETTER, dead=dead)
    suspend = context.suspend_current_queue_time_millis
    return OrderlyOutcome(
        OrderlyAction.SUSPEND,
        retry=retry,
        dead=dead,
        suspend_ms=suspend if suspend >= 0 else DEFAULT_SUSPEND_MS,
    )
