"""The hot store of the dedup layer: business-key claims in Redis, one Lua call per bucket.

Redis is an index over the Delta ledger. Every bucket of a group has its own hash
tag, so a bucket lives in one Redis Cluster slot::

    idem:{<group>:<bucket>}:p:<width>:<pgen>   hash: <key> -> P|<owner>|<lease_until_ms>|<attempt>
    idem:{<group>:<bucket>}:c:<window>:<gen>   hash: <key> -> <fingerprint>|<completed_at_ms>
    idem:{<group>:<bucket>}:wm                 "<version>|<window>": every ledger version
                                               <= version is indexed here, for this window
    idem:{<group>:<bucket>}:o:<owner>          hash: <key> -> 1, the keys an owner that claimed
                                               with ``track`` holds here (lives one lease)

COMPLETED keys live in generation hashes (``gen = completed_at // window``, TTL to
the end of the next generation), so a key is COMPLETED exactly while
``completed_at + window > now`` and the current and previous generations hold every
live one. Claims live in generation hashes as well (``pgen = claimed_at //
CLAIM_GEN_MS``; the ``ceil(lease / CLAIM_GEN_MS)`` generations before the current
one hold every live lease, and a claim hash expires when it leaves that range),
so an abandoned claim is remembered (a replay re-takes it, another owner takes it
over as ``reclaimed``) for at least an hour and at most until its hash expires.
Claims and completions of a whole chunk then cost a few C-level commands
(HMGET, HSET, HDEL) instead of one command per key, the keyspace does not grow
with the window or the batch (millions of TTL'd top-level keys make every Redis
command slower), and the index takes about half the memory.

A missing watermark means the bucket's index is unknown (FLUSHALL, empty restart):
claims there answer "stale", never "new", until :meth:`RedisHotStore.index_completed`
rebuilds it. Leases and the dedup window run on Redis's clock: the scripts read
``TIME`` (a client whose clock is stepped takes over no live lease and re-admits
no completed key), and the caller names the hashes a call may touch, and stamps
``completed_at``, from its estimate of that clock (:mod:`idem.server_time`). A
store given an injected clock other than the system clock (a test's
:class:`~idem.clock.ManualClock`) passes that clock's instant to the scripts
instead, which decide by it.

Each call is one pipeline round trip carrying one EVALSHA per bucket chunk (on a
Redis Cluster one per primary owning some of the buckets, see
:mod:`idem.redis_cluster`; the scripts in ``idem/lua/`` document KEYS, ARGV and
replies). A claim on a single server writes each chunk's call to the connection
as soon as it is built instead (:class:`~idem.claim_calls.ClaimCalls`), so Redis
runs it while the caller prepares the next. Keys travel as plain ARGV and the scripts prefix them,
which keeps Python cheap; every name they build shares the hash tag of the
declared ``KEYS[1]``. redis-py may resend a pipeline after a
connection error: every script is safe to run twice (a re-sent claim is ``retaken``).
Needs Redis >= 7.0.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from importlib import resources
from itertools import chain
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.commands.core import Script

from idem import metrics
from idem.claim_calls import CLAIM_CHUNK, ClaimCalls, as_text
from idem.clock import SYSTEM_CLOCK, Clock, SystemClock
from idem.complete_calls import CompleteCalls, listed_keys
from idem.config import IdemConfig
from idem.errors import ConfigError, StoreUnavailable
from idem.hotstore_types import (
    ABSENT,
    BucketKeys,
    ClaimResult,
    CompleteResult,
    HotStore,
    KeyState,
    KeyStatus,
)
from idem.keys import bucket_of
from idem.redis_client import check_eviction_policy, connect
from idem.redis_cluster import RedisClient, RoutedPipelines
from idem.redis_stream import ScriptCall, ScriptCalls
from idem.server_time import SLACK_MS, Instant, ServerClock

__all__ = [
    "ClaimResult",
    "CompleteResult",
    "HotStore",
    "KeyState",
    "KeyStatus",
    "RedisHotStore",
]

log = logging.getLogger(__name__)

CLAIM_GEN_MS = 3_600_000
"""Width of a claim generation (one hash per bucket): the least time a claim is remembered."""
COMPLETE_CHUNK = 1_000  # keys per complete call
INDEX_CHUNK = 5_000  # keys per ledger-load call
INDEX_CHUNKS_PER_PIPELINE = 8  # so a window rebuild never buffers everything at once
SETTLE_LOOKUPS = 50_000  # lookups per settle call: ~15 ms of Redis time, then others run
SETTLE_CALLS_PER_PIPELINE = 8  # so settling tens of millions of keys is many short round trips
SESSION_TTL_MS = 600_000  # life of the chunk counter of an unfinished complete/load
RENEW_SCAN = 1_000  # keys an owner's renewal looks at per call (see renew.lua)
MAX_OWNER_CHARS = 256
_SPAN_DECLARED = 3  # generations an index call declares as a range (else the exact ones)

_GROUP = re.compile(r"[A-Za-z0-9_.\-]{1,200}")


def _load_script(client: RedisClient, name: str) -> Script:
    folder = resources.files("idem").joinpath("lua")
    prelude = folder.joinpath("_prelude.lua").read_text(encoding="utf-8")
    return client.register_script(prelude + folder.joinpath(name).read_text(encoding="utf-8"))


def _version(name: str, value: int) -> str:
    # Any whole number: -1 is the version of a table that does not exist yet, and a
    # caller may pass lower values on purpose (e.g. "complete, never move the watermark").
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: {value!r} is not a ledger version (a whole number)")
    return str(value)


class RedisHotStore:
    """Claims, completions and the ledger index of one consumer group in Redis.

    ``client`` is a redis-py client (``decode_responses`` either way); ``lease_ms``
    is how long a claim holds a key, ``completed_ttl_ms`` the dedup window a
    COMPLETED key stays in Redis. With the system ``clock`` (the default) leases
    and the window run on Redis's clock; any other clock (a test's) decides them
    by its own instant, see :meth:`now_ms`.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        group: str,
        buckets: int,
        lease_ms: int,
        completed_ttl_ms: int,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not isinstance(group, str) or not _GROUP.fullmatch(group):
            raise ValueError(
                f"group: {group!r} must be 1..200 characters of letters, digits, '_', '.', '-'"
            )
        for name, value, low in (
            ("buckets", buckets, 1),
            ("lease_ms", lease_ms, 1),
            ("completed_ttl_ms", completed_ttl_ms, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: {value!r} must be a whole number >= {low}")
        self.client = client
        self.group = group
        self.buckets = buckets
        self.lease_ms = lease_ms
        self.completed_ttl_ms = completed_ttl_ms
        self.clock = clock
        self._server = ServerClock(client, group)  # read only while ``clock`` is the system's
        tags = [f"idem:{{{group}:{bucket}}}" for bucket in range(buckets)]
        self._span = -(-lease_ms // CLAIM_GEN_MS)  # older claim generations a live lease may sit in
        self._claim_gens = f"{CLAIM_GEN_MS}:{self._span}"
        self._window = str(completed_ttl_ms)
        self._wm = [f"{tag}:wm" for tag in tags]
        self._tags = tags
        self._claim = _load_script(client, "claim.lua")
        self._complete = _load_script(client, "complete.lua")
        self._release = _load_script(client, "release.lua")
        self._index = _load_script(client, "index.lua")
        self._settle = _load_script(client, "settle.lua")
        self._renew = _load_script(client, "renew.lua")

    @classmethod
    def from_config(
        cls, config: IdemConfig, *, client: RedisClient | None = None, clock: Clock = SYSTEM_CLOCK
    ) -> RedisHotStore:
        """A store for ``config.group``; a client is built from ``config.redis_url`` if not given.

        The built client gives up after 3 quick reconnect attempts and a 30 s read
        timeout, so an unreachable Redis surfaces as :class:`StoreUnavailable`.
        """
        if client is None:
            client = connect(config.redis_url)
        return cls(
            client,
            group=config.group,
            buckets=config.buckets,
            lease_ms=config.lease_ms,
            completed_ttl_ms=config.dedup_window_ms,
            clock=clock,
        )

    # -- time --------------------------------------------------------------------------

    def now_ms(self) -> int:
        """The time leases and the dedup window run on, in epoch milliseconds: Redis's
        clock (estimated, see :class:`~idem.server_time.ServerClock`) with the system
        clock, else the injected clock's reading. Stamp ``completed_at`` with it."""
        if isinstance(self.clock, SystemClock):
            return self._server_ms()
        return self.clock.now_ms()

    def instant(self) -> Instant:
        """When a script call made now runs: Redis's ``TIME`` within :data:`SLACK_MS`
        of :meth:`now_ms` with the system clock, else exactly the injected clock's now."""
        if isinstance(self.clock, SystemClock):
            return Instant(self._server_ms(), SLACK_MS, "")
        now = self.clock.now_ms()
        return Instant(now, 0, str(now))

    def _server_ms(self) -> int:
        try:
            return self._server.now_ms()
        except StoreUnavailable:
            metrics.count("redis_errors", self.group, component="dedup")
            raise

    # -- names -------------------------------------------------------------------------

    def claim_hash(self, key: str) -> str:
        """The Redis hash a claim of ``key`` made now goes to (the field is the key)."""
        tag = self._tags[bucket_of(key, self.buckets)]
        return self._claim_names(tag, self.now_ms())[0]

    def _claim_names(self, tag: str, now_ms: int, slack_ms: int = 0) -> list[str]:
        """The claim generation hashes a call at ``now_ms`` (give or take ``slack_ms``)
        may touch, newest first."""
        newest = (now_ms + slack_ms) // CLAIM_GEN_MS
        oldest = (now_ms - slack_ms) // CLAIM_GEN_MS - self._span
        return [f"{tag}:p:{CLAIM_GEN_MS}:{pgen}" for pgen in range(newest, oldest - 1, -1)]

    def _completed_name(self, tag: str, gen: int) -> str:
        """The hash of the keys completed in generation ``gen`` (``completed_at // window``)."""
        return f"{tag}:c:{self._window}:{gen}"

    def owned_name(self, bucket: int, owner: str) -> str:
        """The hash of the keys ``owner`` claimed with ``track`` in ``bucket``."""
        return f"{self._tags[self._bucket(bucket)]}:o:{owner}"

    def watermark_name(self, bucket: int) -> str:
        """The Redis name of a bucket's watermark."""
        return self._wm[self._bucket(bucket)]

    # -- checks ------------------------------------------------------------------------

    def check_eviction_policy(self) -> None:
        """Refuse a Redis that may evict keys (``maxmemory-policy`` must be ``noeviction``)."""
        check_eviction_policy(self.client)

    def _bucket(self, bucket: int) -> int:
        if type(bucket) is not int or not 0 <= bucket < self.buckets:
            raise ValueError(f"bucket: {bucket!r} is outside 0..{self.buckets - 1}")
        return bucket

    @staticmethod
    def _owner(owner: str) -> str:
        if not isinstance(owner, str) or not owner:
            raise ValueError(f"owner: {owner!r} must be a non-empty string")
        if "|" in owner:
            raise ValueError(f"owner: {owner!r} must not contain '|'")
        if len(owner) > MAX_OWNER_CHARS:
            raise ValueError(f"owner: {len(owner)} characters; the limit is {MAX_OWNER_CHARS}")
        return owner

    # -- what a claim call needs (see :class:`~idem.claim_calls.ClaimCalls`) ---------------

    def claim_route(self, bucket: int, now_ms: int, slack_ms: int = 0) -> tuple[str, list[str]]:
        """The hash tag of ``bucket`` and the KEYS of a claim there at ``now_ms`` (give or
        take ``slack_ms``): the watermark, the completed generations it reads
        (:meth:`_read_generations`), the claim generations."""
        tag = self._tags[self._bucket(bucket)]
        gens = sorted(
            {*self._read_generations(now_ms - slack_ms), *self._read_generations(now_ms + slack_ms)}
        )
        return tag, [
            self._wm[bucket],
            *(self._completed_name(tag, g) for g in gens),
            *self._claim_names(tag, now_ms, slack_ms),
        ]

    def _read_generations(self, now_ms: int) -> tuple[int, int, int]:
        """The completed generations a read at ``now_ms`` looks in: the current, the
        previous (keys completed less than a window ago) and the next (completed by a
        writer whose clock runs ahead, past a boundary this reader's clock has not
        reached: missing it, a claim answered "new" for a key already done)."""
        gen = now_ms // self.completed_ttl_ms
        return gen, gen - 1, gen + 1

    def claim_arguments(
        self, now_ms: int | str, owner: str, *, min_version: int, mode: str
    ) -> list[str]:
        """ARGV[2..8] of claim.lua (ARGV[1] is the bucket's tag, the keys follow); ``now_ms``
        is an :class:`~idem.server_time.Instant`'s ``arg`` (``""``: Redis's clock) or a
        test clock's instant; ``mode`` is ``hold``, ``look`` or ``renew`` (see the script)."""
        return [
            str(now_ms), owner, str(self.lease_ms), self._claim_gens,
            _version("min_version", min_version), self._window, mode,
        ]  # fmt: skip

    @property
    def claim_script(self) -> Script:
        """claim.lua, registered on this store's client."""
        return self._claim

    def run_claims(self, calls: Iterable[ScriptCall]) -> list[Any]:
        """``(tag, KEYS, ARGV)`` claim calls in one routed round trip; their replies."""
        return self._run_calls(self._claim, calls, "claim")

    def _run_calls(self, script: Script, calls: Iterable[ScriptCall], operation: str) -> list[Any]:
        pipes = self._pipes()
        for tag, routing, args in calls:
            script(keys=routing, args=args, client=pipes.pipe(tag))
        return self._run(pipes, operation)

    def _script_calls(self, script: Script, operation: str) -> ScriptCalls:
        """Calls of ``script`` streamed to a single server as they are made (a Cluster's
        go in one routed round trip when their replies are read)."""
        return ScriptCalls(
            self.client,
            script,
            lambda calls: self._run_calls(script, calls, operation),
            stream=not isinstance(self.client, RedisCluster),
        )

    def checked(self, replies: list[Any], operation: str) -> list[Any]:
        """``replies`` of streamed calls; raises :class:`StoreUnavailable` on an error reply."""
        for reply in replies:
            if isinstance(reply, redis.RedisError):
                self._failed(reply)
                metrics.count("redis_errors", self.group, component="dedup")
                raise StoreUnavailable(
                    f"Redis {operation} for group {self.group!r} failed: {reply} "
                    "(the outcome is unknown; read the state again before acting on it)"
                ) from reply
        return replies

    def _failed(self, error: redis.RedisError) -> None:
        """A script refused a hash it was not given: Redis's clock is not where this
        process thought (stepped on the server). Read it again before the next call."""
        if "without declaring it in KEYS" in str(error):
            self._server.forget()

    def _pipes(self) -> RoutedPipelines:
        """One round trip per server (per primary on a Cluster) for commands of many buckets."""
        return RoutedPipelines(self.client)

    def _run(self, pipe: RoutedPipelines, operation: str) -> list[Any]:
        try:
            replies: list[Any] = pipe.execute()
        except redis.RedisError as exc:
            self._failed(exc)
            metrics.count("redis_errors", self.group, component="dedup")
            raise StoreUnavailable(
                f"Redis {operation} for group {self.group!r} failed: {exc} "
                "(the outcome is unknown; read the state again before acting on it)"
            ) from exc
        return replies

    # -- claims ------------------------------------------------------------------------

    def claim(
        self,
        keys_by_bucket: Mapping[int, Sequence[str]],
        owner: str,
        *,
        min_version: int,
        hold: bool = True,
    ) -> ClaimResult:
        """Claim keys for ``owner``, atomically per key, in one round trip.

        COMPLETED → duplicate; another owner's live lease → busy; absent, expired or
        held by ``owner`` → claimed. A bucket whose watermark is missing or below
        ``min_version`` (the ledger's current version) claims nothing and is
        reported stale. ``hold=False`` gives the same verdicts without taking the
        leases: for a sink whose commit is the ledger's checked append, which
        alone keeps a key from being written twice.
        """
        return self._claimed(
            ClaimCalls(self, self._owner(owner), min_version=min_version, hold=hold),
            keys_by_bucket,
        )

    def renew(self, keys_by_bucket: Mapping[int, Sequence[str]], owner: str) -> list[str]:
        """Give ``owner``'s claims of these keys a new lease from now; returns the keys
        renewed. Only claims ``owner`` still holds are touched: an absent, completed or
        released key, or one another owner holds, stays as it is."""
        calls = ClaimCalls(self, self._owner(owner), min_version=-1, renew=True)
        return self._claimed(calls, keys_by_bucket).retaken

    @staticmethod
    def _claimed(calls: ClaimCalls, keys_by_bucket: Mapping[int, Sequence[str]]) -> ClaimResult:
        try:
            calls.add(keys_by_bucket)
        except BaseException:
            calls.abandon()  # reads what was sent: the connection goes back clean
            raise
        return calls.result()

    def start_claim(
        self, owner: str, *, min_version: int, hold: bool = True, track: bool = False
    ) -> ClaimCalls:
        """A :meth:`claim` whose keys are added in parts, each sent to Redis at once
        (on a single server) while the caller prepares the next; see :class:`ClaimCalls`.
        ``track`` (with ``hold``) also records the claimed keys for :meth:`renew_tracked`."""
        return ClaimCalls(self, self._owner(owner), min_version=min_version, hold=hold, track=track)

    def renew_tracked(self, owner: str) -> int:
        """Give every claim ``owner`` still holds among the keys it claimed with ``track``
        a new lease from now; returns how many were renewed.

        One ``renew.lua`` call per bucket and about :data:`RENEW_SCAN` of the owner's
        keys there, none of them sent by or to the caller: the work on the caller's
        side is O(buckets), whatever the number of keys. Keys completed, released or
        taken over meanwhile are left alone (and forgotten).
        """
        self._owner(owner)
        cursors = dict.fromkeys(range(self.buckets), "0")
        renewed = 0
        while cursors:
            pipes = self._pipes()
            order = list(cursors)
            when = self.instant()
            for bucket in order:
                tag = self._tags[bucket]
                routing = [
                    self.owned_name(bucket, owner),
                    *self._claim_names(tag, when.ms, when.slack_ms),
                ]
                args = [
                    tag, owner, when.arg, str(self.lease_ms), self._claim_gens,
                    cursors[bucket], str(RENEW_SCAN),
                ]  # fmt: skip
                self._renew(keys=routing, args=args, client=pipes.pipe(tag))
            replies = self._run(pipes, "renew")
            cursors = {}
            for bucket, (cursor, count) in zip(order, replies, strict=True):
                renewed += int(count)
                if as_text(cursor) != "0":
                    cursors[bucket] = as_text(cursor)
        return renewed

    def untrack(self, owner: str) -> None:
        """Forget the keys ``owner`` claimed with ``track`` (its claims stay as they are)."""
        self._owner(owner)
        pipes = self._pipes()
        for bucket in range(self.buckets):
            pipes.pipe(self._tags[bucket]).delete(self.owned_name(bucket, owner))
        self._run(pipes, "untrack")

    def _decided(
        self, keys_by_bucket: Mapping[int, Sequence[str]], buckets: Iterable[int] | None
    ) -> Sequence[int]:
        """The buckets a :meth:`complete` decides, checked: each is one of the group's,
        and every bucket holding keys is among them."""
        for bucket in keys_by_bucket:
            self._bucket(bucket)
        decided = range(self.buckets) if buckets is None else sorted(set(buckets))
        for bucket in decided:
            self._bucket(bucket)
        stray = set(keys_by_bucket) - set(decided)
        if stray:
            raise ValueError(f"buckets: keys given for buckets {sorted(stray)} outside the call")
        return decided

    def complete(
        self,
        keys_by_bucket: Mapping[int, Sequence[str]],
        owner: str,
        fingerprints: Mapping[str, str],
        *,
        version: int,
        completed_at_ms: int | None = None,
        buckets: Iterable[int] | None = None,
    ) -> CompleteResult:
        """Mark keys COMPLETED (for the dedup window) once ledger ``version`` holds them.

        Fencing: a key another owner holds with a live lease is left alone and
        reported in ``fenced``; absent, own, expired and already completed keys are
        completed. A ledger version covers the whole group, so every bucket's
        watermark moves to ``version`` — where it exists, was at least
        ``version - 1`` and nothing in the bucket was fenced. ``buckets`` limits
        the call to those buckets (default: all), for writers that index one
        version's keys a share of the buckets each: every key of a bucket given
        must be in this call, and only those buckets' watermarks move.
        """
        self._owner(owner)
        decided = self._decided(keys_by_bucket, buckets)
        parts = [listed_keys(b, keys_by_bucket.get(b, ()), fingerprints) for b in decided]
        return self._completion(owner, version, completed_at_ms).run(parts)

    def complete_buckets(
        self,
        parts: Iterable[BucketKeys],
        owner: str,
        *,
        version: int,
        completed_at_ms: int | None = None,
    ) -> CompleteResult:
        """:meth:`complete` of the buckets ``parts`` name, each part with every key of its
        bucket; their keys are read a call's worth at a time (and checked by the caller)."""
        self._owner(owner)
        return self._completion(owner, version, completed_at_ms).run(parts)

    def _completion(self, owner: str, version: int, completed_at_ms: int | None) -> CompleteCalls:
        return CompleteCalls(
            self, owner, version=version, completed_at_ms=completed_at_ms, chunk=COMPLETE_CHUNK
        )

    # -- what a complete call needs (see :class:`~idem.complete_calls.CompleteCalls`) --------

    def complete_route(
        self, bucket: int, token: str, when: Instant, at_ms: int, *, keys: bool
    ) -> tuple[str, list[str]]:
        """The hash tag of ``bucket`` and the KEYS of a complete call there (``keys``: it
        carries keys) at ``when``, of keys completed at ``at_ms``, in session ``token``."""
        tag = self._tags[self._bucket(bucket)]
        routing = [self._wm[bucket], f"{tag}:s:{token}"]
        if keys:
            routing += [
                self._completed_name(tag, at_ms // self.completed_ttl_ms),
                *self._claim_names(tag, when.ms, when.slack_ms),
            ]
        return tag, routing

    def complete_arguments(self, owner: str, now: str, at_ms: int, version: int) -> list[str]:
        """ARGV[2..7] of complete.lua (ARGV[1] is the bucket's tag, the mode follows);
        ``now`` is an :class:`~idem.server_time.Instant`'s ``arg``."""
        return [
            owner,
            now,
            self._claim_gens,
            str(at_ms),
            _version("version", version),
            self._window,
        ]

    def complete_calls(self) -> ScriptCalls:
        """A new stream of complete.lua calls."""
        return self._script_calls(self._complete, "complete")

    @property
    def session_ttl_ms(self) -> int:
        """The life of the chunk counter of an unfinished multi-call completion."""
        return SESSION_TTL_MS

    def release(self, keys_by_bucket: Mapping[int, Sequence[str]], owner: str) -> int:
        """Give back ``owner``'s claims (compare-and-delete); return how many were released.

        COMPLETED keys and keys another owner holds are never touched.
        """
        self._owner(owner)
        pipes = self._pipes()
        calls = 0
        for bucket, keys in keys_by_bucket.items():
            self._bucket(bucket)
            tag = self._tags[bucket]
            when = self.instant()
            head = [tag, owner, when.arg, self._claim_gens]
            routing = [self._wm[bucket], *self._claim_names(tag, when.ms, when.slack_ms)]
            for start in range(0, len(keys), CLAIM_CHUNK):
                chunk = keys[start : start + CLAIM_CHUNK]
                self._release(keys=routing, args=head + list(chunk), client=pipes.pipe(tag))
                calls += 1
        if not calls:
            return 0
        return sum(int(n) for n in self._run(pipes, "release"))

    # -- reads -------------------------------------------------------------------------

    def lookup(self, keys_by_bucket: Mapping[int, Sequence[str]]) -> dict[str, KeyState]:
        """The stored state of each key (``ABSENT`` when Redis holds nothing).

        A key COMPLETED within the window wins over any claim left on it; the window
        runs on :meth:`now_ms` (Redis's clock in production).
        """
        now = self.now_ms()
        gens = self._read_generations(now)
        pipes = self._pipes()
        plan: list[Sequence[str]] = []
        for bucket, keys in keys_by_bucket.items():
            tag = self._tags[self._bucket(bucket)]
            hashes = [self._completed_name(tag, g) for g in gens]
            hashes += self._claim_names(tag, now)
            for start in range(0, len(keys), CLAIM_CHUNK):
                chunk = list(keys[start : start + CLAIM_CHUNK])
                for name in hashes:
                    pipes.pipe(tag).hmget(name, chunk)
                plan.append(chunk)
        replies = self._run(pipes, "lookup") if plan else []
        per_chunk = len(gens) + 1 + self._span
        states: dict[str, KeyState] = {}
        for n, asked in enumerate(plan):
            cur, prev, ahead, *claims = replies[per_chunk * n : per_chunk * (n + 1)]
            for i, key in enumerate(asked):
                claim = next((c[i] for c in claims if c[i] is not None), None)
                states[key] = self._state(now, (cur[i], ahead[i], prev[i]), claim)
        return states

    def _state(self, now: int, stored_values: Sequence[Any], claim: Any) -> KeyState:
        for stored in stored_values:
            if stored is not None:
                fingerprint, _, at = as_text(stored).rpartition("|")
                if int(at) + self.completed_ttl_ms > now:
                    return KeyState(
                        KeyStatus.COMPLETED, fingerprint=fingerprint, completed_at_ms=int(at)
                    )
        return ABSENT if claim is None else _parse_claim(as_text(claim))

    def watermarks(self, buckets: Iterable[int] | None = None) -> dict[int, int | None]:
        """Each bucket's watermark: the ledger version it has indexed, ``None`` if unknown.

        A watermark written for another dedup window counts as unknown (the index
        is rebuilt for ours): every process of a group should use one window.
        """
        wanted = (
            list(range(self.buckets)) if buckets is None else [self._bucket(b) for b in buckets]
        )
        pipes = self._pipes()
        for bucket in wanted:
            pipes.pipe(self._tags[bucket]).get(self._wm[bucket])
        replies = self._run(pipes, "watermarks") if wanted else []
        marks: dict[int, int | None] = {}
        for bucket, value in zip(wanted, replies, strict=True):
            version, _, window = ("" if value is None else as_text(value)).partition("|")
            if value is not None and window != self._window:
                log.warning(
                    "bucket %d of group %r was indexed for a dedup window of %s ms, "
                    "this process uses %s ms: rebuilding it",
                    bucket,
                    self.group,
                    window or "?",
                    self._window,
                )
            marks[bucket] = int(version) if value is not None and window == self._window else None
        return marks

    # -- the ledger index --------------------------------------------------------------

    def bind_ledger(self, ledger: str) -> None:
        """Record ``ledger`` as the one ledger this group's index covers, or refuse another.

        The index is rebuilt from a ledger after Redis loses data (a flush, a restart
        from an older snapshot). Two ledgers under one group (a Delta sink's table and a
        function sink's or consumer's own ledger) each rebuild it from their own keys
        only, and a key done through the other ledger could then be applied again. The
        record lives beside bucket 0's watermark, so it goes with the index.
        """
        name = f"{self._tags[0]}:ledger"
        try:
            stored = self.client.get(name)
            if stored is None:
                if self.client.set(name, ledger, nx=True):
                    return
                stored = self.client.get(name)  # another writer recorded one meanwhile
        except redis.RedisError as exc:
            metrics.count("redis_errors", self.group, component="dedup")
            raise StoreUnavailable(
                f"Redis ledger check for group {self.group!r} failed: {exc}"
            ) from exc
        if stored is not None and as_text(stored) != ledger:
            raise ConfigError(
                f"ledger_path: group {self.group!r} is indexed for the ledger at "
                f"{as_text(stored)}, not {ledger}; a group has one ledger (a function sink "
                "or consumer beside a Delta sink needs a group of its own)"
            )

    def index_completed(
        self,
        bucket: int,
        keys: Sequence[str],
        fingerprints: Sequence[str],
        completed_at_ms: Sequence[int],
        *,
        to_version: int,
        from_version: int | None,
    ) -> bool:
        """Load keys of one bucket from the ledger as COMPLETED, then move its watermark.

        ``from_version=None`` is a rebuild of the whole dedup window; otherwise the
        keys are those of ledger versions ``from_version + 1 .. to_version``. Each
        key's window runs from its ``completed_at_ms`` (keys already past it are
        skipped); a COMPLETED key wins over any claim left on it, since the ledger is
        the truth. The watermark becomes ``max(wm, to_version)`` when
        ``wm >= from_version`` (catch-up) or, for a rebuild, always. Big loads are
        chunked; a chunk lost to a Redis restart in between keeps the watermark
        where it was. Returns whether the watermark now covers ``to_version``.
        """
        self._bucket(bucket)
        if not len(keys) == len(fingerprints) == len(completed_at_ms):
            raise ValueError(
                f"index_completed: {len(keys)} keys, {len(fingerprints)} fingerprints and "
                f"{len(completed_at_ms)} completed_at_ms values must be as many"
            )
        if "|" in "".join(fingerprints):
            raise ValueError("fingerprints: a fingerprint must not contain '|'")
        tag = self._tags[bucket]
        routing = [self._wm[bucket], f"{tag}:s:{uuid.uuid4().hex}"]
        when = self.instant()
        head = [
            tag,
            when.arg,
            self._window,
            _version("to_version", to_version),
            "" if from_version is None else _version("from_version", from_version),
        ]
        columns = (keys, fingerprints, completed_at_ms)
        pipes = self._pipes()
        queued = 0
        for args, start, _ in _calls(head, columns, INDEX_CHUNK):
            ats = completed_at_ms[start : start + INDEX_CHUNK]
            names = [self._completed_name(tag, g) for g in self._generations(ats, when.low)]
            self._index(keys=routing + names, args=args, client=pipes.pipe(tag))
            queued += 1
            if queued == INDEX_CHUNKS_PER_PIPELINE:  # bound what one round trip buffers
                replies = self._run(pipes, "index")
                pipes, queued = self._pipes(), 0
        if queued:
            replies = self._run(pipes, "index")
        return bool(replies[-1][1] == 1)

    def _generations(self, completed_at_ms: Sequence[int], now_ms: int) -> list[int]:
        """The completed generations keys completed at these times go to (while in the
        window at ``now_ms``, the earliest the script's instant can be)."""
        live = now_ms - self.completed_ttl_ms  # index.lua skips a key unless at > live
        if not completed_at_ms or max(completed_at_ms) <= live:
            return []
        low = max(min(completed_at_ms), live + 1) // self.completed_ttl_ms
        high = max(completed_at_ms) // self.completed_ttl_ms
        if high - low <= _SPAN_DECLARED:
            return list(range(low, high + 1))
        return sorted({at // self.completed_ttl_ms for at in completed_at_ms if at > live})

    def settle_index(self, buckets: Iterable[int] | None = None) -> int:
        """After a bulk load: make Redis finish growing the buckets' completed hashes now.

        A hash that outgrew its table moves its entries to a bigger one a little
        per later command, and until then every claim on it does double lookups
        (``settle.lua`` has the details). A window rebuild leaves its big hashes in
        that state; this finishes the move at load time, in calls of
        ``SETTLE_LOOKUPS`` read-only lookups, instead of on the first live batches.
        Returns the keys held by the settled hashes.
        """
        wanted = (
            list(range(self.buckets)) if buckets is None else [self._bucket(b) for b in buckets]
        )
        gen = self.now_ms() // self.completed_ttl_ms
        names = [
            (self._tags[bucket], self._completed_name(self._tags[bucket], g))
            for bucket in wanted
            for g in (gen, gen - 1)
        ]
        if not names:
            return 0
        pipes = self._pipes()
        for tag, name in names:
            self._settle(keys=[name], args=[SETTLE_LOOKUPS], client=pipes.pipe(tag))
        sizes = [int(size) for size in self._run(pipes, "settle")]
        pipes, queued = self._pipes(), 0
        for (tag, name), size in zip(names, sizes, strict=True):
            for _ in range(SETTLE_LOOKUPS, size, SETTLE_LOOKUPS):
                self._settle(keys=[name], args=[SETTLE_LOOKUPS], client=pipes.pipe(tag))
                queued += 1
                if queued == SETTLE_CALLS_PER_PIPELINE:  # a round trip well inside the timeout
                    self._run(pipes, "settle")
                    pipes, queued = self._pipes(), 0
        if queued:
            self._run(pipes, "settle")
        return sum(sizes)

    def held_keys(self, buckets: Iterable[int] | None = None) -> dict[int, int]:
        """Completed keys each bucket holds in Redis now (the generations a claim reads).

        Counts what costs memory: the previous generation may still hold keys
        whose window has ended (they go when its hash expires).
        """
        wanted = (
            list(range(self.buckets)) if buckets is None else [self._bucket(b) for b in buckets]
        )
        gens = self._read_generations(self.now_ms())
        pipes = self._pipes()
        for bucket in wanted:
            tag = self._tags[bucket]
            for g in gens:
                pipes.pipe(tag).hlen(self._completed_name(tag, g))
        replies = self._run(pipes, "held_keys") if wanted else []
        size = len(gens)
        return {
            bucket: sum(int(r) for r in replies[size * n : size * (n + 1)])
            for n, bucket in enumerate(wanted)
        }

    def drop_watermark(self, bucket: int) -> None:
        """Forget a bucket's watermark, forcing a rebuild before its next "new" answer."""
        try:
            self.client.delete(self._wm[self._bucket(bucket)])
        except redis.RedisError as exc:
            raise StoreUnavailable(f"Redis DEL of a watermark failed: {exc}") from exc


def _calls(
    head: list[str], columns: Sequence[Sequence[str | int]], size: int
) -> Iterator[tuple[list[str | int], int, bool]]:
    """The script calls that carry ``columns`` (keys first) of one bucket, one column
    after the other.

    One ``all`` call when they fit ``size``; else ``part`` calls counted in a
    session key and an ``end`` call that moves the watermark only if every part
    arrived. Yields (ARGV, offset of the call's first key, decides the watermark).
    """
    join = chain.from_iterable
    total = len(columns[0])
    if total <= size:
        yield [*head, "all", "0", *join(columns)], 0, True
        return
    starts = range(0, total, size)
    for start in starts:
        part = [column[start : start + size] for column in columns]
        yield (
            [*head, "part", str(SESSION_TTL_MS), *join(part)],
            start,
            False,
        )
    yield [*head, "end", str(len(starts))], total, True


def _parse_claim(value: str) -> KeyState:
    if value.startswith("P|"):
        owner, lease_until, attempt = value[2:].split("|")
        return KeyState(
            KeyStatus.IN_PROGRESS,
            owner=owner,
            lease_until_ms=int(lease_until),
            attempt=int(attempt),
        )
    raise StoreUnavailable(f"Redis holds an unrecognised idem value {value[:40]!r}")
