"""Typed results of the dedup protocol: what happened to every row of a batch."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

import pyarrow as pa


class DuplicateCause(StrEnum):
    """Why a row was not handed to the sink."""

    IN_BATCH = "in_batch"
    """The same key stood earlier in the same batch (first occurrence wins)."""
    COMPLETED = "completed"
    """The key was already completed (Redis index or, in strict mode, the ledger)."""
    SLIPPED = "slipped"
    """The ledger commit found the key already present (claimed twice around a failover)."""


@dataclass(frozen=True, slots=True)
class Invalid:
    """A row whose key is bad input; it goes to the DLQ with ``reason``."""

    index: int
    field: str
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class BatchCounts:
    """How many rows of a batch ended in each verdict."""

    total: int
    fresh: int
    duplicates: int
    busy: int
    invalid: int
    mismatched: int
    retaken: int
    reclaimed: int = 0
    duplicates_by_cause: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BatchClaim:
    """The verdict on each row of a batch, by input index.

    ``keys[i]`` is the normalised key of row ``i`` (``None`` when invalid).
    ``fresh`` rows are claimed by ``owner`` and must be completed or released.
    ``retaken`` is the subset of ``fresh`` this owner had claimed before (a
    replayed batch); ``reclaimed`` the subset taken over from another owner
    whose lease had expired (that owner may have run the sink for it already).
    Both are possible repeats for a sink that is not the ledger.
    ``mismatched`` are duplicates whose payload fingerprint differs from the
    completed one; ``stored_fingerprints`` holds the completed one for each.
    ``ledger_version``: every claimed key's bucket index had reached this
    ledger version, so only later versions can hold a key claimed as fresh
    (the commit checks just those; ``-1`` checks them all).
    ``buckets[i]`` is the bucket of row ``i``'s key where the claim computed it
    (every first occurrence of a valid key; ``-1`` elsewhere; empty: not kept).
    """

    owner: str
    keys: tuple[str | None, ...]
    fingerprints: tuple[str, ...]
    fresh: tuple[int, ...]
    duplicates: dict[int, DuplicateCause]
    busy: tuple[int, ...]
    invalid: tuple[Invalid, ...]
    mismatched: tuple[int, ...] = ()
    retaken: tuple[int, ...] = ()
    ledger_version: int = -1
    reclaimed: tuple[int, ...] = ()
    stored_fingerprints: dict[int, str] = field(default_factory=dict)
    buckets: tuple[int, ...] = ()
    held: bool = True
    """Whether the claim took leases on its fresh keys (``False``: a lookup for a sink
    whose write is the ledger commit; see :meth:`idem.dedup.Dedup.begin`)."""
    claimed_at_ms: int | None = None
    """When the claim was made (the claimer's clock; ``None``: unknown, the commit's
    time is used). A commit that must MERGE matches the rows completed from a horizon
    before this moment, however long the batch took since."""

    @property
    def counts(self) -> BatchCounts:
        """Per-verdict counts, duplicates also by cause."""
        by_cause = Counter(cause.value for cause in self.duplicates.values())
        return BatchCounts(
            total=len(self.keys),
            fresh=len(self.fresh),
            duplicates=len(self.duplicates),
            busy=len(self.busy),
            invalid=len(self.invalid),
            mismatched=len(self.mismatched),
            retaken=len(self.retaken),
            reclaimed=len(self.reclaimed),
            duplicates_by_cause=dict(by_cause),
        )

    def conflicting(self) -> tuple[int, ...]:
        """The ``in_batch`` duplicates whose payload fingerprint differs from the one of
        their key's row that the batch kept: another payload under the same key, a
        mismatch like one with a completed key (``mismatch_policy`` decides), never a
        silent duplicate. Rows without a fingerprint are never conflicting."""
        copies = [i for i, cause in self.duplicates.items() if cause is DuplicateCause.IN_BATCH]
        if not copies:
            return ()
        keys, prints = self.keys, self.fingerprints
        kept = {
            keys[i]: prints[i]
            for i in range(len(keys))
            if keys[i] is not None and self.duplicates.get(i) is not DuplicateCause.IN_BATCH
        }
        return tuple(
            sorted(i for i in copies if prints[i] and kept.get(keys[i], "") not in ("", prints[i]))
        )

    def fresh_keys(self) -> list[str]:
        """The keys of the fresh rows, in input order."""
        return [k for k in (self.keys[i] for i in self.fresh) if k is not None]


@dataclass(frozen=True)
class ClaimedRows:
    """Rows claimed as fresh by ``owner`` elsewhere (e.g. on Spark's executors), every
    one succeeded, as Arrow columns: what :meth:`idem.dedup.Dedup.complete_rows` records.

    ``columns`` holds each row's ``key`` (one row per key), ``bucket`` and
    ``fingerprint``, and may hold the ledger's ``msg_id``, ``origin_msg_id``,
    ``topic``, ``queue_id``, ``queue_offset`` and ``result`` (absent: null).
    ``ledger_version``, ``held`` and ``claimed_at_ms`` are as in :class:`BatchClaim`.
    """

    owner: str
    columns: pa.Table
    ledger_version: int = -1
    held: bool = True
    claimed_at_ms: int | None = None

    @property
    def num_rows(self) -> int:
        """How many rows were claimed."""
        return int(self.columns.num_rows)


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    """What a commit did: ledger version, inserted rows, slipped duplicates, fenced keys."""

    version: int | None
    committed: int
    slipped: tuple[str, ...] = ()
    fenced: tuple[str, ...] = ()
    replayed: bool = False
