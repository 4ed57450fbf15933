"""The dedup protocol (docs/pages/protocol.md) as one object: claim, complete, release.

Redis is a hint, the Delta ledger decides. Before a claim may answer "new",
every bucket it touches must have indexed every ledger version (its
watermark); a bucket that is behind loads only the keys of the versions it
missed, and a bucket whose watermark is gone (FLUSHALL, empty restart) is
rebuilt from the ledger's dedup window. The ledger commit comes before Redis
learns that keys are COMPLETED, so a crash between them costs a catch-up,
never a duplicate.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from numbers import Integral

import pyarrow as pa
import pyarrow.compute as pc
import redis

from idem.bucket_slices import bucket_slices
from idem.claiming import PendingClaim
from idem.clock import SYSTEM_CLOCK, Clock
from idem.commit_rows import claimed_rows, commit_rows
from idem.config import DedupMode, IdemConfig
from idem.errors import StoreUnavailable
from idem.hotstore import CompleteResult, HotStore, RedisHotStore
from idem.indexer import CATCH_UP_GRACE_MS, Indexer, IndexStats, OwnCommits, WindowLoad
from idem.keys import group_by_bucket
from idem.ledger import Ledger, open_ledger
from idem.ledger.staged import StagedRows
from idem.outcome import BatchClaim, ClaimedRows, CommitOutcome
from idem.redis_cluster import RedisClient

log = logging.getLogger(__name__)

_TXN_MAX = 2**63 - 1
"""The largest ``txnVersion`` (a Delta long), so the largest ``batch_id``."""


def _txn_version(batch_id: object) -> int:
    """``batch_id`` as a commit's ``txnVersion``, or a ``ValueError`` naming it.

    Checked before anything else: a bool passed for 1 read as a replay of batch 1,
    and a text or too big a number failed deep in Arrow or delta-rs, naming nothing.
    """
    if (
        isinstance(batch_id, bool)
        or not isinstance(batch_id, Integral)  # an int, or e.g. numpy's int64
        or not 0 <= int(batch_id) <= _TXN_MAX
    ):
        raise ValueError(
            f"batch_id: {batch_id!r} must be a whole number 0..2**63-1 (the commit's txnVersion)"
        )
    return int(batch_id)


def _succeeded_rows(claim: BatchClaim, succeeded: Iterable[int] | None) -> list[int]:
    """The rows of ``claim`` that succeeded (default: every fresh row), each claimed fresh."""
    if succeeded is None:
        return list(claim.fresh)
    indices = list(succeeded)
    fresh = set(claim.fresh)
    stray = [i for i in indices if i not in fresh]
    if stray:
        raise ValueError(f"succeeded: rows {stray[:5]} were not claimed as fresh")
    return indices


def _index_columns(columns: pa.Table) -> pa.Table:
    """What the Redis index update reads of the committed rows."""
    return columns.select(["key", "bucket", "fingerprint"])


class Dedup:
    """Exactly-once bookkeeping for one consumer group.

    ``begin`` classifies a batch (fresh / duplicate / busy / invalid) and claims
    the fresh keys for ``owner``; ``complete`` records the succeeded keys in the
    ledger and then in Redis; ``release`` gives failed keys back. One ``Dedup`` may
    serve many batches and threads of one process; :meth:`close` it at the end.

    Args:
        config: The group's settings: its Redis URL, ledger path, dedup window,
            lease length, key limits and mismatch policy.
        client: A Redis client to use instead of one built from
            ``config.redis_url`` (ignored when ``hot`` is given).
        hot: The Redis side (claims and the index of completed keys); by default
            a :class:`~idem.hotstore.RedisHotStore` on ``client``.
        ledger: The durable Delta ledger; by default
            :func:`~idem.ledger.open_ledger` of ``config``.
        clock: The time source of delays and waits. Leases and the dedup window
            run on Redis's clock with the system clock (the default); a test may
            inject another, whose instant then decides them (see
            :class:`~idem.clock.Clock`).
        catch_up_grace_ms: How long a claim waits, when the ledger is ahead of
            the Redis index, for the writer of the newer commits to index them
            before it loads them from the ledger itself.
        load_window: Where a rebuild of the Redis index loads the ledger's dedup
            window (the Spark glue passes one that runs on the executors); by
            default this process reads it and indexes it.
    """

    def __init__(
        self,
        config: IdemConfig,
        *,
        client: RedisClient | None = None,
        hot: HotStore | None = None,
        ledger: Ledger | None = None,
        clock: Clock = SYSTEM_CLOCK,
        catch_up_grace_ms: int = CATCH_UP_GRACE_MS,
        load_window: WindowLoad | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.hot: HotStore = hot or RedisHotStore.from_config(config, client=client, clock=clock)
        self.ledger: Ledger = ledger or open_ledger(config)
        self._own = OwnCommits()
        self.index = Indexer(
            config,
            self.hot,
            self.ledger,
            clock,
            grace_ms=catch_up_grace_ms,
            own=self._own,
            load_window=load_window,
        )
        self._pool: ThreadPoolExecutor | None = None
        self._indexing: Future[CompleteResult] | None = None
        self._checked = False

    def check(self) -> None:
        """Start-up checks: Redis must not evict keys (``maxmemory-policy noeviction``).

        Made before the first claim of this instance whatever the entry point (the Spark
        decorator, the consumer's middleware, ``@idempotent``); call it to fail earlier.
        """
        self.hot.check_eviction_policy()
        self._checked = True

    # -- step 1 and 2: normalise and claim -------------------------------------------------

    def begin(
        self,
        keys: Sequence[object],
        *,
        owner: str,
        fingerprints: Sequence[str] | None = None,
        order: Sequence[int] | None = None,
        field: str = "key",
        hold: bool = True,
    ) -> BatchClaim:
        """Classify every row of a batch and claim its fresh keys for ``owner``.

        ``order`` is the precedence of rows for in-batch duplicates (e.g. the
        indices sorted by queue offset, then born time); by default input order.
        ``fingerprints`` (one per row) tell a duplicate that arrives with another
        payload. ``hold=False`` takes no leases: only for a sink whose write is
        the ledger commit itself (:meth:`complete` with ``payload``), which the
        ledger checks against every commit since the claim. The same as
        :meth:`start` then :meth:`PendingClaim.finish`.
        """
        if fingerprints is not None and len(fingerprints) != len(keys):
            raise ValueError(f"fingerprints: {len(fingerprints)} given for {len(keys)} keys")
        pending = self.start(keys, owner=owner, order=order, field=field, hold=hold)
        return pending.finish(fingerprints)

    def start(
        self,
        keys: Sequence[object],
        *,
        owner: str,
        order: Sequence[int] | None = None,
        field: str = "key",
        hold: bool = True,
    ) -> PendingClaim:
        """:meth:`begin` up to the claims sent to Redis; its ``finish`` reads the verdicts.

        Redis runs the claims meanwhile, so the caller can do other work before
        ``finish``. ``finish`` or ``abandon`` must follow: either gives the Redis
        connection back (``abandon`` also gives back the leases taken).
        """
        rows = order if order is not None else range(len(keys))
        if order is not None and (len(order) != len(keys) or set(order) != set(range(len(keys)))):
            raise ValueError(f"order: must list each of the {len(keys)} rows once")
        if not self._checked:
            self.check()
        return PendingClaim(self, keys, owner=owner, order=rows, field=field, hold=hold)

    def catch_up(self, buckets: Iterable[int] | None = None, *, recheck: bool = False) -> int:
        """Bring the Redis index of ``buckets`` (default all) up to the ledger; return its version.

        Waits for a deferred index update of this object first. Steady state costs
        one cheap ledger version check (see :class:`Indexer`); ``recheck`` reads the
        watermarks even when they were found caught up with this version before.
        """
        self.settle()
        return self.index.catch_up(buckets, recheck=recheck)

    @property
    def stats(self) -> IndexStats:
        """What keeping Redis a complete index of the ledger has cost so far."""
        return self.index.stats

    # -- step 5 and 6: commit or release ---------------------------------------------------

    def complete(
        self,
        claim: BatchClaim,
        *,
        succeeded: Iterable[int] | None = None,
        batch_id: int,
        app_id: str | None = None,
        meta: pa.Table | None = None,
        payload: pa.Table | StagedRows | None = None,
        results: Mapping[int, str] | None = None,
        defer_index: bool = False,
    ) -> CommitOutcome:
        """Record the succeeded rows (default: every fresh row) as done: ledger first, then Redis.

        With ``defer_index`` the Redis update runs in the background after the
        durable ledger commit and this returns at once (``fenced`` is then
        logged, not returned); the next :meth:`begin`/:meth:`catch_up` of this
        object waits for it first (:meth:`settle`). Until it lands, the keys stay
        claimed by this owner, and if the process dies first the next claim loads
        the commit from the ledger: the crash window the protocol already covers.

        ``meta`` (aligned with the batch's input rows) may carry ``msg_id``,
        ``origin_msg_id``, ``topic``, ``queue_id``, ``queue_offset``;
        ``payload`` (aligned with the succeeded rows) adds the user's columns
        so a Delta sink table can be its own ledger; as :class:`StagedRows` (the
        succeeded rows, every column, kept in files) the commit streams them and
        only their ledger columns are held here (``results`` cannot go with
        them: the staged rows carry their own). ``app_id``/``batch_id``
        become the commit's ``txnAppId``/``txnVersion``: a replayed batch adds
        nothing.
        """
        batch_id = _txn_version(batch_id)
        indices = _succeeded_rows(claim, succeeded)
        if not indices:
            return CommitOutcome(version=None, committed=0)
        rows = claimed_rows(
            claim,
            indices,
            every_row=succeeded is None and len(indices) == len(claim.keys),
            bucket_count=self.config.buckets,
            meta=meta,
            results=results,
        )
        return self._commit(
            rows, batch_id=batch_id, app_id=app_id, payload=payload, defer_index=defer_index
        )

    def complete_rows(
        self,
        rows: ClaimedRows,
        *,
        batch_id: int,
        app_id: str | None = None,
        payload: pa.Table | StagedRows | None = None,
        defer_index: bool = False,
    ) -> CommitOutcome:
        """:meth:`complete` of rows claimed elsewhere, every one succeeded, given as Arrow
        columns (Spark's driver, whose executors claimed them).

        The ledger rows are made from the columns, the slipped keys are found with
        Arrow, and Redis learns the keys a call's worth at a time: no Python object
        is made per row of the batch (but for a replayed batch, whose keys are
        looked up in the ledger). ``payload`` (aligned with ``rows``) is as in
        :meth:`complete`.
        """
        batch_id = _txn_version(batch_id)
        if not rows.num_rows:
            return CommitOutcome(version=None, committed=0)
        return self._commit(
            rows, batch_id=batch_id, app_id=app_id, payload=payload, defer_index=defer_index
        )

    def _commit(
        self,
        rows: ClaimedRows,
        *,
        batch_id: int,
        app_id: str | None,
        payload: pa.Table | StagedRows | None,
        defer_index: bool,
    ) -> CommitOutcome:
        """The ledger commit of ``rows``, then their Redis index update."""
        # completed_at starts the key's window: stamped by the clock the window runs on.
        now = self.hot.now_ms()
        committed = commit_rows(
            rows, payload, group=self.config.group, batch_id=batch_id, now_ms=now
        )
        strict = self.config.mode is DedupMode.STRICT
        # When the commit cannot check the versions since the claim one by one, it MERGEs
        # on the rows completed within a horizon before the claim. A lease kept every
        # other writer off the key since the claim, so twice the lease covers a copy
        # stamped before the claim that landed after it (and every copy stamped since);
        # a claim without leases covers nothing, so it matches the whole dedup window.
        leased = rows.held and not strict
        window = 2 * self.config.lease_ms if leased else self.config.dedup_window_ms
        claimed_at = now if rows.claimed_at_ms is None else min(now, rows.claimed_at_ms)
        app = app_id or f"idem:{self.config.group}:{rows.owner}"
        result = self.ledger.commit(
            committed,
            app_id=app,
            txn_version=batch_id,
            match_since_ms=claimed_at - window,
            match_after_version=None if strict else rows.ledger_version,
        )
        if result.replayed:
            return self._complete_replayed(
                rows, now=now, batch_id=batch_id, app_id=app, payload=payload
            )
        version = result.version if result.version is not None else -2
        index = _index_columns(rows.columns)
        if result.already_present:
            index = self._drop_slipped(rows, result.already_present, index)
        fenced = self._index(rows.owner, index, version=version, now=now, defer=defer_index)
        if result.already_present:
            log.warning(
                "%d key(s) were already in the ledger when committed (slipped duplicates), e.g. %r",
                len(result.already_present),
                result.already_present[0],
            )
        return CommitOutcome(
            version=result.version,
            committed=result.inserted,
            slipped=tuple(result.already_present),
            fenced=tuple(fenced),
            replayed=result.replayed,
        )

    def _drop_slipped(self, rows: ClaimedRows, slipped: Sequence[str], index: pa.Table) -> pa.Table:
        """The committed rows' ``index`` columns without the ``slipped`` keys, whose leases
        go back.

        Another writer's row holds a slipped key, with its own fingerprint, and the
        index gets the key from that row's version: marking it here would overwrite
        that fingerprint with this copy's.
        """
        gone = set(slipped)
        if rows.held:
            self.hot.release(group_by_bucket(gone, self.config.buckets), rows.owner)
        dropped = pc.is_in(index.column("key"), value_set=pa.array(sorted(gone), pa.string()))
        return index.filter(pc.invert(dropped))

    def _index(
        self, owner: str, index: pa.Table, *, version: int, now: int, defer: bool
    ) -> list[str]:
        """Mark the ``index`` rows' keys COMPLETED at ``version``: now (returning the fenced
        keys), or in the background (``defer``: they are logged by :meth:`settle`)."""
        if defer:
            # No OwnCommits entry: every catch-up of this object settles this update first.
            self.settle()
            self._indexing = self._indexer().submit(
                self._index_completed, owner, index, version=version, completed_at_ms=now
            )
            return []
        with self._own.indexing(version):
            done = self._index_completed(owner, index, version=version, completed_at_ms=now)
        return done.fenced

    def _index_completed(
        self, owner: str, index: pa.Table, *, version: int, completed_at_ms: int
    ) -> CompleteResult:
        """Tell Redis that the ``index`` rows' keys are COMPLETED at ledger ``version``."""
        parts = bucket_slices(
            index.column("key"),
            index.column("bucket"),
            index.column("fingerprint"),
            bucket_count=self.config.buckets,
        )
        return self.hot.complete_buckets(
            parts, owner, version=version, completed_at_ms=completed_at_ms
        )

    def settle(self) -> CompleteResult | None:
        """Wait for a deferred Redis update (``complete(defer_index=True)``); ``None`` if none.

        A failed update is logged, not raised: the ledger commit is durable and
        the next claim loads what Redis missed.
        """
        pending, self._indexing = self._indexing, None
        if pending is None:
            return None
        try:
            done = pending.result()
        except (StoreUnavailable, redis.RedisError) as exc:
            log.warning("deferred Redis index update failed (%s); the next claim catches up", exc)
            return None
        if done.fenced:
            log.warning(
                "%d key(s) were claimed by another owner when this one completed them, e.g. %r",
                len(done.fenced),
                done.fenced[0],
            )
        return done

    def close(self) -> None:
        """Finish a deferred Redis update and stop its thread."""
        self.settle()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _indexer(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="idem-index")
        return self._pool

    def _complete_replayed(
        self,
        rows: ClaimedRows,
        *,
        now: int,
        batch_id: int,
        app_id: str,
        payload: pa.Table | StagedRows | None,
    ) -> CommitOutcome:
        """The batch's txn was committed before (a replay): complete only what the ledger holds.

        A replay may succeed for rows that failed the first time; those are not in
        the earlier commit, so they are committed now under a txn of their own.
        Marking them COMPLETED in Redis without a ledger row would lose them.
        """
        keys = rows.columns.column("key")
        since = now - self.config.dedup_window_ms
        present = self.ledger.existing(keys.to_pylist(), since_ms=since)
        held = pc.is_in(keys, value_set=pa.array(list(present), pa.string()))
        fenced: list[str] = []
        if present:
            # -2 never moves a watermark: the keys were indexed with their own version.
            index = _index_columns(rows.columns).filter(held)
            fenced = self._index_completed(
                rows.owner, index, version=-2, completed_at_ms=now
            ).fenced
        missing = pc.invert(held)
        late_rows = dataclasses.replace(rows, columns=rows.columns.filter(missing))
        if not late_rows.num_rows:
            return CommitOutcome(version=None, committed=0, fenced=tuple(fenced), replayed=True)
        log.warning(
            "batch %d was committed before without %d key(s) that succeeded now; committing them",
            batch_id,
            late_rows.num_rows,
        )
        late_payload: pa.Table | StagedRows | None = None
        if isinstance(payload, StagedRows):
            late_payload = payload.only(late_rows.columns.column("key").to_pylist())
        elif payload is not None:
            late_payload = payload.filter(missing)
        late = self._commit(
            late_rows,
            batch_id=batch_id,
            app_id=f"{app_id}:late:{now}",
            payload=late_payload,
            defer_index=False,
        )
        return CommitOutcome(
            version=late.version,
            committed=late.committed,
            slipped=late.slipped,
            fenced=tuple(fenced) + late.fenced,
            replayed=True,
        )

    def release(self, claim: BatchClaim, indices: Iterable[int] | None = None) -> int:
        """Give back the claims of failed rows (compare-and-delete by owner)."""
        chosen = claim.fresh if indices is None else tuple(indices)
        keys = [k for k in (claim.keys[i] for i in chosen) if k is not None]
        if not keys:
            return 0
        return self.hot.release(group_by_bucket(keys, self.config.buckets), claim.owner)
