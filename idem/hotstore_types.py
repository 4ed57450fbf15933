"""The results and the interface of a hot store (the Redis side of the dedup layer).

A store is a small set of primitives — claim, complete, release, lookup, the
ledger index — so another backend can be added beside :class:`~idem.hotstore.RedisHotStore`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class KeyStatus(StrEnum):
    """The state of a key in the hot store."""

    ABSENT = "ABSENT"
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"


@dataclass(frozen=True, slots=True)
class KeyState:
    """What Redis holds for one key (fields not meaningful for the status are ``None``)."""

    status: KeyStatus
    owner: str | None = None
    lease_until_ms: int | None = None
    attempt: int | None = None
    fingerprint: str | None = None
    completed_at_ms: int | None = None

    def lease_expired(self, now_ms: int) -> bool:
        """Whether an IN_PROGRESS claim's lease has run out at ``now_ms``."""
        return self.lease_until_ms is not None and self.lease_until_ms <= now_ms


ABSENT = KeyState(KeyStatus.ABSENT)


@dataclass(frozen=True)
class ClaimResult:
    """How a claim went; every key given appears in exactly one of
    ``claimed``, ``duplicates``, ``busy`` or ``stale``.
    """

    claimed: list[str]
    """Keys this owner now holds (new, re-taken or taken over from an expired lease)."""
    retaken: list[str]
    """Subset of ``claimed`` this owner already held (a replay of the same batch)."""
    duplicates: dict[str, str]
    """COMPLETED keys and the payload fingerprint stored with them."""
    busy: list[str]
    """Keys another owner holds with a live lease."""
    stale_buckets: frozenset[int]
    """Buckets to catch up (or rebuild) before claiming ``stale`` again."""
    stale: list[str] = field(default_factory=list)
    """Keys not examined: their bucket's index is behind ``min_version`` or unknown."""
    reclaimed: list[str] = field(default_factory=list)
    """Subset of ``claimed`` taken over from an expired lease (attempt + 1)."""


@dataclass(frozen=True)
class CompleteResult:
    """How a completion went."""

    completed: int
    """Keys that are COMPLETED now (written by this call, or already completed)."""
    fenced: list[str]
    """Keys left alone because another owner holds a live lease on them."""
    watermark_advanced: bool
    """Whether every bucket's watermark now covers the ledger version."""
    lagging_buckets: frozenset[int] = frozenset()
    """Buckets whose watermark did not reach the version (missing, behind, or fenced)."""


@dataclass(frozen=True)
class BucketKeys:
    """Every key of one bucket that a completion marks, read a slice at a time.

    ``read(start, stop)`` gives the keys ``start`` to ``stop`` of the ``count`` and their
    fingerprints (text without ``|``): only the slice in flight is ever held as text.
    """

    bucket: int
    count: int
    read: Callable[[int, int], tuple[Sequence[str], Sequence[str]]]


class ClaimInFlight(Protocol):
    """A claim whose keys are added in parts (see :meth:`HotStore.start_claim`)."""

    def add(self, keys_by_bucket: Mapping[int, Sequence[str]]) -> None:
        """Claim these keys too (each key at most once per claim)."""
        ...

    def result(self) -> ClaimResult:
        """Every added key's verdict."""
        ...

    def abandon(self) -> None:
        """Give the claim up instead of reading its verdicts (its leases are given back)."""
        ...


class HotStore(Protocol):
    """The primitives the dedup layer needs from a hot store."""

    group: str
    buckets: int

    def check_eviction_policy(self) -> None:
        """Refuse a store that may drop keys silently."""
        ...

    def now_ms(self) -> int:
        """The time leases and the dedup window run on (epoch ms): the store's own clock
        in production, an injected test clock's otherwise."""
        ...

    def bind_ledger(self, ledger: str) -> None:
        """Record ``ledger`` as the group's one ledger, or refuse another one."""
        ...

    def claim(
        self,
        keys_by_bucket: Mapping[int, Sequence[str]],
        owner: str,
        *,
        min_version: int,
        hold: bool = True,
    ) -> ClaimResult:
        """Claim keys for ``owner`` where the index has reached ``min_version`` (``hold=False``:
        the verdicts only, no leases taken)."""
        ...

    def renew(self, keys_by_bucket: Mapping[int, Sequence[str]], owner: str) -> list[str]:
        """New leases for the claims ``owner`` still holds on these keys; the keys renewed."""
        ...

    def start_claim(
        self, owner: str, *, min_version: int, hold: bool = True, track: bool = False
    ) -> ClaimInFlight:
        """:meth:`claim` in parts: Redis may run the first while the caller prepares the next.
        ``track`` (with ``hold``): the store also records the claimed keys for ``owner``."""
        ...

    def renew_tracked(self, owner: str) -> int:
        """New leases for the claims ``owner`` still holds among the keys it claimed with
        ``track``, without naming them; how many were renewed."""
        ...

    def untrack(self, owner: str) -> None:
        """Forget the keys ``owner`` claimed with ``track``."""
        ...

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
        """Mark keys COMPLETED after ledger ``version`` and advance the watermarks (of
        ``buckets`` only, when given: the caller decides those buckets' whole version)."""
        ...

    def complete_buckets(
        self,
        parts: Iterable[BucketKeys],
        owner: str,
        *,
        version: int,
        completed_at_ms: int | None = None,
    ) -> CompleteResult:
        """:meth:`complete` of the buckets ``parts`` name (each with every key of its
        bucket), reading their keys a slice at a time."""
        ...

    def release(self, keys_by_bucket: Mapping[int, Sequence[str]], owner: str) -> int:
        """Give back ``owner``'s claims; return how many were released."""
        ...

    def lookup(self, keys_by_bucket: Mapping[int, Sequence[str]]) -> dict[str, KeyState]:
        """The stored state of each key."""
        ...

    def watermarks(self, buckets: Iterable[int] | None = None) -> dict[int, int | None]:
        """Each bucket's indexed ledger version (``None``: unknown, rebuild needed)."""
        ...

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
        """Load ledger keys as COMPLETED and move the watermark; return whether it moved."""
        ...

    def settle_index(self, buckets: Iterable[int] | None = None) -> int:
        """After a bulk load, finish the store's growth work now, not on live claims."""
        ...
