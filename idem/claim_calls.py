"""One claim of many keys at one instant, streamed to Redis as it is built (docs/pages/protocol.md).

:meth:`idem.hotstore.RedisHotStore.start_claim` makes a :class:`ClaimCalls`; the
caller adds the keys of a batch slice by slice (each bucket chunk is one
``claim.lua`` call, written to the connection at once on a single server, see
:mod:`idem.redis_stream`) and reads every verdict with :meth:`ClaimCalls.result`.
On a Redis Cluster the calls go in one routed round trip at ``result``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from itertools import compress
from typing import TYPE_CHECKING, Any

import redis
from redis.cluster import RedisCluster

from idem.errors import StoreUnavailable
from idem.hotstore_types import ClaimResult
from idem.redis_stream import ScriptCalls

if TYPE_CHECKING:
    from idem.hotstore import RedisHotStore

log = logging.getLogger("idem.hotstore")

CLAIM_CHUNK = 1_000  # keys per claim/release/lookup call (1k-2k measured best)

_NOT_NEW = re.compile("[^N]")
_CLAIMED = bytes.maketrans(b"NRXDB", b"\x01\x01\x01\x00\x00")
"""claim.lua's codes as truth values: claimed (N, R, X) or not (D, B)."""


def as_text(value: bytes | str) -> str:
    """A Redis reply as text (clients may or may not decode responses)."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


class ClaimCalls:
    """One claim of many keys: :meth:`add` them, then read :meth:`result`.

    Each call decides at Redis's clock when it runs (with the system clock), or at
    the injected test clock's instant read when the claim was made.

    On a single server each call (one EVALSHA per bucket chunk) is written to
    the connection when added, so Redis runs it while the caller prepares the
    next part (:class:`~idem.redis_stream.StreamedCalls`); on a Cluster the calls
    go in one routed round trip at :meth:`result`.
    """

    def __init__(
        self,
        store: RedisHotStore,
        owner: str,
        *,
        min_version: int,
        hold: bool = True,
        renew: bool = False,
        track: bool = False,
    ) -> None:
        """``hold=False``: the verdicts only; ``renew``: only ``owner``'s own claims get a
        new lease (verdict R, reported as re-taken), nothing else is written; ``track``
        (with ``hold``): the claimed keys are also recorded for ``owner``, so that
        :meth:`~idem.hotstore.RedisHotStore.renew_tracked` can renew them without
        being told which they are."""
        self._store = store
        self._when = store.instant()
        track = track and hold and not renew
        mode = "renew" if renew else ("track" if track else "hold") if hold else "look"
        self._track = track
        self._head_tail = store.claim_arguments(
            self._when.arg, owner, min_version=min_version, mode=mode
        )
        self._owner = owner
        self._hold = hold and not renew  # what abandon() gives back
        self._plan: list[tuple[int, list[str]]] = []  # bucket, keys
        client = store.client
        self._streamed = not isinstance(client, RedisCluster)
        self._calls = ScriptCalls(
            client, store.claim_script, store.run_claims, stream=self._streamed
        )

    def add(self, keys_by_bucket: Mapping[int, Sequence[str]]) -> None:
        """Claim these keys too (each key at most once per claim)."""
        store, when = self._store, self._when
        for bucket, given in keys_by_bucket.items():
            keys = given if isinstance(given, list) else list(given)
            tag, routing = store.claim_route(bucket, when.ms, when.slack_ms)
            if self._track:  # claim.lua records the keys in the owner's hash
                routing = [*routing, store.owned_name(bucket, self._owner)]
            head = [tag, *self._head_tail]
            for start in range(0, len(keys), CLAIM_CHUNK):
                chunk = keys[start : start + CLAIM_CHUNK]
                self._calls.add(tag, routing, head + chunk)
                self._plan.append((bucket, chunk))

    def result(self) -> ClaimResult:
        """Every added key's verdict (reads the replies; raises :class:`StoreUnavailable`)."""
        replies = self._replies()
        claimed: list[str] = []
        retaken: list[str] = []
        reclaimed: list[str] = []
        duplicates: dict[str, str] = {}
        busy: list[str] = []
        stale: list[str] = []
        stale_buckets: set[int] = set()
        for (bucket, chunk), reply in zip(self._plan, replies, strict=True):
            if reply[0] == 0:
                stale_buckets.add(bucket)
                stale.extend(chunk)
                continue
            codes = as_text(reply[1])
            if len(codes) != len(chunk):
                raise StoreUnavailable(
                    f"Redis claim for group {self._store.group!r} answered {len(codes)} "
                    f"verdicts for {len(chunk)} keys"
                )
            if codes.count("N") == len(chunk):
                claimed.extend(chunk)
                continue
            # N, R and X are claimed; only the (few) other codes are walked one by one.
            claimed.extend(compress(chunk, codes.encode("ascii").translate(_CLAIMED)))
            fingerprints = iter(reply[2:])
            for found in _NOT_NEW.finditer(codes):
                key, code = chunk[found.start()], found.group()
                if code == "D":
                    duplicates[key] = as_text(next(fingerprints))
                elif code == "B":
                    busy.append(key)
                elif code == "R":
                    retaken.append(key)
                else:  # "X"
                    reclaimed.append(key)
        return ClaimResult(
            claimed, retaken, duplicates, busy, frozenset(stale_buckets), stale, reclaimed
        )

    def codes(self) -> tuple[bytes, list[str]]:
        """Every added key's verdict as ``claim.lua``'s code letter, in the order the keys
        were added (``S`` for the keys of a stale bucket), and the stored fingerprints of
        the ``D`` keys in that order: the whole claim without a Python step per key."""
        replies = self._replies()
        parts: list[bytes] = []
        fingerprints: list[str] = []
        for (_, chunk), reply in zip(self._plan, replies, strict=True):
            if reply[0] == 0:
                parts.append(b"S" * len(chunk))
                continue
            codes = reply[1] if isinstance(reply[1], bytes) else reply[1].encode("ascii")
            if len(codes) != len(chunk):
                raise StoreUnavailable(
                    f"Redis claim for group {self._store.group!r} answered {len(codes)} "
                    f"verdicts for {len(chunk)} keys"
                )
            parts.append(codes)
            fingerprints.extend(as_text(value) for value in reply[2:])
        return b"".join(parts), fingerprints

    def abandon(self) -> None:
        """Give the claim up: read what was sent (never sending it again) and give back the
        leases this owner holds on the added keys. Best effort: a lease left behind expires."""
        self._calls.abandon()
        if not (self._hold and self._streamed and self._plan):
            return  # a Cluster claim sends nothing before result(); a lookup holds nothing
        grouped: dict[int, list[str]] = {}
        for bucket, chunk in self._plan:
            grouped.setdefault(bucket, []).extend(chunk)
        try:
            self._store.release(grouped, self._owner)
        except (StoreUnavailable, redis.RedisError):
            log.warning("giving back the leases of an abandoned claim failed; they will expire")

    def _replies(self) -> list[Any]:
        """The replies in call order; what could not stream goes through a routed pipeline."""
        return self._store.checked(self._calls.replies(), "claim")
