"""Orderly consumption (``ConsumeMessageOrderlyService``) and the queue locks in Redis.

A queue is consumed orderly by one instance at a time: the instance holds the
queue's lock ``rmq:lock:{<group>}:<topic>:<queue id>`` (``lua/lock.lua``), renews
it every ``lock_interval_ms`` (RocketMQ: 20 s) and consumes only while the lock
is fresh. Inside the instance one consume request per queue runs at a time.

A failure (``SUSPEND_CURRENT_QUEUE_A_MOMENT``, an exception, or a failed row)
suspends the queue for ``suspend_current_queue_time_millis`` (default 1 s) and
consumes the same messages again, ``reconsume_times`` + 1 — nothing after them
runs meanwhile, so the order at the sink is kept. After ``max_reconsume_times``
local retries a message goes to ``%DLQ%<group>`` and the queue moves on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from idem import metrics
from idem.redis_cluster import RedisClient
from idem.retry.consumer.listener import BatchResult
from idem.retry.consumer.process_queue import ProcessQueue
from idem.retry.consumer.rebalance import load_script
from idem.retry.consumer.runtime import Runtime
from idem.retry.consumer.topics import MessageQueue
from idem.retry.message import MessageExt
from idem.retry.status import (
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
    OrderlyAction,
    orderly_outcome,
)

log = logging.getLogger(__name__)

MAX_TIME_CONSUME_CONTINUOUSLY_MS = 60_000
"""A consume request yields its thread after this long (``MAX_TIME_CONSUME_CONTINUOUSLY``)."""

LOCK_RETRY_LATER_MS = 100
"""``tryLockLaterAndReconsume``: a queue whose lock is not held looks again this soon."""


def lock_key(group: str, mq: MessageQueue) -> str:
    """The lock of ``mq`` for ``group``."""
    return f"rmq:lock:{{{group}}}:{mq.topic}:{mq.queue_id}"


class QueueLocks:
    """Orderly-consumption locks of one group, held by one client."""

    def __init__(self, client: RedisClient, group: str, client_id: str, *, ttl_ms: int) -> None:
        self.client = client
        self.group = group
        self.client_id = client_id
        self.ttl_ms = ttl_ms
        self._lock = load_script(client, "lock.lua")
        self._unlock = load_script(client, "unlock.lua")

    def lock(self, mqs: Iterable[MessageQueue]) -> set[MessageQueue]:
        """Take or renew the locks of ``mqs``; returns those this client holds now."""
        wanted = sorted(set(mqs))
        if not wanted:
            return set()
        reply = self._lock(
            keys=[lock_key(self.group, mq) for mq in wanted], args=[self.client_id, self.ttl_ms]
        )
        return {mq for mq, held in zip(wanted, reply, strict=True) if int(held) == 1}

    def unlock(self, mqs: Iterable[MessageQueue]) -> int:
        """Release the locks of ``mqs`` this client holds."""
        keys = [lock_key(self.group, mq) for mq in sorted(set(mqs))]
        return int(self._unlock(keys=keys, args=[self.client_id])) if keys else 0

    def holder(self, mq: MessageQueue) -> str | None:
        """Who holds ``mq``'s lock (``None``: nobody)."""
        raw = self.client.get(lock_key(self.group, mq))
        return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


class OrderlyService:
    """Runs one consume request at a time per orderly queue."""

    def __init__(self, rt: Runtime, locks: QueueLocks | None) -> None:
        self.rt = rt
        self.locks = locks
        self.executor = ThreadPoolExecutor(
            rt.settings.consume_thread_nums, thread_name_prefix=f"{rt.client_id}-orderly"
        )

    def start(self) -> None:
        """Nothing to start: lock renewal is driven by the consumer's timer."""

    def shutdown(self, await_ms: int) -> None:
        """Stop taking requests; wait up to ``await_ms`` for the running ones."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + await_ms / 1000
        for pq in self.rt.process_queues():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not pq.consume_lock.acquire(timeout=remaining):
                break
            pq.consume_lock.release()

    # -- locks ---------------------------------------------------------------------------

    def lock_queue(self, mq: MessageQueue, pq: ProcessQueue) -> bool:
        """Take ``mq``'s lock before the queue is added (``RebalanceImpl.lock``)."""
        if self.locks is None:
            pq.locked = True
            return True
        # Read before the call: Redis starts the lock's TTL when it runs the script, so a
        # time read after the reply would trust the lock a round trip longer than it lasts.
        asked_at = self.rt.clock.now_ms()
        held = mq in self.locks.lock([mq])
        if held:
            pq.locked = True
            pq.last_lock_ms = asked_at
        return held

    def lock_all(self, queues: Sequence[tuple[MessageQueue, ProcessQueue]]) -> None:
        """Renew every held lock (``lockAll``); a queue that lost its lock stops consuming."""
        if self.locks is None or not queues:
            return
        now = self.rt.clock.now_ms()  # before the call, as in lock_queue
        held = self.locks.lock(mq for mq, _ in queues)
        for mq, pq in queues:
            if mq in held:
                pq.locked = True
                pq.last_lock_ms = now
            elif pq.locked:
                pq.locked = False
                log.warning("%s: lost the lock of %s", self.rt.client_id, mq)

    def unlock_queue(self, mq: MessageQueue, pq: ProcessQueue) -> bool:
        """Release ``mq`` when its current consume request is done (waits up to 1 s)."""
        if not pq.consume_lock.acquire(timeout=1.0):
            return False  # still consuming: the next rebalance tries again
        try:
            if self.locks is not None:
                self.locks.unlock([mq])
            pq.locked = False
        finally:
            pq.consume_lock.release()
        return True

    # -- consuming -----------------------------------------------------------------------

    def submit(self, messages: Sequence[MessageExt], pq: ProcessQueue, mq: MessageQueue) -> None:
        """Start a consume request for ``pq`` unless one is scheduled or running."""
        del messages  # they are in the process queue; the request takes them from there
        if pq.dispatch_to_consume():
            self._submit(pq, mq)

    def _submit(self, pq: ProcessQueue, mq: MessageQueue) -> None:
        try:
            self.executor.submit(self._run, pq, mq)
        except RuntimeError:  # shut down
            return

    def _later(self, pq: ProcessQueue, mq: MessageQueue, delay_ms: int) -> None:
        self.rt.scheduler.schedule(delay_ms, lambda: self._submit(pq, mq), name="orderly-later")

    def _run(self, pq: ProcessQueue, mq: MessageQueue) -> None:
        try:
            self._consume_request(pq, mq)
        except Exception:
            log.exception("%s: orderly consume of %s failed", self.rt.client_id, mq)
            self._later(pq, mq, self.rt.settings.suspend_current_queue_time_millis)

    def _consume_request(self, pq: ProcessQueue, mq: MessageQueue) -> None:
        if pq.dropped:
            return
        settings = self.rt.settings
        with pq.consume_lock:
            began = time.monotonic()
            while not pq.dropped:
                now = self.rt.clock.now_ms()
                if self.locks is not None and (
                    not pq.locked or pq.is_lock_expired(now, settings.effective_lock_ttl_ms)
                ):
                    self._later(pq, mq, LOCK_RETRY_LATER_MS)  # tryLockLaterAndReconsume
                    return
                if (time.monotonic() - began) * 1000 > MAX_TIME_CONSUME_CONTINUOUSLY_MS:
                    self._later(pq, mq, 10)
                    return
                messages = pq.take_messages(settings.consume_message_batch_max_size)
                if not messages:
                    return
                try:
                    result = self.rt.build_chain(mq, orderly=True)(messages)
                except Exception as exc:  # the taken messages must go back, not be dropped
                    log.warning("%s: consume call on %s raised", self.rt.client_id, mq)
                    result = BatchResult.all_failed(len(messages), exc)
                if pq.dropped:
                    self.rt.stats.add(dropped_results=len(messages))
                    return
                if not self._settle(messages, result, pq, mq):
                    return

    def _settle(
        self,
        messages: Sequence[MessageExt],
        result: BatchResult,
        pq: ProcessQueue,
        mq: MessageQueue,
    ) -> bool:
        """:meth:`process_consume_result`, but messages it fails on go back in place (taken
        from the process queue, they would otherwise be skipped by the next commit)."""
        try:
            return self.process_consume_result(messages, result, pq, mq)
        except Exception:
            log.exception("%s: settling a consume of %s failed", self.rt.client_id, mq)
            pq.make_message_to_consume_again(messages)
            self._later(pq, mq, self.rt.settings.suspend_current_queue_time_millis)
            return False

    def process_consume_result(
        self,
        messages: Sequence[MessageExt],
        result: BatchResult,
        pq: ProcessQueue,
        mq: MessageQueue,
    ) -> bool:
        """Commit, or suspend and retry in place, or dead-letter; returns "continue consuming"."""
        if result.ok:
            self.rt.stats.add(consumed_ok=len(messages))
            offset = pq.commit()
            if offset >= 0:
                self.rt.commit_offset(mq, pq, offset, increase_only=False)
            return True
        if not result.failed:  # only bad input: dead-letter it now and move on
            dead = [messages[i] for i in sorted(result.dead)]
            if self._dead_letter(dead, result, messages):
                self.rt.stats.add(consumed_ok=len(messages) - len(dead))
                offset = pq.commit()
                if offset >= 0:
                    self.rt.commit_offset(mq, pq, offset, increase_only=False)
                return True
        self.rt.stats.add(consume_failed=len(messages))
        metrics.count("failed", self.rt.group, sum(f.counts for f in result.failed.values()))
        suspend_ms = (
            result.suspend_ms
            if result.suspend_ms >= 0
            else self.rt.settings.suspend_current_queue_time_millis
        )
        if not result.dead and not any(f.counts for f in result.failed.values()):
            # only busy keys: try again in place without counting a reconsume
            self.rt.stats.add(suspended=1)
            pq.make_message_to_consume_again(messages)
            self._later(pq, mq, suspend_ms)
            return False
        context = ConsumeOrderlyContext(suspend_current_queue_time_millis=suspend_ms)
        outcome = orderly_outcome(
            messages,
            ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT,
            context,
            max_reconsume_times=self.rt.max_reconsume_times,
        )
        retry = list(outcome.retry)
        if outcome.dead and not self._dead_letter(outcome.dead, result, messages):
            retry += [m.evolve(reconsume_times=m.reconsume_times + 1) for m in outcome.dead]
        if retry:
            self.rt.stats.add(suspended=1)
            pq.make_message_to_consume_again(retry)
            self._later(pq, mq, outcome.suspend_ms or suspend_ms)
            return False
        assert outcome.action is OrderlyAction.DEAD_LETTER
        offset = pq.commit()
        if offset >= 0:
            self.rt.commit_offset(mq, pq, offset, increase_only=False)
        return True

    def _dead_letter(
        self, dead: Sequence[MessageExt], result: BatchResult, messages: Sequence[MessageExt]
    ) -> bool:
        if self.rt.broadcasting or self.rt.engine is None:
            log.warning("orderly: %d message(s) reached max reconsume times; dropped", len(dead))
            self.rt.stats.add(broadcast_dropped=len(dead))
            return True
        errors = {
            m.msg_id: (
                result.failed[i].reason
                if i in result.failed
                else result.dead.get(i, "max reconsume times reached")
            )
            for i, m in enumerate(messages)
        }
        limit = self.rt.max_reconsume_times
        try:
            outcome = self.rt.engine.dead_letter(
                dead,
                errors={m.msg_id: errors.get(m.msg_id, "") for m in dead},
                reasons={  # out of local retries: the limit, not "dead-letter requested"
                    m.msg_id: f"reconsume times reached max ({limit})"
                    for i, m in enumerate(messages)
                    if i not in result.dead and m.reconsume_times >= limit
                },
            )
        except Exception:
            log.exception("orderly: dead-lettering failed; suspending the queue")
            return False
        if not outcome.acknowledged:
            return False
        self.rt.stats.add(dead_lettered=len(dead))
        return True
