"""Group commit of the dedup middleware: many consume calls' keys in one ledger commit.

A consume call hands its succeeded keys to the instance's :class:`GroupCommitter`
and returns at once with a :class:`~idem.retry.consumer.listener.Deferred`; the
consumer keeps those messages' offsets back (and their retry-topic acks) until
it resolves, and the middleware keeps their claims (leases) and their in-instance
reservation. One committer thread per instance commits whatever is queued when
the oldest item has waited ``interval_ms`` (or ``max_keys`` are queued, or a
flush is asked for): one Delta commit through :meth:`idem.dedup.Dedup.complete`
with ``txnAppId = idem:<group>:<owner>`` and ``txnVersion`` counting up, so a
retried commit adds nothing the first attempt already wrote; then Redis learns
the keys are COMPLETED. Only then are the deferrals resolved.

Crash windows (docs/pages/guarantees.md): a crash before the commit is durable leaves the keys
IN_PROGRESS under a dead owner and their offsets uncommitted, so they are
redelivered, found busy until the lease runs out, then claimed and consumed
again — the "inside any other sink" row (at most one repeat per crash, with the same
key), widened from one call to at most ``interval_ms`` + one commit, and capped by
``max_pending_keys``. A crash after the commit only redelivers keys the ledger
already holds: duplicates, counted.

With ``client``, the instances of a group also take turns through a Redis lock
(``rmq:lock:{<group>}:ledger-commit``): concurrent Delta MERGEs on the same
partitions conflict and are retried (wasted work), and commits in turn keep
every bucket's index watermark contiguous, so claims need not catch up from the
ledger. The lock is an optimisation, not a guarantee: when it lapses, Delta's
own conflict check still keeps the ledger right.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyarrow as pa

from idem.dedup import Dedup
from idem.outcome import BatchClaim, CommitOutcome
from idem.redis_cluster import RedisClient
from idem.retry.consumer.listener import Deferred, store_outage
from idem.retry.consumer.rebalance import load_script
from idem.retry.crash_points import ConsumeObserver, ConsumePoint
from idem.retry.faults import REDIS_TRANSIENT
from idem.retry.message import MessageExt

log = logging.getLogger(__name__)

COMMIT_LOCK_TTL_MS = 10_000
"""Longest one ledger commit may hold the group's commit lock."""

DEFAULT_COMMIT_INTERVAL_MS = 200
"""How long the oldest queued key waits for company before a commit starts."""

DEFAULT_COMMIT_MAX_KEYS = 50_000
"""Most keys in one commit (a commit starts at once when this many are queued)."""

DEFAULT_MAX_PENDING_KEYS = 50_000
"""Most keys queued or committing per instance; a consume call waits beyond it."""

DEFAULT_COMMIT_ATTEMPTS = 3
"""Tries of one group commit (same ``txnVersion``) before its calls count as failed."""

IDLE_EXIT_S = 5.0
"""The committer thread ends after this long with nothing to do (a new item restarts it)."""


@dataclass
class CommitItem:
    """The succeeded keys of one consume call, waiting for their ledger commit."""

    keys: list[str]
    prints: list[str]
    messages: list[MessageExt]
    ledger_version: int = -1
    """The claim's ``ledger_version``: the commit checks only the versions after it."""
    buckets: list[int] | None = None
    """The bucket of each key, when the claim computed them."""
    claimed_at_ms: int | None = None
    """When the keys were claimed (``BatchClaim.claimed_at_ms``)."""
    deferred: Deferred = field(default_factory=Deferred)
    outcome: CommitOutcome | None = None
    """Set (before :attr:`deferred` resolves) when the commit succeeded."""


class GroupCommitter:
    """Completes the keys of one owner's consume calls, many calls per ledger commit."""

    def __init__(
        self,
        dedup: Dedup,
        owner: str,
        *,
        client: RedisClient | None = None,
        lock_ttl_ms: int = COMMIT_LOCK_TTL_MS,
        interval_ms: int = DEFAULT_COMMIT_INTERVAL_MS,
        max_keys: int = DEFAULT_COMMIT_MAX_KEYS,
        max_pending_keys: int = DEFAULT_MAX_PENDING_KEYS,
        attempts: int = DEFAULT_COMMIT_ATTEMPTS,
        on_commit: Callable[[int], None] | None = None,
        on_point: ConsumeObserver | None = None,
    ) -> None:
        self.dedup = dedup
        self.owner = owner
        self.app_id = f"idem:{dedup.config.group}:{owner}"
        self.client = client
        self.lock_key = f"rmq:lock:{{{dedup.config.group}}}:ledger-commit"
        self.lock_ttl_ms = lock_ttl_ms
        self.interval_ms = interval_ms
        self.max_keys = max(1, max_keys)
        self.max_pending_keys = max(self.max_keys, max_pending_keys)
        self.attempts = max(1, attempts)
        self.on_commit = on_commit
        """Called with the number of keys after each successful commit."""
        self.on_point = on_point
        """Told ``ledger_committed`` after each successful commit, before its calls resolve."""
        self.commits = 0
        """Ledger commits made so far (a retried one counts once)."""
        self._unlock = load_script(client, "unlock.lua") if client is not None else None
        self._cond = threading.Condition()
        self._queue: list[CommitItem] = []
        self._queued_keys = 0
        self._pending_keys = 0  # queued + committing
        self._oldest = 0.0
        self._flushing = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._seq = 0

    # -- callers -------------------------------------------------------------------------

    def submit(self, item: CommitItem) -> Deferred:
        """Queue ``item``; its :attr:`~CommitItem.deferred` resolves once the keys are durable.

        Waits while ``max_pending_keys`` are already queued or committing.
        """
        size = len(item.keys)
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._pending_keys + size <= self.max_pending_keys
                    or self._pending_keys == 0
                    or self._closed
                )
            )
            if self._closed:
                raise RuntimeError("the group committer is closed")
            if not self._queue:
                self._oldest = time.monotonic()
            self._queue.append(item)
            self._queued_keys += size
            self._pending_keys += size
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name=f"idem-commit-{self.owner[-8:]}"
                )
                self._thread.start()
            self._cond.notify_all()
        return item.deferred

    def commit(self, item: CommitItem, timeout: float | None = None) -> CommitOutcome:
        """Queue ``item`` and wait for its commit; raises when it failed."""
        failure = self.submit(item).wait(timeout)
        if failure is not None or item.outcome is None:
            raise RuntimeError(failure.reason if failure is not None else "no outcome")
        return item.outcome

    def flush(self, timeout: float | None = None) -> bool:
        """Commit everything queued now and wait until nothing is pending; ``False`` on timeout."""
        with self._cond:
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._pending_keys == 0, timeout)
            finally:
                self._flushing -= 1

    def close(self, timeout: float | None = None) -> bool:
        """Flush, then stop the committer thread; later submits raise."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return done

    @property
    def pending_keys(self) -> int:
        """Keys queued or being committed."""
        with self._cond:
            return self._pending_keys

    # -- the committer thread ------------------------------------------------------------

    def _take(self) -> list[CommitItem] | None:
        """The next group (``None``: idle long enough, the thread ends)."""
        with self._cond:
            while not self._queue:
                if self._closed or (not self._cond.wait(IDLE_EXIT_S) and not self._queue):
                    self._thread = None
                    return None
            while True:
                wait = self._oldest + self.interval_ms / 1000 - time.monotonic()
                if (
                    wait <= 0
                    or self._flushing
                    or self._closed
                    or self._queued_keys >= self.max_keys
                ):
                    break
                self._cond.wait(wait)
            batch: list[CommitItem] = []
            keys = 0
            while self._queue and (not batch or keys + len(self._queue[0].keys) <= self.max_keys):
                item = self._queue.pop(0)
                batch.append(item)
                keys += len(item.keys)
            self._queued_keys -= keys
            self._oldest = 0.0 if self._queue else time.monotonic()  # leftovers: due now
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            try:
                self._commit(batch)
            except BaseException as exc:  # never leave a caller waiting forever
                log.exception("group commit crashed")
                for item in batch:
                    item.deferred.resolve(store_outage(f"dedup commit failed: {exc}"))
            finally:
                with self._cond:
                    self._pending_keys -= sum(len(item.keys) for item in batch)
                    self._cond.notify_all()

    def _commit(self, batch: list[CommitItem]) -> None:
        keys = [k for item in batch for k in item.keys]
        prints = [f for item in batch for f in item.prints]
        messages = [m for item in batch for m in item.messages]
        known = all(item.buckets is not None for item in batch)
        buckets = tuple(b for item in batch for b in item.buckets or ()) if known else ()
        claim = BatchClaim(
            owner=self.owner,
            keys=tuple(keys),
            fingerprints=tuple(prints),
            fresh=tuple(range(len(keys))),
            duplicates={},
            busy=(),
            invalid=(),
            ledger_version=min(item.ledger_version for item in batch),
            buckets=buckets,
            claimed_at_ms=_earliest(item.claimed_at_ms for item in batch),
        )
        meta = pa.table(
            {
                "msg_id": pa.array([m.msg_id for m in messages], pa.string()),
                "origin_msg_id": pa.array([m.origin_msg_id for m in messages], pa.string()),
                "topic": pa.array([m.topic for m in messages], pa.string()),
                "queue_id": pa.array([m.queue_id for m in messages], pa.int32()),
                "queue_offset": pa.array([m.queue_offset for m in messages], pa.int64()),
            }
        )
        seq, self._seq = self._seq, self._seq + 1
        error: BaseException | None = None
        for attempt in range(self.attempts):
            self._acquire()  # held or not, the commit goes on: Delta arbitrates
            try:
                # the same txnVersion on every attempt: a retry adds nothing the first wrote
                outcome = self.dedup.complete(claim, batch_id=seq, app_id=self.app_id, meta=meta)
            except Exception as exc:
                error = exc
                log.warning(
                    "group commit %d (%d keys), attempt %d failed: %s",
                    seq,
                    len(keys),
                    attempt + 1,
                    exc,
                )
            else:
                self.commits += 1
                if self.on_commit is not None:
                    self.on_commit(len(keys))
                if self.on_point is not None:
                    self.on_point(ConsumePoint.LEDGER_COMMITTED, messages)
                for item in batch:
                    item.outcome = outcome
                    item.deferred.resolve(None)
                return
            finally:
                # Also when not known to be held: a SET whose reply was lost may have
                # taken it (unlock.lua deletes only this owner's lock).
                self._release()
            if attempt + 1 < self.attempts:
                time.sleep(0.1 * 2**attempt)
        log.warning(
            "completing %d key(s) failed; they will be consumed again", len(keys), exc_info=error
        )
        for item in batch:
            item.deferred.resolve(store_outage(f"dedup commit failed: {error}"))

    # -- the group's commit lock -----------------------------------------------------------

    def _acquire(self) -> bool:
        if self.client is None:
            return False
        deadline = time.monotonic() + self.lock_ttl_ms / 1000
        delay = 0.001
        while time.monotonic() < deadline:
            try:
                if self.client.set(self.lock_key, self.owner, nx=True, px=self.lock_ttl_ms):
                    return True
                if _text(self.client.get(self.lock_key)) == self.owner:
                    # Ours already: an earlier SET went through but its reply was lost.
                    self.client.pexpire(self.lock_key, self.lock_ttl_ms)
                    return True
            except REDIS_TRANSIENT:
                return False  # Redis is away: commit anyway, Delta arbitrates
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        log.warning("ledger commit lock not acquired in %d ms; committing anyway", self.lock_ttl_ms)
        return False

    def _release(self) -> None:
        if self.client is not None and self._unlock is not None:
            with contextlib.suppress(*REDIS_TRANSIENT):
                self._unlock(keys=[self.lock_key], args=[self.owner])


def _earliest(times: Iterable[int | None]) -> int | None:
    """The earliest claim time (``None`` when any is unknown: the commit's time is used)."""
    earliest: int | None = None
    for at in times:
        if at is None:
            return None
        earliest = at if earliest is None else min(earliest, at)
    return earliest


def _text(value: object) -> str | None:
    """A Redis reply as text (clients may or may not decode responses)."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None
