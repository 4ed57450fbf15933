"""idem's dedup as a consumer middleware: a listener runs exactly once per business key.

::

    dedup = Dedup(config)
    consumer.use(DedupMiddleware(dedup, key="keys"))       # or:

    @exactly_once(dedup, key="body.order_id")
    def listener(msgs, context): ...

Around every consume call the middleware (DESIGN §1):

1. extracts each message's key (``keys``, ``tags``, ``property.<NAME>``,
   ``body.<json path>`` or a callable); a bad key is dead-lettered with a reason
   naming the field and the limit;
2. reserves the keys inside this instance (two calls of one instance never hold
   one key) and claims them in Redis for this instance's owner token;
3. hands only the fresh messages to the listener; duplicates are acknowledged
   and counted with their cause; a key claimed by someone else (*busy*) is sent
   back to be tried later, never dropped;
4. completes the keys that reached the sink — the listener's
   :func:`~idem.retry.consumer.listener.mark_done` marks if it gave any,
   otherwise the messages it acknowledged — *after* the listener returned, so a
   key is done only once the sink holds it; the ledger commits of concurrent
   calls are grouped into one Delta commit (group commit), and each call waits
   for its own before it returns, so the offset never passes an uncommitted key;
5. releases the claims of the rest.

Broadcasting: every instance must consume every key once, so give each instance
its own dedup group (``IdemConfig(group=f"{group}-{instance}")``); a busy key is
then consumed again locally rather than dropped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import redis

from idem.config import MismatchPolicy
from idem.dedup import Dedup
from idem.errors import ConfigError, InvalidKey
from idem.keys import fingerprint, validate_key
from idem.outcome import BatchClaim, CommitOutcome
from idem.retry.consumer.listener import (
    BatchResult,
    CallNext,
    ConsumeScope,
    Failure,
    collecting_marks,
)
from idem.retry.consumer.rebalance import load_script
from idem.retry.faults import REDIS_TRANSIENT
from idem.retry.message import MessageExt

log = logging.getLogger(__name__)

KeySource = str | Callable[[MessageExt], object]
"""``"keys"``, ``"tags"``, ``"msg_id"``, ``"property.<NAME>"``, ``"body.<json.path>"`` or a
callable taking the message."""

COMMIT_LOCK_TTL_MS = 10_000
"""Longest one ledger commit may hold the group's commit lock."""

BUSY = "busy"
"""The cause recorded for a key another consumer (or call) is processing right now."""


def key_getter(source: KeySource) -> Callable[[MessageExt], object]:
    """A function reading the business key of a message from ``source``."""
    if callable(source):
        return source
    if source in ("keys", "tags", "msg_id"):
        return lambda m: getattr(m, source)
    if source.startswith("property."):
        name = source[len("property."):]
        return lambda m: m.properties.get(name)
    if source.startswith("body."):
        path = source[len("body."):].split(".")

        def from_body(message: MessageExt) -> object:
            value: Any = json.loads(message.body)
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
        return cls(key, cause, message.msg_id, message.origin_msg_id, message.topic,
                   message.queue_id, message.queue_offset, message.reconsume_times, client_id)


@dataclass
class DedupStats:
    """What the middleware decided so far."""

    fresh: int = 0
    completed: int = 0
    released: int = 0
    busy: int = 0
    invalid: int = 0
    slipped: int = 0
    commits: int = 0
    duplicates: Counter[str] = field(default_factory=Counter)
    records: deque[DuplicateRecord] = field(default_factory=lambda: deque(maxlen=100_000))

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

    def duplicate_records(self, cause: str | None = None) -> list[DuplicateRecord]:
        """The recorded duplicates (of ``cause``)."""
        with self._lock:
            return [r for r in self.records if cause is None or r.cause == cause]


@dataclass
class _Pending:
    keys: list[str]
    prints: list[str]
    messages: list[MessageExt]
    done: bool = False
    outcome: CommitOutcome | None = None
    error: BaseException | None = None


class GroupCommitter:
    """Completes the keys of concurrent calls of one owner in one ledger commit at a time.

    A caller queues its keys and waits; whoever finds no commit running commits
    everything queued (leader/follower, like a database's group commit).
    ``txnAppId`` is ``idem:<group>:<owner>`` and ``txnVersion`` counts up, so the
    commits of one owner are strictly ordered.

    With ``client``, the instances of a group also take turns through a Redis
    lock (``rmq:lock:{<group>}:ledger-commit``): concurrent Delta commits would
    only conflict and retry, and commits in turn keep every bucket's index
    watermark contiguous, so claims need not catch up from the ledger. The lock
    is an optimisation, not a guarantee: when it lapses, Delta's own conflict
    check still keeps the ledger right.
    """

    def __init__(self, dedup: Dedup, owner: str, *, client: redis.Redis | None = None,
                 lock_ttl_ms: int = COMMIT_LOCK_TTL_MS) -> None:
        self.dedup = dedup
        self.owner = owner
        self.app_id = f"idem:{dedup.config.group}:{owner}"
        self.client = client
        self.lock_key = f"rmq:lock:{{{dedup.config.group}}}:ledger-commit"
        self.lock_ttl_ms = lock_ttl_ms
        self._unlock = load_script(client, "unlock.lua") if client is not None else None
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        self._leading = False
        self._seq = 0

    def _acquire(self) -> bool:
        if self.client is None:
            return False
        deadline = time.monotonic() + self.lock_ttl_ms / 1000
        delay = 0.001
        while time.monotonic() < deadline:
            try:
                if self.client.set(self.lock_key, self.owner, nx=True, px=self.lock_ttl_ms):
                    return True
            except REDIS_TRANSIENT:
                return False  # Redis is away: commit anyway, Delta arbitrates
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        log.warning("ledger commit lock not acquired in %d ms; committing anyway",
                    self.lock_ttl_ms)
        return False

    def _release(self) -> None:
        if self.client is not None and self._unlock is not None:
            with contextlib.suppress(*REDIS_TRANSIENT):
                self._unlock(keys=[self.lock_key], args=[self.owner])

    def commit(self, item: _Pending) -> CommitOutcome:
        """Complete ``item``'s keys (ledger, then Redis); raises what the commit raised."""
        with self._cond:
            self._queue.append(item)
            while not item.done and self._leading:
                self._cond.wait()
            if not item.done:
                self._leading = True
                batch, self._queue = self._queue, []
        if not item.done:
            try:
                self._commit(batch)
            finally:
                with self._cond:
                    self._leading = False
                    self._cond.notify_all()
        if item.error is not None:
            raise item.error
        assert item.outcome is not None
        return item.outcome

    def _commit(self, batch: list[_Pending]) -> None:
        keys = [k for p in batch for k in p.keys]
        prints = [f for p in batch for f in p.prints]
        messages = [m for p in batch for m in p.messages]
        claim = BatchClaim(owner=self.owner, keys=tuple(keys), fingerprints=tuple(prints),
                           fresh=tuple(range(len(keys))), duplicates={}, busy=(), invalid=())
        meta = pa.table({
            "msg_id": pa.array([m.msg_id for m in messages], pa.string()),
            "origin_msg_id": pa.array([m.origin_msg_id for m in messages], pa.string()),
            "topic": pa.array([m.topic for m in messages], pa.string()),
            "queue_id": pa.array([m.queue_id for m in messages], pa.int32()),
            "queue_offset": pa.array([m.queue_offset for m in messages], pa.int64()),
        })
        locked = self._acquire()
        try:
            outcome: CommitOutcome | None = self.dedup.complete(
                claim, batch_id=self._seq, app_id=self.app_id, meta=meta
            )
            error: BaseException | None = None
        except Exception as exc:
            outcome, error = None, exc
        finally:
            if locked:
                self._release()
        self._seq += 1
        for pending in batch:
            pending.outcome, pending.error, pending.done = outcome, error, True


class DedupMiddleware:
    """Exactly once per business key around a consumer's listener (see the module doc)."""

    def __init__(
        self,
        dedup: Dedup,
        *,
        key: KeySource = "keys",
        owner: str | None = None,
        busy_delay_level: int = 0,
        client: redis.Redis | None = None,
    ) -> None:
        self.dedup = dedup
        self.key_source = key
        self.field = key if isinstance(key, str) else getattr(key, "__name__", "key")
        self._key_of = key_getter(key)
        self.owner = owner or f"consumer-{uuid.uuid4().hex}"
        self.busy_delay_level = busy_delay_level
        lock_client = client if client is not None else getattr(dedup.hot, "client", None)
        self.committer = GroupCommitter(dedup, self.owner, client=lock_client)
        self.stats = DedupStats()
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self._ready = False
        self._ready_lock = threading.Lock()

    def _catch_up_once(self) -> None:
        """Bring the Redis index up to the ledger once, before the first claims.

        Otherwise every consume thread's first claim finds the index missing and
        rebuilds every bucket at the same time.
        """
        if self._ready:
            return
        with self._ready_lock:
            if not self._ready:
                self.dedup.catch_up()
                self._ready = True

    def _raw_keys(self, messages: Sequence[MessageExt]) -> list[object]:
        out: list[object] = []
        for message in messages:
            try:
                out.append(self._key_of(message))
            except (ValueError, TypeError, AttributeError, UnicodeDecodeError):
                out.append(None)  # undecodable body: reported as a null key
        return out

    def _reserve(self, raw: Sequence[object], order: Sequence[int]) -> tuple[set[str], list[str]]:
        """Reserve the keys in this instance; returns (keys held by another call, reserved)."""
        limit = self.dedup.config.max_key_bytes
        held: set[str] = set()
        reserved: list[str] = []
        with self._lock:
            for i in order:
                try:
                    key = validate_key(raw[i], field=self.field, max_bytes=limit)
                except InvalidKey:
                    continue
                if key in held or key in reserved:
                    continue
                if key in self._inflight:
                    held.add(key)
                else:
                    self._inflight.add(key)
                    reserved.append(key)
        return held, reserved

    def __call__(self, messages: Sequence[MessageExt], scope: ConsumeScope,
                 call_next: CallNext) -> BatchResult:
        """Claim, consume the fresh messages, complete what reached the sink, release the rest."""
        size = len(messages)
        try:
            self._catch_up_once()
        except Exception as exc:
            log.warning("dedup index unavailable; the batch will be retried", exc_info=True)
            return BatchResult(size, failed=dict.fromkeys(
                range(size), Failure(f"dedup unavailable: {exc}", transient=True)))
        order = sorted(range(size), key=lambda i: (messages[i].queue_offset,
                                                   messages[i].born_timestamp))
        raw = self._raw_keys(messages)
        held, reserved = self._reserve(raw, order)
        try:
            result, here = self._split_held(raw, held)
            position = {i: k for k, i in enumerate(here)}
            try:
                claim = self.dedup.begin(
                    [raw[i] for i in here], owner=self.owner,
                    fingerprints=[fingerprint(messages[i].body) for i in here],
                    order=[position[i] for i in order if i in position], field=self.field,
                )
            except Exception as exc:
                log.warning("dedup claim failed; the batch will be retried", exc_info=True)
                for i in here:
                    result.failed[i] = Failure(f"dedup unavailable: {exc}", transient=True)
                return result
            self._classify(messages, scope, raw, claim, here=here, result=result)
            if claim.fresh:
                self._run_fresh(messages, claim, here, call_next, result)
            return result
        finally:
            with self._lock:
                self._inflight.difference_update(reserved)

    def _split_held(self, raw: Sequence[object], held: set[str]) -> tuple[BatchResult, list[int]]:
        """Messages whose key another call of this instance holds are busy; the rest go on."""
        result = BatchResult(len(raw))
        limit = self.dedup.config.max_key_bytes
        here: list[int] = []
        for i, value in enumerate(raw):
            try:
                key: str | None = validate_key(value, field=self.field, max_bytes=limit)
            except InvalidKey:
                key = None
            if key is not None and key in held:
                result.failed[i] = Failure("busy: key in flight in this consumer",
                                           self.busy_delay_level, transient=True)
            else:
                here.append(i)
        return result, here

    def _classify(self, messages: Sequence[MessageExt], scope: ConsumeScope,
                  raw: Sequence[object], claim: BatchClaim, *, here: list[int],
                  result: BatchResult) -> None:
        """Duplicates are acknowledged, busy keys sent back, bad keys dead-lettered."""
        size = len(messages)
        records: list[DuplicateRecord] = []
        for i in range(size):
            if i in result.failed:
                records.append(DuplicateRecord.of(str(raw[i]), BUSY, messages[i],
                                                  scope.client_id))
        dead_mismatch = self.dedup.config.mismatch_policy is MismatchPolicy.DEAD_LETTER
        for k, cause in claim.duplicates.items():
            i = here[k]
            if dead_mismatch and k in claim.mismatched:
                result.dead[i] = f"{self.field}: payload differs from the completed one"
            records.append(DuplicateRecord.of(claim.keys[k] or "", cause.value, messages[i],
                                              scope.client_id))
        for k in claim.busy:
            i = here[k]
            result.failed[i] = Failure("busy: key claimed by another consumer",
                                       self.busy_delay_level, transient=True)
            records.append(DuplicateRecord.of(claim.keys[k] or "", BUSY, messages[i],
                                              scope.client_id))
        for bad in claim.invalid:
            result.dead[here[bad.index]] = bad.message
        self.stats.add(records, fresh=len(claim.fresh), invalid=len(claim.invalid),
                       busy=sum(1 for r in records if r.cause == BUSY))

    def _run_fresh(self, messages: Sequence[MessageExt], claim: BatchClaim, here: list[int],
                   call_next: CallNext, result: BatchResult) -> None:
        fresh = [here[k] for k in claim.fresh]
        with collecting_marks() as marks:
            try:
                inner = call_next([messages[i] for i in fresh])
            except Exception as exc:
                log.warning("consume call failed", exc_info=True)
                inner = BatchResult(len(fresh), failed=dict.fromkeys(
                    range(len(fresh)), Failure(f"{type(exc).__name__}: {exc}")))
        mapped = inner.subset(fresh, result.size)
        result.failed.update(mapped.failed)
        result.dead.update(mapped.dead)
        result.suspend_ms = inner.suspend_ms
        if marks.used:
            done_k = [k for k in claim.fresh if marks.is_done(messages[here[k]])]
        else:
            done_k = [k for k in claim.fresh
                      if here[k] not in mapped.failed and here[k] not in mapped.dead]
        done = set(done_k)
        release_k = [k for k in claim.fresh if k not in done]
        if done_k:
            pending = _Pending(keys=[claim.keys[k] or "" for k in done_k],
                               prints=[claim.fingerprints[k] for k in done_k],
                               messages=[messages[here[k]] for k in done_k])
            try:
                outcome = self.committer.commit(pending)
            except Exception as exc:
                log.warning("completing %d key(s) failed; they will be consumed again",
                            len(done_k), exc_info=True)
                for k in done_k:
                    result.failed.setdefault(here[k], Failure(f"dedup commit failed: {exc}",
                                                              transient=True))
                release_k += done_k
            else:
                slipped = set(outcome.slipped)
                records = [DuplicateRecord.of(key, "slipped", messages[here[k]], "")
                           for k in done_k if (key := claim.keys[k] or "") in slipped]
                self.stats.add(records, completed=len(done_k), commits=1,
                               slipped=len(records))
        if release_k:
            try:
                self.dedup.release(claim, release_k)
            except Exception:
                log.warning("releasing %d claim(s) failed; their lease will expire",
                            len(release_k), exc_info=True)
            self.stats.add(released=len(release_k))

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


def exactly_once(dedup: Dedup, *, key: KeySource = "keys", **options: Any
                 ) -> Callable[[Callable[..., Any]], ExactlyOnceListener]:
    """Decorate a listener so it runs exactly once per business key (``key``)."""
    middleware = DedupMiddleware(dedup, key=key, **options)
    return middleware.listener
