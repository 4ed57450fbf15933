"""Named moments of the consume and send-back paths, for crash tests.

A process that dies at one of these moments leaves a different state behind, so a
recovery is checked at each. Observers are injected (``RetryEngine(on_stage=...)``,
``DedupMiddleware(on_point=...)``); none is installed by default, and nothing is
looked up on the way (no environment variable is read per message).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

from idem.retry.message import MessageExt


class SendBackStage(StrEnum):
    """The steps of :meth:`~idem.retry.RetryEngine.send_back` and
    :meth:`~idem.retry.RetryEngine.ack`, in the order they happen."""

    DEAD_LETTERED = "dead_lettered"
    """The dead letters are in ``%DLQ%<group>``; their ``DEAD`` events not journaled yet."""
    JOURNALED = "journaled"
    """The send-back's events are in the Delta retry journal; Redis not told yet."""
    APPLIED = "applied"
    """Redis scheduled the retries; the caller has not acknowledged the originals yet."""
    FALLBACK = "fallback"
    """Redis refused the journal's sync; the client-side resend comes next."""
    RESUBMIT = "resubmit"
    """Every path failed: the caller consumes the messages again later."""
    ACK_JOURNALED = "ack_journaled"
    """Consumed retries' ``ACKED`` events are journaled; Redis still holds them pending."""
    ACKED = "acked"
    """Consumed retries are acknowledged in the journal and removed from Redis."""


class StageObserver(Protocol):
    """Told when a send-back or an acknowledgement reaches a :class:`SendBackStage`.

    Called on the thread doing the send-back, between two of its steps, with the
    messages of that step (never with none). It may raise (the exception propagates
    to the caller, as a crash would stop it there) or end the process; it must not
    write to the journal, the DLQ or Redis, nor keep the messages.
    """

    def __call__(self, stage: SendBackStage, messages: Sequence[MessageExt]) -> None:
        """``messages`` got to ``stage``."""


class ConsumePoint(StrEnum):
    """The moments between a consumer's listener and its group commit."""

    AFTER_LISTENER = "after_listener"
    """The listener returned (the sink holds its writes); the keys are not queued for
    the group commit yet: the ledger does not hold them, their claims are live."""
    LEDGER_COMMITTED = "ledger_committed"
    """The group commit is durable in the ledger and Redis knows the keys are done; the
    consumer has not moved its offsets (nor acknowledged retries) past them yet."""


class ConsumeObserver(Protocol):
    """Told when consumed messages reach a :class:`ConsumePoint`.

    ``after_listener`` is called on the consume thread, ``ledger_committed`` on the group
    committer's thread, with the messages concerned. It may end the process; it must not
    raise (a group commit that raised would count as failed after it was durable), touch
    Redis or the ledger, or block: the group's other calls wait behind it.
    """

    def __call__(self, point: ConsumePoint, messages: Sequence[MessageExt]) -> None:
        """``messages`` got to ``point``."""
