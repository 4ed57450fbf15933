"""A batch's claim between sending it and reading its verdicts (docs/pages/protocol.md, steps 1-3).

:meth:`idem.dedup.Dedup.start` validates the keys and sends their claims;
:meth:`PendingClaim.finish` reads the verdicts and classifies every row. In
between Redis runs the claims while the caller does work of its own (the Spark
decorator turns the payload hashes into fingerprints and message ids there).

A batch of more than :data:`CLAIM_WAVE_ROWS` rows is sent in waves: the claims
of one slice of rows go to Redis while the next slice is validated and
bucketed, so this process and Redis work at the same time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from idem.batchkeys import BatchKeys
from idem.config import DedupMode, MismatchPolicy
from idem.errors import IndexUnsettled
from idem.hotstore_types import ClaimInFlight, ClaimResult
from idem.keys import group_by_bucket
from idem.outcome import BatchClaim, DuplicateCause

if TYPE_CHECKING:
    from idem.dedup import Dedup

log = logging.getLogger("idem.dedup")

CLAIM_WAVE_ROWS = 10_000
"""Rows validated and sent per wave of a big claim."""

MAX_INDEX_ROUNDS = 5
"""How often a claim retries after the index fell behind again under its feet."""


class PendingClaim:
    """The claims of one batch, sent; :meth:`finish` reads the verdicts."""

    def __init__(
        self,
        dedup: Dedup,
        keys: Sequence[object],
        *,
        owner: str,
        order: Sequence[int],
        field: str,
        hold: bool = True,
    ) -> None:
        self.dedup = dedup
        self.owner = owner
        self.hold = hold
        config = dedup.config
        self.batch = BatchKeys(
            keys, field=field, max_bytes=config.max_key_bytes, buckets=config.buckets
        )
        self.version: int | None = None  # every claimed key's bucket had reached it
        self.claimed_at_ms = dedup.hot.now_ms()  # the clock leases and the window run on
        self._calls: ClaimInFlight | None = None
        try:
            if len(order) > CLAIM_WAVE_ROWS:
                self.version = dedup.catch_up()  # a batch this big touches every bucket
                self._calls = dedup.hot.start_claim(owner, min_version=self.version, hold=hold)
                for start in range(0, len(order), CLAIM_WAVE_ROWS):
                    self._calls.add(self.batch.take(order[start : start + CLAIM_WAVE_ROWS]))
            else:
                grouped = self.batch.take(order)
                if grouped:
                    self.version = dedup.catch_up(grouped.keys())
                    self._calls = dedup.hot.start_claim(owner, min_version=self.version, hold=hold)
                    self._calls.add(grouped)
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Give the claim up instead of finishing it: the calls sent are read (which gives
        the connection back) and their leases given back."""
        calls, self._calls = self._calls, None
        if calls is not None:
            calls.abandon()

    def finish(self, fingerprints: Sequence[str] | None = None) -> BatchClaim:
        """Read the verdicts and classify every row (``fingerprints``: the payload
        fingerprint of each row, to tell a duplicate with another payload)."""
        size = len(self.batch.keys)
        prints = tuple(fingerprints) if fingerprints is not None else ("",) * size
        if len(prints) != size:
            self.abandon()
            raise ValueError(f"fingerprints: {len(prints)} given for {size} keys")
        problem = _fingerprint_problem(prints)
        if problem is not None:
            self.abandon()  # the claims went out: read them back and give the leases up
            raise ValueError(problem)
        result = self._verdicts()
        batch, owner = self.batch, self.owner
        duplicates, first = batch.duplicates, batch.first
        claimed, retaken, reclaimed = result.claimed, result.retaken, result.reclaimed
        if self.dedup.config.mode is DedupMode.STRICT and claimed:
            found = self._strict_recheck(set(claimed), result)
            if found:
                claimed, retaken, reclaimed = (
                    [key for key in chosen if key not in found]
                    for chosen in (claimed, retaken, reclaimed)
                )
        # Every key of the batch has one verdict: claimed, busy or completed (the hot
        # store's contract); only those other than claimed are walked one by one.
        row = first.__getitem__
        fresh = sorted(map(row, claimed))
        mismatched: dict[int, str] = {}
        for key, stored in result.duplicates.items():
            i = row(key)
            duplicates[i] = DuplicateCause.COMPLETED
            if stored and prints[i] and stored != prints[i]:
                mismatched[i] = stored
        busy = sorted(map(row, result.busy))
        given = len(fresh) + len(busy) + len(result.duplicates)
        if given != len(first):
            raise RuntimeError(f"the hot store gave {given} verdicts for {len(first)} keys")
        claim = BatchClaim(
            owner=owner,
            keys=tuple(batch.normalised),
            fingerprints=prints,
            fresh=tuple(fresh),
            duplicates=duplicates,
            busy=tuple(busy),
            invalid=tuple(sorted(batch.invalid, key=lambda bad: bad.index)),
            mismatched=tuple(sorted(mismatched)),
            stored_fingerprints=mismatched,
            retaken=tuple(sorted(map(row, retaken))),
            ledger_version=-1 if self.version is None else self.version,
            reclaimed=tuple(sorted(map(row, reclaimed))),
            buckets=tuple(batch.buckets),
            held=self.hold,
            claimed_at_ms=self.claimed_at_ms,
        )
        if claim.mismatched and self.dedup.config.mismatch_policy is MismatchPolicy.WARN:
            log.warning(
                "%d key(s) arrived again with a different payload, e.g. %r",
                len(claim.mismatched),
                batch.normalised[claim.mismatched[0]],
            )
        return claim

    def _verdicts(self) -> ClaimResult:
        """The sent claims' verdicts; keys of buckets whose index fell behind meanwhile are
        claimed again once caught up: a stale index never answers "new"."""
        verdicts = ClaimResult(
            claimed=[], retaken=[], duplicates={}, busy=[], stale_buckets=frozenset()
        )
        calls, self._calls = self._calls, None
        if calls is None:
            return verdicts
        dedup, buckets = self.dedup, self.dedup.config.buckets
        pending: Mapping[int, Sequence[str]] = group_by_bucket(
            _merge_into(verdicts, calls.result()).stale, buckets
        )
        for _ in range(MAX_INDEX_ROUNDS - 1):
            if not pending:
                break
            reached = dedup.catch_up(pending.keys(), recheck=True)
            result = dedup.hot.claim(pending, self.owner, min_version=reached, hold=self.hold)
            # Only the keys a stale bucket did not examine are tried again; the others
            # already have their verdict (a re-claim would report them as re-taken).
            pending = group_by_bucket(_merge_into(verdicts, result).stale, buckets)
        if pending:
            # Nothing of this batch may stay held for a lease: its rows go back to the
            # sender as a store outage, and the keys must be claimable on the retry.
            dedup.hot.release(group_by_bucket(verdicts.claimed, buckets), self.owner)
            raise IndexUnsettled(
                f"buckets {sorted(pending)} kept losing their Redis index while claiming "
                f"({MAX_INDEX_ROUNDS} catch-ups); is Redis restarting or failing over in a "
                "loop? The batch's claims were released"
            )
        return verdicts

    def _strict_recheck(self, claimed: set[str], result: ClaimResult) -> set[str]:
        """Strict mode: keys the ledger already holds within the window are duplicates."""
        dedup = self.dedup
        since = dedup.hot.now_ms() - dedup.config.dedup_window_ms
        found = dedup.ledger.existing(sorted(claimed), since_ms=since)
        if found:
            dedup.hot.release(group_by_bucket(found, dedup.config.buckets), self.owner)
            result.duplicates.update(found)
        return set(found)


def _fingerprint_problem(prints: Sequence[object]) -> str | None:
    """Why a row's fingerprint cannot be stored, naming the row (``None``: all can).

    The hot store keeps ``<fingerprint>|<time>`` and sends it as UTF-8, the ledger
    keeps it as a string column: a fingerprint must be text, without ``'|'``, that
    encodes (no lone surrogate). Found only after the claims went out, or only at
    the commit, any of these left the keys held and the batch uncommittable.
    """
    try:
        joined = "".join(prints)  # type: ignore[arg-type]  # a TypeError names no row
        if "|" not in joined:
            if not joined.isascii():  # hex digests are: nothing to encode then
                joined.encode("utf-8")  # a lone surrogate raises
            return None  # the usual case, checked in one pass
    except (TypeError, UnicodeEncodeError):
        pass
    for row, value in enumerate(prints):
        if not isinstance(value, str):
            return f"fingerprints: row {row}'s fingerprint {value!r} is not text"
        if "|" in value:  # the hot store's values are '<fingerprint>|<time>'
            return f"fingerprints: row {row}'s fingerprint {value!r} contains '|'"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (
                f"fingerprints: row {row}'s fingerprint {value!r} is not valid Unicode text "
                f"({exc.reason} at character {exc.start})"
            )
    return None


def _merge_into(verdicts: ClaimResult, result: ClaimResult) -> ClaimResult:
    """Add the verdicts of ``result`` (not its stale keys) to ``verdicts``; return ``result``."""
    verdicts.claimed.extend(result.claimed)
    verdicts.retaken.extend(result.retaken)
    verdicts.reclaimed.extend(result.reclaimed)
    verdicts.duplicates.update(result.duplicates)
    verdicts.busy.extend(result.busy)
    return result
