"""Concurrent consumption (``ConsumeMessageConcurrentlyService``) and the consume timeout.

Pulled messages are split into consume requests of ``consume_message_batch_max_size``
and run on a thread pool. After the listener (through the middleware) answers:

- a queue dropped meanwhile commits nothing (redelivery case C6);
- clustering: failed messages are sent back through the retry engine (broker
  path, then the client-side resend); any the engine could not place are kept
  in the process queue and consumed again locally after 5 s
  (``submitConsumeRequestLater``) — as the journaled resend when the retry journal
  took it (:mod:`~idem.retry.consumer.local_resend`: one retry chain, whichever copy
  comes first is consumed); the rest are removed and the offset moves to the
  smallest message still in flight;
- broadcasting: failed messages are logged and dropped (RocketMQ does not retry
  them).

The consume timeout is per message: each message's consume start is recorded
and a watchdog sends a message still in flight ``consume_timeout_ms`` later
back at delay level 3 and removes it, so the offset can advance (redelivery case
C7). RocketMQ scans every ``consumeTimeout`` minutes (a stuck message waits up
to twice the timeout) and ignores a changed timeout; here the watchdog sleeps
until the earliest deadline (at most 250 ms), and reads the timeout on every look.
A message is sent back by one path only: the listener's late failure leaves a message
the timeout sent back alone (RocketMQ would put a second copy on the ladder).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import defaultdict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from idem import metrics
from idem.errors import IdemError
from idem.retry.consumer.listener import BatchResult, Deferred, Failure
from idem.retry.consumer.local_resend import LocalResends
from idem.retry.consumer.process_queue import ProcessQueue
from idem.retry.consumer.runtime import Runtime
from idem.retry.consumer.topics import MessageQueue
from idem.retry.engine import SendBackResult, SendBackStatus
from idem.retry.message import MessageExt
from idem.retry.sendback import BUSY_DELAY_LEVEL

log = logging.getLogger(__name__)

TIMEOUT_DELAY_LEVEL = 3
"""``cleanExpiredMsg`` sends an expired message back at delay level 3."""

WATCHDOG_MAX_WAIT_MS = 250
"""Longest the watchdog sleeps without looking (a changed timeout is seen this fast)."""


def _unplaced(result: SendBackResult) -> set[str]:
    return {o.msg_id for o in result.resubmit}


Kept = tuple[MessageExt, MessageExt | None]
"""A failed message no send-back path placed, and the journaled resend to consume in its
place (``None``: nothing was journaled, consume it again itself)."""


class ConcurrentlyService:
    """Runs consume requests of concurrently consumed queues."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.executor = ThreadPoolExecutor(
            rt.settings.consume_thread_nums, thread_name_prefix=f"{rt.client_id}-consume"
        )
        self.watchdog = ConsumeTimeoutWatchdog(self)
        self._queues: dict[MessageQueue, ProcessQueue] = {}
        self._queues_lock = threading.Lock()
        self._running = 0
        self._idle = threading.Condition()
        self.local_resends = LocalResends()

    def start(self) -> None:
        """Start the consume-timeout watchdog."""
        self.watchdog.start()

    def shutdown(self, await_ms: int) -> None:
        """Stop taking requests; wait up to ``await_ms`` for running ones."""
        self.watchdog.stop()
        self.executor.shutdown(wait=False, cancel_futures=True)
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0, timeout=await_ms / 1000)

    def watch(self, mq: MessageQueue, pq: ProcessQueue) -> None:
        """Let the watchdog see ``pq`` (not a dropped one: a late re-submit of a queue's old
        process queue must not take the place of the new one)."""
        with self._queues_lock:  # checked under the lock: a drop may come between
            current = self._queues.get(mq)
            if pq.dropped or (current is not None and current is not pq and not current.dropped):
                return
            self._queues[mq] = pq

    def watched(self) -> list[tuple[MessageQueue, ProcessQueue]]:
        """The queues the watchdog looks at (dropped ones are forgotten)."""
        with self._queues_lock:
            for mq, pq in list(self._queues.items()):
                if pq.dropped:
                    del self._queues[mq]
            return list(self._queues.items())

    # -- submitting ----------------------------------------------------------------------

    def submit(self, messages: Sequence[MessageExt], pq: ProcessQueue, mq: MessageQueue) -> None:
        """Split ``messages`` into consume requests and queue them (``submitConsumeRequest``)."""
        self.watch(mq, pq)
        if messages and self.rt.is_retry_queue(mq):
            messages = self._skip_local_copies(messages, pq)
        size = self.rt.settings.consume_message_batch_max_size
        for start in range(0, len(messages), size):
            batch = list(messages[start : start + size])
            try:
                self.executor.submit(self._consume, batch, pq, mq)
            except RuntimeError:  # shut down
                return

    def _skip_local_copies(
        self, messages: Sequence[MessageExt], pq: ProcessQueue
    ) -> list[MessageExt]:
        """Of messages read from the retry topic, those to consume: a copy of a journaled
        resend consumed locally is acknowledged, one being consumed locally is left pending."""
        consume, done, wait = self.local_resends.sort_retried(pq, messages)
        if done or wait:
            log.info(
                "%s: %d retried message(s) already consumed locally, %d being consumed",
                self.rt.client_id,
                len(done),
                len(wait),
            )
            pq.remove_messages([*done, *wait])
            if done:
                self.rt.ack_retried(done)
        return consume

    def submit_later(
        self, messages: Sequence[MessageExt], pq: ProcessQueue, mq: MessageQueue, delay_ms: int
    ) -> None:
        """Consume ``messages`` again after ``delay_ms`` (``submitConsumeRequestLater``)."""
        batch = list(messages)
        self.rt.stats.add(resubmitted=len(batch))
        self.rt.scheduler.schedule(
            delay_ms, lambda: self.submit(batch, pq, mq), name="submit-later"
        )

    # -- one request ---------------------------------------------------------------------

    def _consume(self, messages: list[MessageExt], pq: ProcessQueue, mq: MessageQueue) -> None:
        with self._idle:
            self._running += 1
        try:
            self._consume_request(messages, pq, mq)
        except Exception:
            log.exception("%s: consume request on %s failed", self.rt.client_id, mq)
        finally:
            with self._idle:
                self._running -= 1
                self._idle.notify_all()

    def _consume_request(
        self, messages: list[MessageExt], pq: ProcessQueue, mq: MessageQueue
    ) -> None:
        if pq.dropped:
            log.info("the message queue %s cannot be consumed: it was dropped", mq)
            return
        messages = [m for m in messages if pq.contains(m)]  # expired or removed meanwhile
        if not messages:
            return
        # the watchdog wakes at least every 250 ms and a timeout is >= 1 s: no need to poke it
        pq.mark_consume_start(messages, self.rt.clock.now_ms())
        try:
            result = self.rt.build_chain(mq, orderly=False)(messages)
        except Exception as exc:  # a layer raised: the messages must not wait for the timeout
            log.warning("%s: consume call on %s raised", self.rt.client_id, mq, exc_info=True)
            result = BatchResult.all_failed(len(messages), exc)
        if pq.dropped:
            self.rt.stats.add(dropped_results=len(messages))
            log.warning(
                "%s: %s was dropped while consuming; %d result(s) not committed",
                self.rt.client_id,
                mq,
                len(messages),
            )
            return
        self.process_consume_result(messages, result, pq, mq)

    def process_consume_result(
        self,
        messages: Sequence[MessageExt],
        result: BatchResult,
        pq: ProcessQueue,
        mq: MessageQueue,
    ) -> None:
        """Send back or drop the failures, remove the rest, move the offset.

        Acknowledgements still *pending* (:class:`~idem.retry.consumer.listener.Deferred`,
        e.g. a group-committed ledger write) keep their offsets back: they are settled
        when the deferral resolves, or handled as failures if it fails.
        """
        pending = {
            i: d
            for i, d in result.pending.items()
            if i not in result.failed and i not in result.dead
        }
        acked = [messages[i] for i in result.acked if i not in pending]
        failed = [messages[i] for i in sorted(result.failed)]
        self.rt.stats.add(consumed_ok=len(acked) + len(pending), consume_failed=len(failed))
        # the listener's own rejections; a busy key or a store outage is not one
        metrics.count("failed", self.rt.group, sum(f.counts for f in result.failed.values()))
        keep: list[Kept] = []
        elsewhere: set[int] = set()
        if self.rt.broadcasting:
            keep = [(messages[i], None) for i, f in sorted(result.failed.items()) if f.transient]
            dropped = sorted(
                {i for i, f in result.failed.items() if not f.transient} | set(result.dead)
            )
            for i in dropped:
                log.warning(
                    "BROADCASTING, the message consume failed, drop it: %s", messages[i].msg_id
                )
            self.rt.stats.add(broadcast_dropped=len(dropped))
        else:
            keep, elsewhere = self._send_back(messages, result, pq)
        # By queue offset, not msg id: a producer's resend (C1) can put two copies with
        # one msg id in one request, and the acknowledged copy must leave the queue.
        held = {m.queue_offset for m, _ in keep} | {messages[i].queue_offset for i in pending}
        held |= elsewhere  # the consume timeout's to place, or to give back if it cannot
        by_deferral: dict[int, tuple[Deferred, list[MessageExt]]] = {}
        for i, deferred in sorted(pending.items()):
            by_deferral.setdefault(id(deferred), (deferred, []))[1].append(messages[i])
        pq.defer([messages[i] for i in pending])  # before the offset moves past them
        offset = pq.remove_messages([m for m in messages if m.queue_offset not in held])
        if offset >= 0:
            self.rt.commit_offset(mq, pq, offset, increase_only=True)
        self._ack_retried(acked, mq)
        if keep:
            pq.release_send_back([m for m, _ in keep])
            busy = {messages[i].queue_offset for i, f in result.failed.items() if not f.counts}
            again = [
                m if m.queue_offset in busy else m.evolve(reconsume_times=m.reconsume_times + 1)
                for m, resend in keep
                if resend is None
            ]
            # the journaled resend takes the failed message's place: one retry chain
            resends = pq.stand_in([(m, resend) for m, resend in keep if resend is not None])
            self.local_resends.add(pq, resends)
            self.submit_later(again + resends, pq, mq, self._resubmit_delay_ms())
        for deferred, batch in by_deferral.values():
            deferred.on_resolved(functools.partial(self._settled, batch, pq=pq, mq=mq))

    def _settled(
        self,
        messages: list[MessageExt],
        failure: Failure | None,
        *,
        pq: ProcessQueue,
        mq: MessageQueue,
    ) -> None:
        """A deferred acknowledgement resolved: move the offset, or handle a failure."""
        if failure is not None:
            back = pq.restore(messages)
            if back and not pq.dropped:
                self.rt.stats.add(consumed_ok=-len(back))
                self.process_consume_result(
                    back,
                    BatchResult(len(back), failed=dict.fromkeys(range(len(back)), failure)),
                    pq,
                    mq,
                )
            return
        offset = pq.settle(messages)
        if pq.dropped:  # taken away meanwhile: its results are not committed (C6)
            return
        if offset >= 0:
            self.rt.commit_offset(mq, pq, offset, increase_only=True)
        self._ack_retried(messages, mq)

    def _ack_retried(self, consumed: Sequence[MessageExt], mq: MessageQueue) -> None:
        """Acknowledge, in the journal, consumed messages of the retry topic and consumed
        local resends (whichever queue they took the place of a failed message in)."""
        if self.rt.is_retry_queue(mq):
            retried = list(consumed)
        else:
            retried = [m for m in consumed if self.local_resends.is_local(m)]
        if retried:
            self.rt.ack_retried(retried)
            self.local_resends.consumed(retried)

    def _resubmit_delay_ms(self) -> int:
        engine = self.rt.engine
        return engine.faults.resubmit_delay_ms if engine is not None else 5000

    def _send_back(
        self, messages: Sequence[MessageExt], result: BatchResult, pq: ProcessQueue
    ) -> tuple[list[Kept], set[int]]:
        """Dead-letter and send back; returns the messages no path could place, and the
        offsets of failed messages left alone: the consume timeout sent them back (or is
        sending them) while the listener ran, and a second send-back would put a second
        copy on the retry ladder."""
        engine = self.rt.engine
        if engine is None:
            raise IdemError("a clustering consumer needs a RetryEngine to send messages back")
        failing = sorted({*result.dead, *result.failed})
        mine = {m.queue_offset for m in pq.take_for_send_back([messages[i] for i in failing])}
        elsewhere = {messages[i].queue_offset for i in failing} - mine
        if elsewhere:
            log.info(
                "%s: %d failed message(s) of %s were sent back by the consume timeout",
                self.rt.client_id,
                len(elsewhere),
                pq.mq,
            )
        keep: list[Kept] = []
        dead_indices = [i for i in sorted(result.dead) if messages[i].queue_offset in mine]
        dead = [messages[i] for i in dead_indices]
        if dead:
            errors: dict[str, str | BaseException] = {
                messages[i].msg_id: result.dead[i] for i in dead_indices
            }
            keep += self._call_engine(dead, -1, errors)
            self.rt.stats.add(dead_lettered=len(dead))
        by_level: dict[tuple[int, bool], list[int]] = defaultdict(list)
        for i, failure in sorted(result.failed.items()):
            if messages[i].queue_offset in mine:
                by_level[failure.delay_level, failure.counts].append(i)
        for (level, counts), indices in by_level.items():
            batch = [messages[i] for i in indices]
            errors = {messages[i].msg_id: result.failed[i].reason for i in indices}
            keep += self._call_engine(batch, level, errors, counts=counts)
            self.rt.stats.add(sent_back=len(batch))
        # A local resend sent back is replaced in the journal by what the send-back placed
        # or journaled; one whose send-back journaled nothing is still its chain's copy.
        again = {m.queue_offset for m, resend in keep if resend is None}
        self.local_resends.forget(
            messages[i] for i in failing if messages[i].queue_offset in mine - again
        )
        return keep, elsewhere

    def _call_engine(
        self,
        batch: Sequence[MessageExt],
        level: int,
        errors: dict[str, str | BaseException],
        *,
        counts: bool = True,
    ) -> list[Kept]:
        engine = self.rt.engine
        assert engine is not None
        try:
            if counts:
                outcome = engine.send_back(batch, delay_level=level, errors=errors)
            else:  # busy: not a failure, reconsume_times is kept
                outcome = engine.send_back_busy(batch, delay_level=level or BUSY_DELAY_LEVEL)
        except Exception:
            log.exception(
                "%s: send-back of %d message(s) failed; consuming them again later",
                self.rt.client_id,
                len(batch),
            )
            return [(m, None) for m in batch]
        return [
            (m, o.resend)
            for m, o in zip(batch, outcome.outcomes, strict=True)
            if o.status is SendBackStatus.RESUBMIT_LATER
        ]

    # -- consume timeout -----------------------------------------------------------------

    def expire(self, due: Sequence[Expiring]) -> None:
        """Send messages consumed for too long back at level 3 (one call) and remove them.

        A message the send-back could not place is found again after the re-submit
        delay (5 s, as a failed consume's local re-submit), not at the watchdog's next
        look: a send-back path that is down is not hammered every 250 ms. A message whose
        listener answered meanwhile is left to that answer (removed, or being sent back).
        """
        due = [e for e in due if e.pq.take_for_send_back([e.message])]
        if not due:
            return
        messages = [e.message for e in due]
        if self.rt.broadcasting:
            placed = {m.msg_id for m in messages}
            log.warning("BROADCASTING: %d message(s) timed out; dropped", len(placed))
        else:
            engine = self.rt.engine
            assert engine is not None
            try:
                outcome = engine.send_back(
                    messages,
                    delay_level=TIMEOUT_DELAY_LEVEL,
                    errors={
                        m.msg_id: f"consume timeout ({self.rt.consume_timeout_ms} ms)"
                        for m in messages
                    },
                )
                unplaced = _unplaced(outcome)
            except Exception:
                log.exception("send-back of %d expired message(s) failed", len(messages))
                unplaced = {m.msg_id for m in messages}
            placed = {m.msg_id for m in messages if m.msg_id not in unplaced}
        done = self.rt.clock.now_ms()
        by_queue: dict[MessageQueue, tuple[ProcessQueue, list[MessageExt]]] = {}
        for e in due:
            if e.message.msg_id in placed:
                by_queue.setdefault(e.mq, (e.pq, []))[1].append(e.message)
                self.watchdog.sent_back_lateness_ms.append(done - e.deadline_ms)
            else:
                again = done - self.rt.consume_timeout_ms + self._resubmit_delay_ms()
                e.pq.release_send_back([e.message])
                e.pq.mark_consume_start([e.message], again)
        for mq, (pq, expired) in by_queue.items():
            self.rt.stats.add(expired=len(expired))
            log.warning(
                "%s: %d message(s) of %s exceeded the consume timeout; sent back",
                self.rt.client_id,
                len(expired),
                mq,
            )
            offset = pq.remove_messages(expired)
            if offset >= 0:
                self.rt.commit_offset(mq, pq, offset, increase_only=True)


@dataclass(frozen=True, slots=True)
class Expiring:
    """A message found past its deadline, on its way back to the broker."""

    mq: MessageQueue
    pq: ProcessQueue
    message: MessageExt
    started_ms: int
    deadline_ms: int


class ConsumeTimeoutWatchdog:
    """Finds messages in flight longer than the consume timeout, as soon as they are."""

    def __init__(self, service: ConcurrentlyService) -> None:
        self.service = service
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: threading.Thread | None = None
        self.looks = 0
        self.lateness_ms: deque[int] = deque(maxlen=100_000)
        """How long after its deadline each expired message was found (ms)."""
        self.sent_back_lateness_ms: deque[int] = deque(maxlen=100_000)
        """How long after its deadline each expired message was sent back (ms)."""
        self._pending: list[Expiring] = []
        self._sender: threading.Thread | None = None

    def poke(self) -> None:
        """Look again now (a consume started, or the timeout changed)."""
        with self._cond:
            self._cond.notify()

    def start(self) -> None:
        """Run the finder and the sender in daemon threads."""
        self._stopped = False
        name = self.service.rt.client_id
        self._thread = threading.Thread(target=self._run, name=f"{name}-timeout", daemon=True)
        self._sender = threading.Thread(target=self._send, name=f"{name}-expire", daemon=True)
        self._thread.start()
        self._sender.start()

    def stop(self) -> None:
        """Stop both threads."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        for thread in (self._thread, self._sender):
            if thread is not None:
                thread.join(5)
        self._thread = self._sender = None

    def _send(self) -> None:
        """Send back everything found so far in one call, again and again."""
        while True:
            with self._cond:
                while not self._pending and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                batch, self._pending = self._pending, []
            try:
                self.service.expire(batch)
            except Exception:
                log.exception("expiring %d message(s) failed", len(batch))

    def look(self) -> int:
        """Expire what is due now; returns the wait (ms) until the next deadline."""
        rt = self.service.rt
        timeout = rt.consume_timeout_ms
        now = rt.clock.now_ms()
        wait = WATCHDOG_MAX_WAIT_MS
        self.looks += 1
        due: list[Expiring] = []
        watched = self.service.watched()
        for mq, pq in watched:
            for message, started in pq.take_expired(now, timeout):
                self.lateness_ms.append(now - started - timeout)
                due.append(Expiring(mq, pq, message, started, started + timeout))
        if due:
            with self._cond:  # the sender thread sends them back; finding goes on meanwhile
                self._pending += due
                self._cond.notify_all()
        for _, pq in watched:
            earliest = pq.earliest_start()
            if earliest is not None:
                wait = min(wait, max(earliest + timeout - now, 1))
        return wait

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
            wait = self.look()
            with self._cond:
                if self._stopped:
                    return
                self._cond.wait(wait / 1000)
