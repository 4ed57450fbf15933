"""``RetryEngine``: the resend path of one consumer group behind one object.

``send_back`` follows RocketMQ's order of paths:

1. the broker's send-back: dead letters are written to ``%DLQ%<group>``, every
   event is appended to the Delta retry journal (one commit, with the caller's
   ``app_id``/``txn_version``), then applied to Redis — bounded retries each;
2. when Redis does not answer, or answers with an error (``OOM`` when it is
   full, ``MISCONF``, ...), the client resends the messages itself straight
   into the schedule queues (the same msg ids, so nothing is stored twice);
3. when that fails too, the caller is told to re-submit after 5 s. The journal
   already holds the messages, so even a caller that never re-submits loses
   nothing: the next sync (any engine, the schedule service) applies them.

Nothing is reported done on an unknown outcome (a timeout counts as a failure).
Elsewhere a failure of Redis (an outage or an error reply) surfaces as
:class:`~idem.errors.StoreUnavailable`, never as redis-py's own exceptions.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import redis

from idem import metrics
from idem.clock import SYSTEM_CLOCK, Clock
from idem.config import IdemConfig
from idem.errors import LedgerError, StoreUnavailable
from idem.redis_client import check_eviction_policy, connect
from idem.redis_cluster import RedisClient
from idem.retry.combiner import CallCombiner
from idem.retry.crash_points import SendBackStage, StageObserver
from idem.retry.dlq import DeadLetterTable
from idem.retry.faults import DEFAULT_FAULT_TOLERANCE, FaultTolerance
from idem.retry.journal import (
    SMALL_FILES_TO_COMPACT,
    JournalBase,
    JournalEvent,
    JournalEventType,
    RetryJournal,
)
from idem.retry.message import MessageConst, MessageExt
from idem.retry.policy import RetryPolicy
from idem.retry.schedule import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_MAX_IDLE_MS,
    DEFAULT_SYNC_INTERVAL_MS,
    ScheduleService,
)
from idem.retry.sendback import (
    BUSY_DELAY_LEVEL,
    DeadLettered,
    Scheduled,
    SendBackDecision,
    SendBackProcessor,
)
from idem.retry.store import ApplyResult, ScheduleStats, ScheduleStore
from idem.retry.topic import DamagedEntry, RetryTopic, message_timeup, reset_retry_topic

T = TypeVar("T")
log = logging.getLogger(__name__)

DEFAULT_COMPACT_INTERVAL_MS = 6 * 3_600_000
"""How often a running schedule service compacts its group's retry journal (one of them)."""
FILE_COMPACTION_INTERVAL_MS = 30_000
"""At most how often one process of a group compacts the journal's files."""


class SendBackStatus(StrEnum):
    """Where a failed message ended up."""

    SCHEDULED = "SCHEDULED"
    """Journaled and scheduled in Redis by the broker-side send-back."""
    DEAD = "DEAD"
    """In ``%DLQ%<group>`` (and journaled)."""
    FALLBACK = "FALLBACK"
    """Journaled; the send-back failed and the client-side resend scheduled it."""
    RESUBMIT_LATER = "RESUBMIT_LATER"
    """Every path failed: consume it again locally at ``resubmit_at_ms``."""


@dataclass(frozen=True, slots=True)
class SendBackOutcome:
    """The fate of one failed message."""

    msg_id: str
    origin_msg_id: str
    status: SendBackStatus
    new_msg_id: str | None = None
    delay_level: int = 0
    due_ms: int | None = None
    resubmit_at_ms: int | None = None
    reason: str = ""
    resend: MessageExt | None = None
    """``RESUBMIT_LATER`` after the journal took the message: its journaled resend as the
    retry topic would deliver it, at the original's queue and offset. Consume *this*
    locally in the original's place (and acknowledge it with :meth:`RetryEngine.ack`):
    it is the one retry chain of the failed delivery, so a failure sends it back in place
    of the journaled copy, and its acknowledgement removes that copy."""


@dataclass(frozen=True, slots=True)
class SendBackResult:
    """Per-message outcomes of one :meth:`RetryEngine.send_back`, in input order."""

    outcomes: tuple[SendBackOutcome, ...]

    def _with(self, status: SendBackStatus) -> tuple[SendBackOutcome, ...]:
        return tuple(o for o in self.outcomes if o.status is status)

    @property
    def scheduled(self) -> tuple[SendBackOutcome, ...]:
        """Scheduled by the broker-side path."""
        return self._with(SendBackStatus.SCHEDULED)

    @property
    def dead(self) -> tuple[SendBackOutcome, ...]:
        """Dead-lettered."""
        return self._with(SendBackStatus.DEAD)

    @property
    def fallback(self) -> tuple[SendBackOutcome, ...]:
        """Scheduled by the client-side resend."""
        return self._with(SendBackStatus.FALLBACK)

    @property
    def resubmit(self) -> tuple[SendBackOutcome, ...]:
        """To be consumed again locally (nothing acknowledged)."""
        return self._with(SendBackStatus.RESUBMIT_LATER)

    @property
    def acknowledged(self) -> bool:
        """Whether every message is safely scheduled or dead (the batch may be committed)."""
        return not self.resubmit


@dataclass(frozen=True, slots=True)
class RetryStats:
    """One group's resend path at a glance."""

    redis: ScheduleStats
    journal_version: int | None


class RetryEngine:
    """Send-back, retry topic, schedule and dead letters of ``config.group``.

    ``on_stage`` is told when a send-back or an acknowledgement reaches each of its
    steps (:class:`~idem.retry.crash_points.SendBackStage`); crash tests stop there.
    """

    def __init__(
        self,
        config: IdemConfig,
        *,
        client: RedisClient | None = None,
        clock: Clock = SYSTEM_CLOCK,
        policy: RetryPolicy | None = None,
        faults: FaultTolerance = DEFAULT_FAULT_TOLERANCE,
        storage_options: Mapping[str, str] | None = None,
        on_stage: StageObserver | None = None,
    ) -> None:
        self.config = config
        self.group = config.group
        self.clock = clock
        self.faults = faults
        self.on_stage = on_stage
        self.client = client if client is not None else connect(config.redis_url)
        self.store = ScheduleStore(self.client, self.group)
        self.topic = RetryTopic(
            self.store,
            reclaim_idle_ms=config.consume_timeout_ms,
            on_damaged=self.dead_letter_damaged,
        )
        self.journal = RetryJournal(
            config.resolved_journal_path,
            self.group,
            storage_options=storage_options,
            faults=faults,
        )
        self.dlq = DeadLetterTable(
            config.resolved_dlq_path,
            self.group,
            clock=clock,
            storage_options=storage_options,
            faults=faults,
        )
        self.processor = SendBackProcessor(
            self.group,
            policy=policy,
            levels=config.delay_levels,
            max_reconsume_times=config.max_reconsume_times,
            max_message_bytes=config.max_message_bytes,
            clock=clock,
        )
        self._combined: CallCombiner[SendBackDecision, SendBackOutcome] = CallCombiner()
        # the engine's own tick() checks the cursor every time (one GET), see _maybe_sync
        self._service = ScheduleService(
            self.store, clock=clock, sync=self._maybe_sync, sync_interval_ms=0
        )
        self._last_sync_ms: int | None = None

    def check(self) -> None:
        """Start-up check: Redis must not evict keys (an evicted schedule entry loses a retry)."""
        check_eviction_policy(self.client)

    def _redis(self, fn: Callable[[], T], *, what: str, attempts: int | None = None) -> T:
        """``fn`` against Redis with the bounded retries of ``faults``; any failure, an outage
        or an error reply (``OOM`` from a full Redis, ``MISCONF``...), ends as
        :class:`StoreUnavailable` (an error reply is not retried: it would answer the same)."""
        try:
            return self.faults.redis(fn, what=what, attempts=attempts)
        except redis.exceptions.RedisError as exc:
            metrics.count("redis_errors", self.group, component="retry")
            raise StoreUnavailable(
                f"{what} failed: Redis answered {type(exc).__name__}: {exc}"
            ) from exc

    def _check_journal_followed(self) -> bool:
        """Refuse (:class:`~idem.retry.errors.JournalError`) before anything is journaled when
        Redis follows another journal table: each re-submitted attempt would otherwise be
        journaled again, to be scheduled all at once after the rebuild. A Redis that cannot
        answer is no reason to stop: the send-back journals and falls back as usual.
        Returns whether Redis was found bound to this journal (its sync need not ask again)."""
        try:
            return self._redis(
                lambda: self.journal.follow(self.store), what="journal check", attempts=1
            )
        except StoreUnavailable:
            return False

    def _stage(self, stage: SendBackStage, messages: Sequence[MessageExt]) -> None:
        if self.on_stage is not None and messages:
            self.on_stage(stage, messages)

    # -- send-back -----------------------------------------------------------------------

    def _event(self, decision: SendBackDecision, now: int) -> JournalEvent:
        original = decision.original
        if isinstance(decision, DeadLettered):
            return JournalEvent(
                JournalEventType.DEAD,
                original.msg_id,
                original.origin_msg_id,
                original.keys,
                original.reconsume_times,
                -1,
                at_ms=now,
            )
        message = decision.message
        return JournalEvent(
            JournalEventType.SCHEDULED,
            message.msg_id,
            message.origin_msg_id,
            message.keys,
            message.reconsume_times,
            decision.level,
            decision.queue_id,
            decision.due_ms,
            replaces=original.msg_id if _may_be_live(original) else None,
            wire=decision.wire,
            at_ms=now,
        )

    def send_back(
        self,
        messages: Sequence[MessageExt],
        *,
        delay_level: int = 0,
        errors: Mapping[str, str | BaseException] | None = None,
        app_id: str | None = None,
        txn_version: int | None = None,
    ) -> SendBackResult:
        """Send failed messages back: schedule a retry, or dead-letter them.

        ``delay_level``: ``-1`` dead-letters now, ``0`` lets the policy choose
        (``3 + reconsume_times``), ``> 0`` is the level. ``errors`` maps a msg id to
        its failure (recorded in the message's history and the DLQ row). A message
        over ``config.max_message_bytes`` is dead-lettered, never scheduled.
        ``app_id``/``txn_version`` journal a batch once: a replay of it adds only the
        messages the first attempt did not send back (see ``RetryJournal.append_batch``).
        Without them, concurrent calls (a consumer's consume threads) are combined: the
        messages of calls made while another is under way share the next journal commit
        and Redis apply (:class:`~idem.retry.combiner.CallCombiner`), each call still
        getting its own messages' outcomes.
        """
        errors = errors or {}
        now = self.clock.now_ms()  # one instant: the call's messages fall due together
        decisions = [
            self.processor.process(
                m, delay_level=delay_level, error=errors.get(m.msg_id), now_ms=now
            )
            for m in messages
        ]
        return self._send(decisions, app_id=app_id, txn_version=txn_version)

    def send_back_busy(
        self,
        messages: Sequence[MessageExt],
        *,
        delay_level: int = BUSY_DELAY_LEVEL,
        app_id: str | None = None,
        txn_version: int | None = None,
    ) -> SendBackResult:
        """Send back messages whose key is *busy* (another owner holds it): not a failure.

        A key another owner holds with a live lease must come back after a short
        delay, never be dropped, and never be dead-lettered for being busy: each
        message is scheduled at ``delay_level`` (default 1, i.e. 1 s; clamped to
        the ladder) with ``reconsume_times`` and its failure history unchanged, so
        it does not count toward ``max_reconsume_times``. The new message gets a
        msg id derived from the copy it replaces (a repeat names the same message)
        and, when the copy came from the retry topic, replaces it there. Same
        paths, journal and result as :meth:`send_back` (never ``DEAD``, except for a
        message over ``max_message_bytes``, which no path could schedule);
        ``app_id``/``txn_version`` journal a batch once, as for :meth:`send_back`.
        """
        now = self.clock.now_ms()
        decisions: list[SendBackDecision] = [
            self.processor.process_busy(m, delay_level=delay_level, now_ms=now) for m in messages
        ]
        return self._send(decisions, app_id=app_id, txn_version=txn_version)

    def _send(
        self,
        decisions: Sequence[SendBackDecision],
        *,
        app_id: str | None,
        txn_version: int | None,
    ) -> SendBackResult:
        if app_id is None and txn_version is None:
            # a consumer's send-backs: concurrent ones share one journal commit and apply
            outcomes = self._combined.call(decisions, lambda group: self._place(group).outcomes)
            return SendBackResult(tuple(outcomes))
        return self._place(decisions, app_id=app_id, txn_version=txn_version)

    def _place(
        self,
        decisions: Sequence[SendBackDecision],
        *,
        app_id: str | None = None,
        txn_version: int | None = None,
    ) -> SendBackResult:
        """Dead-letter, journal and schedule ``decisions`` in one commit and one apply."""
        now = self.clock.now_ms()
        messages = [d.original for d in decisions]
        dead = [d for d in decisions if isinstance(d, DeadLettered)]
        scheduled = [d for d in decisions if isinstance(d, Scheduled)]
        events = [self._event(d, now) for d in decisions]
        try:
            followed = self._check_journal_followed()
            if dead:
                self.dlq.write([d.letter for d in dead], app_id=app_id, txn_version=txn_version)
                self._stage(SendBackStage.DEAD_LETTERED, [d.original for d in dead])
            written = self.journal.append_batch(events, app_id=app_id, txn_version=txn_version)
            self._stage(SendBackStage.JOURNALED, list(messages))
        except LedgerError:
            log.warning(
                "send-back of %d message(s): Delta unavailable; re-submit later",
                len(messages),
                exc_info=True,
            )
            self._stage(SendBackStage.RESUBMIT, list(messages))
            return self._result(decisions, SendBackStatus.RESUBMIT_LATER, now, journaled=False)

        try:
            own = None if written.version is None else written.as_own()
            self._sync_or_raise(own, followed=followed)
            status = SendBackStatus.SCHEDULED
            self._stage(SendBackStage.APPLIED, [d.original for d in scheduled])
        except StoreUnavailable:
            # Redis away, or refusing (full, MISCONF, a slice of the journal it cannot take):
            # the events are journaled, so this is the broker's failed send-back, and the
            # client-side resend of our own ops (then "re-submit later") follows as usual
            self._stage(SendBackStage.FALLBACK, [d.original for d in scheduled])
            try:
                ops = [op for e in events for op in e.ops()]
                self._redis(
                    lambda: self.store.apply_direct(ops),
                    what="client-side resend to the retry topic",
                    attempts=self.faults.fallback_attempts,
                )
                status = SendBackStatus.FALLBACK
            except StoreUnavailable:
                log.warning(
                    "send-back of %d message(s): Redis unavailable; journaled, "
                    "re-submit after %d ms",
                    len(scheduled),
                    self.faults.resubmit_delay_ms,
                )
                self._stage(SendBackStage.RESUBMIT, [d.original for d in scheduled])
                status = SendBackStatus.RESUBMIT_LATER
        result = self._result(decisions, status, now, journaled=True)
        # what a replayed batch had journaled already was counted by its first attempt
        _count_outcomes(self.group, result.outcomes, {e.msg_id for e in written.events})
        return result

    def _result(
        self,
        decisions: Sequence[SendBackDecision],
        status: SendBackStatus,
        now: int,
        *,
        journaled: bool,
    ) -> SendBackResult:
        resubmit_at = now + self.faults.resubmit_delay_ms
        outcomes: list[SendBackOutcome] = []
        for d in decisions:
            original = d.original
            if isinstance(d, DeadLettered) and journaled:
                outcomes.append(
                    SendBackOutcome(
                        original.msg_id,
                        original.origin_msg_id,
                        SendBackStatus.DEAD,
                        delay_level=-1,
                        reason=d.letter.reason,
                    )
                )
            elif isinstance(d, DeadLettered) or not journaled:
                outcomes.append(
                    SendBackOutcome(
                        original.msg_id,
                        original.origin_msg_id,
                        SendBackStatus.RESUBMIT_LATER,
                        resubmit_at_ms=resubmit_at,
                    )
                )
            elif status is SendBackStatus.RESUBMIT_LATER:
                outcomes.append(
                    SendBackOutcome(
                        original.msg_id,
                        original.origin_msg_id,
                        SendBackStatus.RESUBMIT_LATER,
                        new_msg_id=d.message.msg_id,
                        delay_level=d.level,
                        due_ms=d.due_ms,
                        resubmit_at_ms=resubmit_at,
                        resend=self._local_resend(d, now),
                    )
                )
            else:
                assert isinstance(d, Scheduled)
                outcomes.append(
                    SendBackOutcome(
                        original.msg_id,
                        original.origin_msg_id,
                        status,
                        new_msg_id=d.message.msg_id,
                        delay_level=d.level,
                        due_ms=d.due_ms,
                    )
                )
        return SendBackResult(tuple(outcomes))

    def _local_resend(self, decision: Scheduled, now: int) -> MessageExt:
        """The journaled resend as ``%RETRY%<group>`` would deliver it, in the original's
        queue and offset (the consumer's process queue holds it there)."""
        original = decision.original
        landed = message_timeup(decision.message, queue_offset=0, store_timestamp=now)
        return reset_retry_topic(landed, self.group).evolve(
            queue_id=original.queue_id, queue_offset=original.queue_offset
        )

    def dead_letter(
        self,
        messages: Sequence[MessageExt],
        *,
        reason: str | None = None,
        errors: Mapping[str, str | BaseException] | None = None,
        reasons: Mapping[str, str] | None = None,
        app_id: str | None = None,
        txn_version: int | None = None,
    ) -> SendBackResult:
        """Dead-letter ``messages`` now (delay level -1), e.g. bad input naming the field.

        The DLQ row's reason is the policy's ("dead-letter requested" with the error)
        unless ``reasons`` maps the message's msg id to one, e.g. a limit the caller
        applied itself (an orderly queue's reconsume limit).
        """
        if errors is None and reason is not None:
            errors = {m.msg_id: reason for m in messages}
        errors, reasons = errors or {}, reasons or {}
        now = self.clock.now_ms()
        decisions = [
            self.processor.process(
                m,
                delay_level=-1,
                error=errors.get(m.msg_id),
                reason=reasons.get(m.msg_id),
                now_ms=now,
            )
            for m in messages
        ]
        return self._send(decisions, app_id=app_id, txn_version=txn_version)

    def dead_letter_damaged(self, damaged: Sequence[DamagedEntry]) -> int:
        """Dead-letter entries of the retry topic that are not messages, with their reasons,
        then remove them from the topic (by every read that finds one, see
        :class:`RetryTopic`); returns how many were removed. One not dead-lettered or not
        removed stays pending, to be dead-lettered when read again (still as one row).
        """
        if not damaged:
            return 0
        reasons = {d.message.msg_id: d.reason for d in damaged}
        result = self.dead_letter([d.message for d in damaged], errors=reasons, reasons=reasons)
        dead = {o.msg_id for o in result.dead}
        done = [d.entry_id for d in damaged if d.message.msg_id in dead]
        for entry in damaged:
            fate = "dead-lettered" if entry.message.msg_id in dead else "left pending"
            log.warning("%s: %s", entry.reason, fate)
        if not done:
            return 0
        try:
            return self._redis(
                lambda: self.topic.remove_entries(done),
                what=f"remove dead-lettered entries from {self.topic.name}",
            )
        except StoreUnavailable:
            # the good messages of the same read must still reach the consumer; the entries
            # are read again (XAUTOCLAIM, the Spark stream's next commit), the DLQ unchanged
            log.warning("dead-lettered entries stay in %s for now", self.topic.name, exc_info=True)
            return 0

    # -- journal <-> Redis ---------------------------------------------------------------

    def _sync_or_raise(
        self, own: tuple[int, Sequence[JournalEvent]] | None = None, *, followed: bool = False
    ) -> ApplyResult:
        result = self._redis(
            lambda: self.journal.sync(self.store, own=own, followed=followed),
            what="apply the retry journal to Redis",
        )
        self._last_sync_ms = self.clock.now_ms()
        return result

    def sync(self) -> ApplyResult:
        """Bring Redis up to date with the journal (a full rebuild if Redis lost it)."""
        return self._sync_or_raise()

    def rebuild(self) -> ApplyResult:
        """Clear the group's Redis side and rebuild it from the journal (``idem retry rebuild``),
        dead-letterings a crash cut short finished first (:meth:`settle_dead_letters`)."""
        self.settle_dead_letters()
        return self._redis(
            lambda: self.journal.rebuild(self.store), what="rebuild from the retry journal"
        )

    def recover(self) -> ApplyResult:
        """Bring the group back after a crash of one of its processes: finish the
        dead-letterings it cut short (:meth:`settle_dead_letters`), then sync Redis with
        the journal. Call it when a process of the group starts, before it consumes."""
        self.settle_dead_letters()
        return self.sync()

    def settle_dead_letters(self) -> int:
        """Journal the death of every message that ``%DLQ%<group>`` holds ``DEAD`` but the
        journal still holds live; returns how many.

        A send-back writes the dead letter first and journals its ``DEAD`` event after it;
        a process killed between the two leaves the message both dead and on the retry
        ladder, to be consumed again (done *and* dead). The DLQ row is the decision that
        was made, so the death is finished, never undone: the message leaves the ladder at
        the next sync. A message is only ever scheduled again under a new msg id (a replay
        of its dead letter too), so a ``DEAD`` row whose msg id is live is always such a
        cut-short dead-lettering. Reads the journal since its newest base and, of the DLQ, the
        ids of the dead rows among the live messages.
        """
        if not self.dlq.exists():
            return 0
        live = self.journal.live()
        if not live:
            return 0
        now = self.clock.now_ms()
        events = [
            JournalEvent(
                JournalEventType.DEAD,
                letter.msg_id,
                letter.origin_msg_id,
                letter.key,
                letter.reconsume_times,
                -1,
                at_ms=now,
            )
            for letter in self.dlq.dead_among(live)
            if live[letter.msg_id].origin_msg_id == letter.origin_msg_id
        ]
        if events:
            self.journal.append(events)
            log.warning(
                "%d dead letter(s) of %s were not journaled (a send-back cut short); "
                "journaled now, they leave the retry ladder",
                len(events),
                self.group,
            )
        return len(events)

    def maybe_compact_journal(self, interval_ms: int) -> JournalBase | None:
        """Compact the journal unless a process of the group did within ``interval_ms``
        (a marker in Redis with that TTL decides, so one process compacts per interval)."""
        if interval_ms < 1:
            raise ValueError(f"interval_ms: must be >= 1, got {interval_ms}")
        due = self._redis(
            lambda: self.store.client.set(
                self.store.keys.compacted, self.clock.now_ms(), nx=True, px=interval_ms
            ),
            what="claim the journal compaction",
        )
        return self.compact_journal() if due else None

    def maybe_compact_journal_files(self) -> int:
        """Rewrite the journal's small files into few once :data:`SMALL_FILES_TO_COMPACT`
        gathered, unless a process of the group did within
        :data:`FILE_COMPACTION_INTERVAL_MS`; returns the files replaced.

        Each send-back and acknowledgement commits a file of a few rows, and a commit
        costs time in proportion to the files the table holds: without this, a busy
        group's send-backs slow down as it runs. The events, their versions and the
        change data feed are unchanged (Delta ``OPTIMIZE``).
        """
        if self.journal.small_files() < SMALL_FILES_TO_COMPACT:
            return 0
        due = self._redis(
            lambda: self.store.client.set(
                self.store.keys.files_compacted,
                self.clock.now_ms(),
                nx=True,
                px=FILE_COMPACTION_INTERVAL_MS,
            ),
            what="claim the journal's file compaction",
        )
        return self.journal.compact_files() if due else 0

    def compact_journal(self) -> JournalBase | None:
        """Snapshot the live messages into the journal, so a rebuild starts there
        (``idem retry compact``); ``None`` when there is no journal yet."""
        return self.journal.compact(now_ms=self.clock.now_ms())  # each read/write fault-wrapped

    def _maybe_sync(self) -> None:
        """Sync when Redis lost the cursor (rebuild at once), else at most once a second."""
        now = self.clock.now_ms()
        recent = self._last_sync_ms is not None and now - self._last_sync_ms < 1000
        if recent and self._redis(self.store.cursor, what="read the cursor") is not None:
            return
        try:
            self._sync_or_raise()
        except LedgerError:
            log.warning("retry journal unreadable; serving what Redis has", exc_info=True)

    def catch_up(self) -> None:
        """Sync Redis with the journal unless this engine did within the last second (at
        once when Redis lost the cursor). :meth:`poll_retry` does it; call it before reading
        ``%RETRY%<group>`` another way (a takeover's ``XAUTOCLAIM``), so that a message the
        journal has acknowledged or dead-lettered meanwhile is not handed out."""
        self._maybe_sync()

    # -- the retry topic -----------------------------------------------------------------

    def poll_retry(
        self, consumer: str, count: int, block_ms: int | None = None
    ) -> list[MessageExt]:
        """Up to ``count`` retried messages for ``consumer``, original topic restored."""
        self._maybe_sync()
        try:
            return self.topic.read(consumer, count, block_ms)
        except redis.exceptions.RedisError as exc:
            raise StoreUnavailable(f"read of {self.topic.name} failed: {exc}") from exc

    def ack(self, messages: Sequence[MessageExt]) -> int:
        """Acknowledge retried messages (journaled, then removed from Redis); returns count.

        Raises :class:`~idem.retry.errors.JournalError` when the journal cannot be
        written: the messages stay pending and are delivered again (never lost).
        """
        unique = {m.msg_id: m for m in messages}
        now = self.clock.now_ms()
        events = [
            JournalEvent(
                JournalEventType.ACKED,
                m.msg_id,
                m.origin_msg_id,
                m.keys,
                m.reconsume_times,
                at_ms=now,
            )
            for m in unique.values()
        ]
        written = self.journal.append_batch(events)
        self._stage(SendBackStage.ACK_JOURNALED, list(unique.values()))
        try:
            self._sync_or_raise(None if written.version is None else written.as_own())
        except StoreUnavailable:
            log.warning("ack of %d message(s) journaled; Redis will catch up", len(events))
        else:
            self._stage(SendBackStage.ACKED, list(unique.values()))
        return len(events)

    def next_due_ms(self) -> int | None:
        """When the next scheduled message becomes due (``None``: nothing scheduled)."""
        return self._redis(self.store.next_due_ms, what="read the schedule heads")

    def pending(self) -> int:
        """Messages scheduled or in the retry topic and not yet acknowledged (a Redis that
        lost the retry side is rebuilt from the journal first: it would answer 0)."""
        self._maybe_sync()
        return self._redis(self.store.pending, what="count pending retries")

    # -- scheduling ----------------------------------------------------------------------

    def tick(self) -> int:
        """Move every due message to the retry topic now; returns how many."""
        return self._redis(self._service.tick, what="schedule tick")

    def schedule_service(
        self,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_idle_ms: int = DEFAULT_MAX_IDLE_MS,
        sync_interval_ms: int = DEFAULT_SYNC_INTERVAL_MS,
        compact_interval_ms: int | None = DEFAULT_COMPACT_INTERVAL_MS,
        name: str | None = None,
    ) -> ScheduleService:
        """A :class:`ScheduleService` for this group (``start()`` it, or ``run()`` it).

        Running, it also compacts the group's retry journal every
        ``compact_interval_ms`` (one service of the group does; ``None``: never), and
        its files whenever enough small ones gathered (:meth:`maybe_compact_journal_files`).
        """
        interval = compact_interval_ms

        def maintain(every_ms: int) -> None:
            self.maybe_compact_journal_files()
            self.maybe_compact_journal(every_ms)

        return ScheduleService(
            self.store,
            clock=self.clock,
            sync=self.sync,
            batch_size=batch_size,
            max_idle_ms=max_idle_ms,
            sync_interval_ms=sync_interval_ms,
            maintenance=None if interval is None else lambda: maintain(interval),
            name=name,
        )

    def stats(self) -> RetryStats:
        """Redis counts per queue, retry topic lag, cursor; the journal's version."""
        return RetryStats(
            redis=self._redis(self.store.stats, what="read retry stats"),
            journal_version=self.journal.latest_version(),
        )

    def close(self) -> None:
        """Close the Redis connection pool."""
        self.client.close()


def _count_outcomes(
    group: str, outcomes: Sequence[SendBackOutcome], journaled: Collection[str]
) -> None:
    """Retries scheduled by level and dead letters by reason, into the process's metrics,
    whoever sent them back (a Spark batch, a consumer, a DLQ replay); only the messages
    whose event this call ``journaled`` (by msg id) count."""
    levels: Counter[int] = Counter()
    reasons: Counter[str] = Counter()
    for o in outcomes:
        if o.status is SendBackStatus.DEAD and o.msg_id in journaled:
            reasons[metrics.reason_label(o.reason or "")] += 1
        elif (
            o.status in (SendBackStatus.SCHEDULED, SendBackStatus.FALLBACK)
            and o.new_msg_id in journaled
        ):
            levels[o.delay_level] += 1
    for level, n in levels.items():
        metrics.count("retries_scheduled", group, n, level=level)
    for reason, n in reasons.items():
        metrics.count("dead_letters", group, n, reason=reason)


def _may_be_live(message: MessageExt) -> bool:
    """Whether ``message`` may be a live retry in Redis, which its send-back replaces.

    Only a message read from the retry topic can be: a resend counts a reconsume, a busy
    resend keeps ``reconsume_times`` 0 but carries ``ORIGIN_MESSAGE_ID``. A dead letter
    being replayed carries it too, with ``reconsume_times`` reset: it starts a new chain
    and replaces nothing (its dead copy left the ladder).
    """
    if message.reconsume_times > 0:
        return True
    props = message.properties
    return (
        MessageConst.PROPERTY_ORIGIN_MESSAGE_ID in props
        and MessageConst.PROPERTY_REPLAYED_BY not in props
    )
