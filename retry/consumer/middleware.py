"""idem's dedup as a consumer middleware: a listener runs exactly once per business key.

::

    dedup = Dedup(config)
    consumer.use(DedupMiddleware(dedup, key="keys"))       # or:

    @exactly_once(dedup, key="body.order_id")
    def listener(msgs, context): ...

Around every consume call the middleware (docs/pages/protocol.md):

1. extracts each message's key (``keys``, ``tags``, ``property.<NAME>``,
   ``body.<json path>`` or a callable); a bad key is dead-lettered with a reason
   naming the field and the limit;
2. reserves the keys inside this instance (two calls of one instance never hold
   one key) and claims them in Redis for this instance's owner token;
3. hands only the fresh messages to the listener; duplicates are acknowledged
   and counted with their cause; a key claimed by someone else (*busy*) is sent
   back after a short delay without counting as a reconsume
   (:meth:`~idem.retry.RetryEngine.send_back_busy`), never dropped. Among copies
   of one key in one call the retried copy (highest ``reconsume_times``) wins,
   then the lowest queue offset, then the earliest born time: a fresh
   redelivery never cuts a retry chain short. A copy whose body differs from the
   completed one, or from the copy the call consumes, is a payload mismatch and
   follows ``mismatch_policy`` (``dead_letter``: to the DLQ with the key in the
   reason; ``raise``: failed and retried, then dead-lettered; ``warn``: logged and
   acknowledged), counted in :attr:`DedupStats.mismatched`. Orderly, the fresh
   messages after a busy one in queue order wait with it (busy too): they must not
   reach the sink first;
4. completes the keys that reached the sink — the listener's
   :func:`~idem.retry.consumer.listener.mark_done` marks if it gave any,
   otherwise the messages it acknowledged — *after* the listener returned, so a
   key is done only once the sink holds it. The keys of many calls go into one
   ledger commit (:mod:`~idem.retry.consumer.group_commit`); a concurrent
   consumer gets the messages back as *pending* and keeps their offsets (and
   retry-topic acks) back until that commit is durable, while the claims and
   this instance's reservation of the keys stay held; an orderly consumer waits;
5. releases the claims of the rest.

Broadcasting: every instance must consume every key once, so give each instance
its own dedup group (``IdemConfig(group=f"{group}-{instance}")``); a busy key is
then consumed again locally rather than dropped.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from idem import metrics
from idem.config import MismatchPolicy
from idem.dedup import Dedup
from idem.errors import ConfigError
from idem.keys import UnreadableKey, fingerprints, group_by_bucket, valid_keys
from idem.outcome import BatchClaim
from idem.redis_cluster import RedisClient
from idem.retry.consumer.group_claim import GroupClaimer
from idem.retry.consumer.group_commit import (
    DEFAULT_COMMIT_INTERVAL_MS,
    DEFAULT_COMMIT_MAX_KEYS,
    DEFAULT_MAX_PENDING_KEYS,
    CommitItem,
    GroupCommitter,
)
from idem.retry.consumer.listener import (
    BatchResult,
    CallNext,
    ConsumeScope,
    Failure,
    collecting_marks,
    store_outage,
)
from idem.retry.crash_points import ConsumeObserver, ConsumePoint
from idem.retry.message import MessageExt
from idem.retry.sendback import BUSY_DELAY_LEVEL

log = logging.getLogger(__name__)

KeySource = str | Callable[[MessageExt], object]
"""``"keys"``, ``"tags"``, ``"msg_id"``, ``"property.<NAME>"``, ``"body.<json.path>"`` or a
callable taking the message."""

BUSY = "busy"
"""The cause recorded for a key another consumer (or call) is processing right now."""

MISMATCH_DETAIL = "completed before with another payload"
"""Why a copy of a completed key is a payload mismatch."""

CONFLICT_DETAIL = "another message of this consume call has this key with another payload"
"""Why an in-call duplicate is a payload mismatch (the call consumes the other message)."""


def precedence(message: MessageExt) -> tuple[int, int, int]:
    """Sort key of copies of one key in one call: the first one is consumed, the rest are
    duplicates. The most retried copy first (its chain must go on, and a fresh copy's
    send-back would reuse its msg id), then the lowest queue offset, then the earliest
    born time."""
    return (-message.reconsume_times, message.queue_offset, message.born_timestamp)


def key_getter(source: KeySource) -> Callable[[MessageExt], object]:
    """A function reading the business key of a message from ``source``."""
    if callable(source):
        return source
    if source in ("keys", "tags", "msg_id"):
        return lambda m: getattr(m, source)
    if source.startswith("property."):
        name = source[len("property.") :]
        return lambda m: m.properties.get(name)
    if source.startswith("body."):
        path = source[len("body.") :].split(".")

        def from_body(message: MessageExt) -> object:
            try:
                value: Any = json.loads(message.body)
            except ValueError as exc:  # not JSON, or not UTF-8
                raise ValueError(f"the body is not JSON ({exc})") from None
            for part in path:
                value = value.get(part) if isinstance(value, dict) else None
            return value

        return from_body
    raise ConfigError(
        f"key: {source!r} is not 'keys', 'tags', 'msg_id', 'property.<NAME>', "
        "'body.<json path>' or a callable"
    )


@dataclass(frozen=True, slots=True)
class DuplicateRecord:
    """One message not handed to the listener, and why."""

    key: str
    cause: str
    msg_id: str
    origin_msg_id: str
    topic: str
    queue_id: int
    queue_offset: int
    reconsume_times: int
    client_id: str

    @classmethod
    def of(cls, key: str, cause: str, message: MessageExt, client_id: str) -> DuplicateRecord:
        """Describe ``message``."""
        return cls(
            key,
            cause,
            message.msg_id,
            message.origin_msg_id,
            message.topic,
            message.queue_id,
            message.queue_offset,
            message.reconsume_times,
            client_id,
        )


@dataclass
class DedupStats:
    """What the middleware decided so far."""

    fresh: int = 0
    completed: int = 0
    released: int = 0
    busy: int = 0
    invalid: int = 0
    slipped: int = 0
    mismatched: int = 0
    """Copies of a key whose payload differed from the completed one or from the copy
    consumed in the same call (also counted as duplicates; ``mismatch_policy`` decided)."""
    commits: int = 0
    duplicates: Counter[str] = field(default_factory=Counter)
    records: deque[DuplicateRecord] = field(default_factory=lambda: deque(maxlen=100_000))
    group: str | None = None
    """Also count into the process's metrics of this group (see :mod:`idem.metrics`)."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, records: Sequence[DuplicateRecord] = (), **counts: int) -> None:
        """Add counts and duplicate records at once."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)
            for record in records:
                self.duplicates[record.cause] += 1
                self.records.append(record)
        if self.group is not None:
            self._count(records, counts)

    def _count(self, records: Sequence[DuplicateRecord], counts: dict[str, int]) -> None:
        group = self.group
        assert group is not None
        for name, metric in (("completed", "applied"), ("busy", "busy")):
            if counts.get(name, 0) > 0:
                metrics.count(metric, group, counts[name])
        causes = Counter(r.cause for r in records if r.cause != BUSY)
        for cause, n in causes.items():
            metrics.count("duplicates", group, n, cause=cause)

    def duplicate_records(self, cause: str | None = None) -> list[DuplicateRecord]:
        """The recorded duplicates (of ``cause``)."""
        with self._lock:
            return [r for r in self.records if cause is None or r.cause == cause]


class DedupMiddleware:
    """Exactly once per business key around a consumer's listener (see the module doc)."""

    def __init__(
        self,
        dedup: Dedup,
        *,
        key: KeySource = "keys",
        owner: str | None = None,
        busy_delay_level: int = BUSY_DELAY_LEVEL,
        client: RedisClient | None = None,
        commit_lock: bool = True,
        commit_interval_ms: int = DEFAULT_COMMIT_INTERVAL_MS,
        commit_max_keys: int = DEFAULT_COMMIT_MAX_KEYS,
        max_pending_keys: int = DEFAULT_MAX_PENDING_KEYS,
        on_point: ConsumeObserver | None = None,
    ) -> None:
        self.dedup = dedup
        self.on_point = on_point
        """Told when consumed keys reach each :class:`~idem.retry.crash_points.ConsumePoint`."""
        self.key_source = key
        self.field = key if isinstance(key, str) else getattr(key, "__name__", "key")
        self._key_of = key_getter(key)
        self._attribute = attrgetter(key) if key in ("keys", "tags", "msg_id") else None
        self.owner = owner or f"consumer-{uuid.uuid4().hex}"
        self.busy_delay_level = busy_delay_level
        lock_client = client if client is not None else getattr(dedup.hot, "client", None)
        self.stats = DedupStats(group=dedup.config.group)
        self.claimer = GroupClaimer(dedup, self.owner, field=self.field)
        self.committer = GroupCommitter(
            dedup,
            self.owner,
            client=lock_client if commit_lock else None,
            interval_ms=commit_interval_ms,
            max_keys=commit_max_keys,
            max_pending_keys=max_pending_keys,
            on_commit=lambda _keys: self.stats.add(commits=1),
            on_point=on_point,
        )
        self._lock = threading.Lock()
        self._inflight: dict[str, int] = {}
        """Keys reserved by this instance's calls, and when (ms): renewed while held."""
        self._closed = threading.Event()
        self._renewer: threading.Thread | None = None
        self._users = 0
        """Consumers started with this layer and not stopped since (see :meth:`close`)."""

    def _raw_keys(self, messages: Sequence[MessageExt]) -> list[object]:
        if self._attribute is not None:  # reading an attribute cannot fail
            return list(map(self._attribute, messages))
        out: list[object] = []
        for message in messages:
            try:
                out.append(self._key_of(message))
            except Exception as exc:  # e.g. a body not JSON, or nested past the recursion limit
                out.append(UnreadableKey(str(exc) or type(exc).__name__))
        return out

    def _reserve(
        self, keys: Sequence[str | None], order: Sequence[int]
    ) -> tuple[set[str], list[str]]:
        """Reserve the keys in this instance: returns the keys another call of this
        instance holds, and the keys reserved for this call."""
        held: set[str] = set()
        reserved: dict[str, None] = {}  # insertion-ordered set
        inflight = self._inflight
        now = self.dedup.clock.now_ms()
        with self._lock:
            for i in order:
                key = keys[i]
                if key is None or key in held or key in reserved:
                    continue
                if key in inflight:
                    held.add(key)
                else:
                    inflight[key] = now
                    reserved[key] = None
        return held, list(reserved)

    def __call__(
        self, messages: Sequence[MessageExt], scope: ConsumeScope, call_next: CallNext
    ) -> BatchResult:
        """Claim, consume the fresh messages, complete what reached the sink, release the rest."""
        size = len(messages)
        order = sorted(range(size), key=list(map(precedence, messages)).__getitem__)
        raw = self._raw_keys(messages)
        keys = valid_keys(raw, field=self.field, max_bytes=self.dedup.config.max_key_bytes)
        held, reserved = self._reserve(keys, order)
        if reserved and self._renewer is None:  # after the reservation: see _renew_loop
            self._start_renewer()
        kept: set[str] = set()  # reserved until their group commit resolves
        try:
            result, here = self._split_held(keys, held)
            if len(here) == size:  # the usual case: no key held by another call
                claim_keys, claim_order = raw, order
            else:
                position = {i: k for k, i in enumerate(here)}
                claim_keys = [raw[i] for i in here]
                claim_order = [position[i] for i in order if i in position]
            try:
                claim = self.claimer.claim(
                    claim_keys,
                    fingerprints=fingerprints([messages[i].body for i in here]),
                    order=claim_order,
                )
            except Exception as exc:
                log.warning("dedup claim failed; the batch will be retried", exc_info=True)
                for i in here:
                    result.failed[i] = store_outage(f"dedup unavailable: {exc}")
                return result
            self._classify(messages, scope, raw, claim, here=here, result=result)
            fresh_k = list(claim.fresh)
            if scope.orderly and result.failed:
                fresh_k = self._hold_back_after_busy(messages, claim, here=here, result=result)
            if fresh_k:
                kept = self._run_fresh(
                    messages, scope, claim, fresh_k, here=here, call_next=call_next, result=result
                )
            return result
        finally:
            self._unreserve(k for k in reserved if k not in kept)

    def _renew_from_now(self, keys: Iterable[str]) -> None:
        """The listener returned: these keys now wait for idem's own group commit, so their
        renewal runs for a consume timeout from now, not from the call's start (a commit
        queued behind others, e.g. retried while Redis was away, must not lose the lease
        and let another owner write the key again)."""
        now = self.dedup.clock.now_ms()
        with self._lock:
            inflight = self._inflight
            for key in keys:
                if key in inflight:
                    inflight[key] = now

    def _unreserve(self, keys: Iterable[str]) -> None:
        with self._lock:
            inflight = self._inflight
            for key in keys:
                inflight.pop(key, None)

    def flush(self, timeout_ms: int | None = None) -> bool:
        """Commit what is queued now and wait for it (a consumer's shutdown calls this)."""
        return self.committer.flush(None if timeout_ms is None else timeout_ms / 1000)

    def open(self) -> None:
        """A consumer starts with this layer (its shutdown or kill calls :meth:`close`).

        Refuses (:class:`~idem.errors.UnsafeRedisConfig`) a Redis that may evict keys,
        so the consumer does not start on it.
        """
        self.dedup.check()
        with self._lock:
            self._users += 1

    def close(self) -> None:
        """A consumer using this layer stopped (its shutdown or kill): stop renewing leases
        once no consumer that started with it is running (a stopped or crashed
        instance's leases must run out; another one's calls still hold theirs). The
        next consume call starts the renewal again."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users:
                return
        self._closed.set()

    def _start_renewer(self) -> None:
        with self._lock:
            if self._renewer is not None:
                return
            self._closed.clear()
            self._renewer = threading.Thread(
                target=self._renew_loop, daemon=True, name=f"idem-lease-{self.owner[-8:]}"
            )
            self._renewer.start()

    def _renew_loop(self) -> None:
        """Renew every ``lease_ms / 3`` while keys are held; end when none is (the next
        reservation starts a new loop: a loop ends and forgets itself under the lock the
        reservations take, and a call starts one after its reservation)."""
        interval_s = self.dedup.config.lease_ms / 3000
        while not self._closed.wait(interval_s):
            with self._lock:
                if not self._inflight:
                    self._renewer = None
                    return
            try:
                self.renew_leases()
            except Exception:
                log.warning("renewing the leases of in-flight keys failed", exc_info=True)
        with self._lock:
            if self._renewer is threading.current_thread():
                self._renewer = None

    def renew_leases(self) -> int:
        """Extend the leases of the keys this instance holds (their listener runs, or they
        wait for their group commit); returns how many were renewed.

        A lease runs out after ``lease_ms`` (5 min) while the consume timeout is 15 min:
        without renewal, a listener slower than the lease lets another instance take its
        key, e.g. the copy the consume timeout sent back, and the sink gets it twice. A
        key is renewed for up to ``consume_timeout_ms`` after its call reserved it, and
        once its listener returned, for up to ``consume_timeout_ms`` after that, while it
        waits for its group commit: a listener hung for good lets its key go a lease
        later, and a dead instance's leases run out.
        """
        config = self.dedup.config
        since = self.dedup.clock.now_ms() - config.consume_timeout_ms
        with self._lock:
            keys = [key for key, at in self._inflight.items() if at >= since]
        if not keys:
            return 0
        renewed = self.dedup.hot.renew(group_by_bucket(keys, config.buckets), self.owner)
        return len(renewed)

    def _split_held(
        self, keys: Sequence[str | None], held: set[str]
    ) -> tuple[BatchResult, list[int]]:
        """Messages whose key another call of this instance holds are busy; the rest go on."""
        result = BatchResult(len(keys))
        if not held:
            return result, list(range(len(keys)))
        here: list[int] = []
        for i, key in enumerate(keys):
            if key is not None and key in held:
                result.failed[i] = self._busy("busy: key in flight in this consumer")
            else:
                here.append(i)
        return result, here

    def _classify(
        self,
        messages: Sequence[MessageExt],
        scope: ConsumeScope,
        raw: Sequence[object],
        claim: BatchClaim,
        *,
        here: list[int],
        result: BatchResult,
    ) -> None:
        """Duplicates are acknowledged, busy keys sent back, bad keys dead-lettered."""
        records = [  # held by another call of this instance
            DuplicateRecord.of(str(raw[i]), BUSY, messages[i], scope.client_id)
            for i in sorted(result.failed)
        ]
        mismatched = dict.fromkeys(claim.mismatched, MISMATCH_DETAIL)
        mismatched.update((k, CONFLICT_DETAIL) for k in claim.conflicting())
        for k, cause in claim.duplicates.items():
            i = here[k]
            key = claim.keys[k] or ""
            detail = mismatched.get(k)
            if detail is not None:
                self._mismatch(messages[i], key, detail, at=i, result=result)
            records.append(DuplicateRecord.of(key, cause.value, messages[i], scope.client_id))
        for k in claim.busy:
            i = here[k]
            result.failed[i] = self._busy("busy: key claimed by another consumer")
            records.append(
                DuplicateRecord.of(claim.keys[k] or "", BUSY, messages[i], scope.client_id)
            )
        for bad in claim.invalid:
            result.dead[here[bad.index]] = bad.message
        self.stats.add(
            records,
            fresh=len(claim.fresh),
            invalid=len(claim.invalid),
            busy=sum(1 for r in records if r.cause == BUSY),
            mismatched=len(mismatched),
        )

    def _mismatch(
        self, message: MessageExt, key: str, detail: str, *, at: int, result: BatchResult
    ) -> None:
        """A copy of ``key`` with another payload than the completed one or the one this
        call consumes: ``mismatch_policy`` decides. ``dead_letter`` sends it to the DLQ,
        ``raise`` fails it like a listener's exception (retried on the delay ladder, then
        dead-lettered), ``warn`` logs it; it is acknowledged as a duplicate otherwise."""
        reason = f"payload_mismatch: {self.field} {key!r}: {detail}"
        policy = self.dedup.config.mismatch_policy
        if policy is MismatchPolicy.DEAD_LETTER:
            result.dead[at] = reason
        elif policy is MismatchPolicy.RAISE:
            result.failed[at] = Failure(reason)
        elif policy is MismatchPolicy.WARN and detail == CONFLICT_DETAIL:
            # a completed key's mismatch is logged by the claim, once per batch
            log.warning("%s (message %s acknowledged as a duplicate)", reason, message.msg_id)

    def _hold_back_after_busy(
        self,
        messages: Sequence[MessageExt],
        claim: BatchClaim,
        *,
        here: list[int],
        result: BatchResult,
    ) -> list[int]:
        """Orderly: the fresh messages after the first one that goes back (in queue order:
        a busy one, or a payload mismatch the ``raise`` policy fails) wait with it, busy
        too, their claims given back; returns the fresh rows that go on. Handed to the
        listener now, they would reach the sink before that message, which the queue
        consumes again first."""
        first_busy = min(messages[i].queue_offset for i in result.failed)
        go: list[int] = []
        wait: list[int] = []
        for k in claim.fresh:
            (wait if messages[here[k]].queue_offset > first_busy else go).append(k)
        if wait:
            self._release(claim, wait)
            self.stats.add(fresh=-len(wait))
            for k in wait:
                result.failed[here[k]] = self._busy(
                    "busy: an earlier message of this orderly queue goes back first"
                )
        return go

    def _busy(self, reason: str) -> Failure:
        """A busy key: sent back after a short delay, not counted as a reconsume."""
        return Failure(reason, self.busy_delay_level, transient=True, counts=False)

    def _run_fresh(
        self,
        messages: Sequence[MessageExt],
        scope: ConsumeScope,
        claim: BatchClaim,
        fresh_k: Sequence[int],
        *,
        here: list[int],
        call_next: CallNext,
        result: BatchResult,
    ) -> set[str]:
        """Consume the fresh messages (rows ``fresh_k`` of ``claim``); returns the keys left
        reserved for a pending commit."""
        fresh = [here[k] for k in fresh_k]
        with collecting_marks() as marks:
            try:
                inner = call_next([messages[i] for i in fresh])
            except Exception as exc:
                log.warning("consume call failed", exc_info=True)
                inner = BatchResult(
                    len(fresh),
                    failed=dict.fromkeys(
                        range(len(fresh)), Failure(f"{type(exc).__name__}: {exc}")
                    ),
                )
        mapped = inner.subset(fresh, result.size)
        result.failed.update(mapped.failed)
        result.dead.update(mapped.dead)
        result.suspend_ms = inner.suspend_ms
        if marks.used:
            done_k = [k for k in fresh_k if marks.is_done(messages[here[k]])]
        else:
            done_k = [
                k for k in fresh_k if here[k] not in mapped.failed and here[k] not in mapped.dead
            ]
        done = set(done_k)
        release_k = [k for k in fresh_k if k not in done]
        if release_k:
            self._release(claim, release_k)
        if not done_k:
            return set()
        self._reached(ConsumePoint.AFTER_LISTENER, [messages[here[k]] for k in done_k])
        item = CommitItem(
            keys=[claim.keys[k] or "" for k in done_k],
            prints=[claim.fingerprints[k] for k in done_k],
            messages=[messages[here[k]] for k in done_k],
            ledger_version=claim.ledger_version,
            buckets=[claim.buckets[k] for k in done_k] if claim.buckets else None,
            claimed_at_ms=claim.claimed_at_ms,
        )
        # Before the submit: a commit that resolves at once ends the reservation after this.
        self._renew_from_now(item.keys)
        try:
            deferred = self.committer.submit(item)
        except Exception as exc:
            self._release(claim, done_k)
            for k in done_k:
                result.failed.setdefault(here[k], store_outage(f"dedup commit failed: {exc}"))
            return set()
        deferred.on_resolved(lambda failure: self._committed(item, claim, done_k, failure))
        if scope.defer_acks and not scope.orderly:
            for k in done_k:
                if here[k] not in result.failed and here[k] not in result.dead:
                    result.pending[here[k]] = deferred
            return set(item.keys)
        failure = deferred.wait()  # orderly, or a caller that cannot defer: wait here
        if failure is not None:
            for k in done_k:
                result.failed.setdefault(here[k], failure)
        return set()

    def _reached(self, point: ConsumePoint, messages: Sequence[MessageExt]) -> None:
        if self.on_point is not None:
            self.on_point(point, messages)

    def _committed(
        self, item: CommitItem, claim: BatchClaim, done_k: list[int], failure: Failure | None
    ) -> None:
        """A group commit resolved: count it, or give the claims back; end the reservation."""
        try:
            if failure is not None or item.outcome is None:
                self._release(claim, done_k)
                return
            slipped = set(item.outcome.slipped)
            records = (
                [
                    DuplicateRecord.of(key, "slipped", message, "")
                    for key, message in zip(item.keys, item.messages, strict=True)
                    if key in slipped
                ]
                if slipped
                else []
            )
            self.stats.add(records, completed=len(item.keys), slipped=len(records))
        finally:
            self._unreserve(item.keys)

    def _release(self, claim: BatchClaim, indices: list[int]) -> None:
        try:
            self.dedup.release(claim, indices)
        except Exception:
            log.warning(
                "releasing %d claim(s) failed; their lease will expire", len(indices), exc_info=True
            )
        self.stats.add(released=len(indices))

    def listener(self, fn: Callable[..., Any]) -> ExactlyOnceListener:
        """Wrap ``fn`` so that registering it also installs this middleware."""
        return ExactlyOnceListener(fn, self)


class ExactlyOnceListener:
    """A listener carrying its dedup middleware (picked up by ``register_message_listener_*``)."""

    def __init__(self, listener: Callable[..., Any], middleware: DedupMiddleware) -> None:
        self.listener = listener
        self.idem_middleware = middleware

    def __call__(self, messages: Sequence[MessageExt], context: Any) -> Any:
        return self.listener(messages, context)


def exactly_once(
    dedup: Dedup, *, key: KeySource = "keys", **options: Any
) -> Callable[[Callable[..., Any]], ExactlyOnceListener]:
    """Decorate a listener so it runs exactly once per business key (``key``)."""
    middleware = DedupMiddleware(dedup, key=key, **options)
    return middleware.listener
