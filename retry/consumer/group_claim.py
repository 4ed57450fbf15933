"""Group claim of the dedup middleware: concurrent consume calls share one ``Dedup.begin``.

Every claim first checks that the Redis index covers the ledger and, when a
ledger commit has landed but not yet reached Redis (the moment between the two
halves of someone's commit), loads that version's files. Twenty consume threads
claiming at once would each load the same files; claiming in turn would queue
them behind each other. So the calls of one instance claim together, like a
group commit: a call that finds no claim running claims for everything queued
(one ``begin``, one Lua call per bucket), a call that finds one running waits
for the next round. Each call gets its own :class:`~idem.outcome.BatchClaim`.

The calls of one instance never share a valid key (the middleware reserves each
key for one call at a time), so claiming them together cannot turn one call's
key into an in-batch duplicate of another's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from idem.dedup import Dedup
from idem.outcome import BatchClaim, Invalid


@dataclass
class _Request:
    keys: Sequence[object]
    fingerprints: Sequence[str]
    order: Sequence[int]
    claim: BatchClaim | None = None
    error: BaseException | None = None
    done: bool = False


def slice_claim(claim: BatchClaim, start: int, size: int) -> BatchClaim:
    """The verdicts of rows ``start .. start + size`` of ``claim``, indexed from 0."""
    end = start + size

    def rows(indices: Sequence[int]) -> tuple[int, ...]:
        return tuple(i - start for i in indices if start <= i < end)

    return BatchClaim(
        owner=claim.owner,
        keys=claim.keys[start:end],
        fingerprints=claim.fingerprints[start:end],
        fresh=rows(claim.fresh),
        duplicates={i - start: c for i, c in claim.duplicates.items() if start <= i < end},
        busy=rows(claim.busy),
        invalid=tuple(
            Invalid(bad.index - start, bad.field, bad.reason, bad.message)
            for bad in claim.invalid
            if start <= bad.index < end
        ),
        mismatched=rows(claim.mismatched),
        retaken=rows(claim.retaken),
        ledger_version=claim.ledger_version,
        reclaimed=rows(claim.reclaimed),
        stored_fingerprints={
            i - start: f for i, f in claim.stored_fingerprints.items() if start <= i < end
        },
        buckets=claim.buckets[start:end],
        held=claim.held,
        claimed_at_ms=claim.claimed_at_ms,
    )


class GroupClaimer:
    """Claims the keys of one owner's concurrent consume calls in shared ``begin`` calls."""

    def __init__(self, dedup: Dedup, owner: str, *, field: str = "key") -> None:
        self.dedup = dedup
        self.owner = owner
        self.field = field
        self.rounds = 0
        """``begin`` calls made so far."""
        self._cond = threading.Condition()
        self._queue: list[_Request] = []
        self._leading = False

    def claim(
        self, keys: Sequence[object], *, fingerprints: Sequence[str], order: Sequence[int]
    ) -> BatchClaim:
        """``Dedup.begin`` for one call's rows (shared with the calls claiming meanwhile)."""
        request = _Request(keys, fingerprints, order)
        with self._cond:
            self._queue.append(request)
            while not request.done and self._leading:
                self._cond.wait()
            batch: list[_Request] = []
            if not request.done:
                self._leading = True
                batch, self._queue = self._queue, []
        if batch:
            try:
                self._claim(batch)
            finally:
                with self._cond:
                    self._leading = False
                    self._cond.notify_all()
        if request.error is not None:
            raise request.error
        assert request.claim is not None
        return request.claim

    def _claim(self, batch: list[_Request]) -> None:
        keys: list[object] = []
        prints: list[str] = []
        order: list[int] = []
        for request in batch:
            base = len(keys)
            keys += request.keys
            prints += request.fingerprints
            order += [base + i for i in request.order]
        try:
            claim = self.dedup.begin(
                keys, owner=self.owner, fingerprints=prints, order=order, field=self.field
            )
        except Exception as exc:
            for request in batch:
                request.error, request.done = exc, True
            return
        finally:
            self.rounds += 1
        base = 0
        for request in batch:
            request.claim = slice_claim(claim, base, len(request.keys))
            request.done = True
            base += len(request.keys)
