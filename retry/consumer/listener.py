"""Listeners, per-row consume results, and the middleware chain around a listener.

A consume call goes through the consumer's middleware (outermost first) and
ends in the user's listener. Each layer answers with a :class:`BatchResult`:
per message of the call, acknowledged (the default), failed (sent back /
retried, with its own delay level) or dead (to ``%DLQ%<group>`` now). The
listener itself answers in RocketMQ's terms — a status and ``ack_index`` — and
:meth:`BatchResult.from_concurrently` / :meth:`BatchResult.from_orderly`
translate that, so RocketMQ's batch semantics hold unless a middleware knows
better.

A listener that writes its messages one by one may say which of them reached
the sink with :func:`mark_done`; a middleware that completes keys (idem's
dedup hook) reads those marks even when the batch as a whole failed.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from idem.retry.consumer.topics import MessageQueue
from idem.retry.message import MessageExt
from idem.retry.status import (
    ACK_INDEX_ALL,
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
)

log = logging.getLogger(__name__)

MAX_SUSPEND_MS = 60_000
"""The longest pause an orderly listener may ask for (``suspend_current_queue_time_millis``,
the same bound as the consumer setting); ``-1`` means the setting's value."""

MessageListenerConcurrently = Callable[
    [Sequence[MessageExt], ConsumeConcurrentlyContext], "ConsumeConcurrentlyStatus | None"
]
"""``consumeMessage(msgs, context)`` of a concurrent listener."""

MessageListenerOrderly = Callable[
    [Sequence[MessageExt], ConsumeOrderlyContext], "ConsumeOrderlyStatus | None"
]
"""``consumeMessage(msgs, context)`` of an orderly listener."""


@dataclass(frozen=True, slots=True)
class Failure:
    """Why a message failed and at which delay level it should come back (0: the ladder).

    ``transient``: not the listener's failure but "not now" (a key busy elsewhere, the
    dedup store unreachable) — a broadcasting consumer consumes it again locally
    instead of dropping it. ``counts=False``: the send-back keeps ``reconsume_times``
    (:meth:`~idem.retry.RetryEngine.send_back_busy`), so a key that is merely busy is
    never dead-lettered for it.
    """

    reason: str
    delay_level: int = 0
    transient: bool = False
    counts: bool = True


OUTAGE_DELAY_LEVEL = 3
"""The delay level (10 s by default) of a message sent back because idem's own dedup store
failed it (a claim or a commit), not its listener."""


def store_outage(reason: str) -> Failure:
    """The failure of a message that idem's dedup store could not claim or commit.

    Not the listener's failure: the message comes back after :data:`OUTAGE_DELAY_LEVEL`
    with ``reconsume_times`` unchanged, so an outage of the store, however long, never
    dead-letters a healthy message.
    """
    return Failure(reason, OUTAGE_DELAY_LEVEL, transient=True, counts=False)


class Deferred:
    """Acknowledgements that become final later (e.g. once a group commit is durable).

    Until it resolves, the consumer keeps the messages' offsets back and does not
    acknowledge them; it resolves with ``None`` (done) or the :class:`Failure`
    every one of its messages then gets. Callbacks run once, in the resolving
    thread (at once when added after the resolution); :meth:`wait` returns once
    the callbacks added before the resolution have run (e.g. the dedup hook gave
    a failed commit's keys back).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._resolved = False
        self._settled = False  # resolved, and the callbacks of that moment have run
        self._failure: Failure | None = None
        self._callbacks: list[Callable[[Failure | None], None]] = []

    @property
    def resolved(self) -> bool:
        """Whether the outcome is known."""
        with self._cond:
            return self._resolved

    def resolve(self, failure: Failure | None = None) -> None:
        """Settle: ``None`` means done; a second call is ignored."""
        with self._cond:
            if self._resolved:
                return
            self._resolved, self._failure = True, failure
            callbacks, self._callbacks = self._callbacks, []
        try:
            for callback in callbacks:
                _run_callback(callback, failure)
        finally:
            with self._cond:
                self._settled = True
                self._cond.notify_all()

    def on_resolved(self, callback: Callable[[Failure | None], None]) -> None:
        """Call ``callback(failure)`` when resolved (now, if it already is)."""
        with self._cond:
            if not self._resolved:
                self._callbacks.append(callback)
                return
            failure = self._failure
        _run_callback(callback, failure)

    def wait(self, timeout: float | None = None) -> Failure | None:
        """Block until resolved and its callbacks have run; return its failure (``None``:
        done). Raises ``TimeoutError``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._settled, timeout):
                raise TimeoutError("deferred acknowledgement not resolved in time")
            return self._failure


def _run_callback(callback: Callable[[Failure | None], None], failure: Failure | None) -> None:
    try:
        callback(failure)
    except Exception:  # one consumer's bookkeeping must not stop the others'
        log.exception("a deferred acknowledgement callback failed")


@dataclass(slots=True)
class BatchResult:
    """Per-message outcome of one consume call (indices into its messages)."""

    size: int
    failed: dict[int, Failure] = field(default_factory=dict)
    dead: dict[int, str] = field(default_factory=dict)
    suspend_ms: int = -1
    """Orderly: how long to pause the queue after a failure (``-1``: the consumer's default)."""
    pending: dict[int, Deferred] = field(default_factory=dict)
    """Acknowledged indices that are final only once their :class:`Deferred` resolves
    (offered only when :attr:`ConsumeScope.defer_acks` is set)."""

    @property
    def acked(self) -> list[int]:
        """Indices neither failed nor dead (including pending ones)."""
        return [i for i in range(self.size) if i not in self.failed and i not in self.dead]

    @property
    def ok(self) -> bool:
        """Whether every message was acknowledged."""
        return not self.failed and not self.dead

    @classmethod
    def all_failed(cls, size: int, exc: BaseException) -> BatchResult:
        """Every message failed with ``exc`` (the call raised instead of answering): sent
        back or retried, counted as a reconsume, so a message that always raises ends in
        the DLQ with this reason."""
        return cls(size, failed=dict.fromkeys(range(size), Failure(f"{type(exc).__name__}: {exc}")))

    @classmethod
    def from_concurrently(
        cls,
        size: int,
        status: ConsumeConcurrentlyStatus,
        context: ConsumeConcurrentlyContext,
        reason: str = "RECONSUME_LATER",
    ) -> BatchResult:
        """``processConsumeResult``: success acks ``0..ack_index``, failure acks none."""
        if status is ConsumeConcurrentlyStatus.CONSUME_SUCCESS:
            first_failed = min(context.ack_index, size - 1) + 1
        else:
            first_failed = 0
        failure = Failure(reason, context.delay_level_when_next_consume)
        return cls(size, failed=dict.fromkeys(range(first_failed, size), failure))

    @classmethod
    def from_orderly(
        cls,
        size: int,
        status: ConsumeOrderlyStatus,
        context: ConsumeOrderlyContext,
        reason: str = "SUSPEND_CURRENT_QUEUE_A_MOMENT",
    ) -> BatchResult:
        """Orderly: success acks the batch; a suspend fails all of it (retried in place)."""
        if status is ConsumeOrderlyStatus.SUCCESS:
            return cls(size)
        return cls(
            size,
            failed=dict.fromkeys(range(size), Failure(reason)),
            suspend_ms=context.suspend_current_queue_time_millis,
        )

    def subset(self, indices: Sequence[int], size: int) -> BatchResult:
        """This result mapped into a larger call where message ``k`` was ``indices[k]``."""
        return BatchResult(
            size,
            failed={indices[k]: f for k, f in self.failed.items()},
            dead={indices[k]: r for k, r in self.dead.items()},
            suspend_ms=self.suspend_ms,
            pending={indices[k]: d for k, d in self.pending.items()},
        )


@dataclass(frozen=True, slots=True)
class ConsumeScope:
    """What a middleware knows about the call it wraps."""

    mq: MessageQueue
    client_id: str
    orderly: bool
    defer_acks: bool = False
    """Whether the caller honours :attr:`BatchResult.pending` (else a layer must finish
    its work before it returns)."""


CallNext = Callable[[Sequence[MessageExt]], BatchResult]
"""The rest of the chain: consume these messages, answer per message."""


class Middleware(Protocol):
    """A layer around the listener (dedup, metrics, fault injection...)."""

    def __call__(
        self, messages: Sequence[MessageExt], scope: ConsumeScope, call_next: CallNext
    ) -> BatchResult:
        """Consume ``messages`` (usually by calling ``call_next`` with some of them)."""
        ...


def chain(middleware: Sequence[Middleware], terminal: CallNext, scope: ConsumeScope) -> CallNext:
    """``terminal`` wrapped by ``middleware`` (the first one outermost)."""
    call = terminal
    for layer in reversed(middleware):

        def bound(
            messages: Sequence[MessageExt], _layer: Middleware = layer, _next: CallNext = call
        ) -> BatchResult:
            return _layer(messages, scope, _next)

        call = bound
    return call


def invoke_concurrently(
    listener: MessageListenerConcurrently, messages: Sequence[MessageExt]
) -> BatchResult:
    """Call a concurrent listener; an exception or ``None`` means ``RECONSUME_LATER``."""
    if not messages:
        return BatchResult(0)
    context = ConsumeConcurrentlyContext()
    reason = "RECONSUME_LATER"
    try:
        raw = listener(messages, context)
        status = (
            ConsumeConcurrentlyStatus(raw)
            if raw is not None
            else ConsumeConcurrentlyStatus.RECONSUME_LATER
        )
    except Exception as exc:  # the listener's own failure: logged, never propagated
        log.warning("listener failed on %d message(s)", len(messages), exc_info=True)
        status = ConsumeConcurrentlyStatus.RECONSUME_LATER
        reason = f"{type(exc).__name__}: {exc}"
    problem = _whole_problem("ack_index", context.ack_index, -1, ACK_INDEX_ALL) or _whole_problem(
        "delay_level_when_next_consume", context.delay_level_when_next_consume
    )
    if problem is not None:  # the listener's mistake fails the batch, naming the field
        log.warning("listener set a bad context value: %s", problem)
        status, reason = ConsumeConcurrentlyStatus.RECONSUME_LATER, f"ConfigError: {problem}"
        context = ConsumeConcurrentlyContext()
    return BatchResult.from_concurrently(len(messages), status, context, reason)


def invoke_orderly(listener: MessageListenerOrderly, messages: Sequence[MessageExt]) -> BatchResult:
    """Call an orderly listener; an exception or ``None`` suspends the queue."""
    if not messages:
        return BatchResult(0)
    context = ConsumeOrderlyContext()
    reason = "SUSPEND_CURRENT_QUEUE_A_MOMENT"
    try:
        raw = listener(messages, context)
        status = (
            ConsumeOrderlyStatus(raw)
            if raw is not None
            else ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        )
    except Exception as exc:
        log.warning("orderly listener failed on %d message(s)", len(messages), exc_info=True)
        status = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        reason = f"{type(exc).__name__}: {exc}"
    problem = _whole_problem(
        "suspend_current_queue_time_millis",
        context.suspend_current_queue_time_millis,
        -1,
        MAX_SUSPEND_MS,
    )
    if problem is not None:  # suspended with the default pause, retried, then dead-lettered
        log.warning("orderly listener set a bad context value: %s", problem)
        status = ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT
        reason, context = f"ConfigError: {problem}", ConsumeOrderlyContext()
    return BatchResult.from_orderly(len(messages), status, context, reason)


def _whole_problem(
    name: str, value: object, low: int | None = None, high: int | None = None
) -> str | None:
    """Why a context value a listener set is unusable (``None`` when it is fine)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name}: {value!r} is not a whole number"
    if (low is not None and value < low) or (high is not None and value > high):
        return f"{name}: {value} is outside {low}..{high}"
    return None


# -- per-row marks ------------------------------------------------------------------------


class DoneMarks:
    """Messages a listener reported as written, by msg id and queue offset."""

    def __init__(self) -> None:
        self.used = False
        self.done: set[tuple[str, int]] = set()

    def mark(self, message: MessageExt) -> None:
        """Record ``message`` as having reached the sink."""
        self.used = True
        self.done.add((message.msg_id, message.queue_offset))

    def is_done(self, message: MessageExt) -> bool:
        """Whether ``message`` was marked."""
        return (message.msg_id, message.queue_offset) in self.done


_MARKS: contextvars.ContextVar[DoneMarks | None] = contextvars.ContextVar(
    "idem_consume_marks", default=None
)


def mark_done(message: MessageExt) -> None:
    """Say that ``message`` reached the sink (a no-op when no middleware listens)."""
    marks = _MARKS.get()
    if marks is not None:
        marks.mark(message)


@contextmanager
def collecting_marks() -> Iterator[DoneMarks]:
    """Collect :func:`mark_done` calls made inside the block (in this thread)."""
    marks = DoneMarks()
    token = _MARKS.set(marks)
    try:
        yield marks
    finally:
        _MARKS.reset(token)


class DefaultMessageListenerConcurrently:
    """RocketMQ's ``DefaultMessageListenerConcurrently``: handle messages one by one.

    The first exception stops the batch and returns ``RECONSUME_LATER`` — so the
    whole batch is sent back, including the messages already handled (redelivery
    case C2), exactly as RocketMQ does. Each handled message is reported with
    :func:`mark_done`, which idem's dedup hook uses to complete it anyway.
    """

    def __init__(
        self,
        handle_message: Callable[[MessageExt], object],
        *,
        delay_level_when_next_consume: int = 0,
    ) -> None:
        self.handle_message = handle_message
        self.delay_level_when_next_consume = delay_level_when_next_consume

    def __call__(
        self, messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        for message in messages:
            try:
                self.handle_message(message)
            except Exception:
                log.warning(
                    "consume message failed. msg_id=%s topic=%s reconsume_times=%d",
                    message.msg_id,
                    message.topic,
                    message.reconsume_times,
                    exc_info=True,
                )
                context.delay_level_when_next_consume = self.delay_level_when_next_consume
                return ConsumeConcurrentlyStatus.RECONSUME_LATER
            mark_done(message)
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS
