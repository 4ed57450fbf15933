"""One completion of many keys, streamed to Redis a slice at a time (``complete.lua``).

:meth:`idem.hotstore.RedisHotStore.complete` and
:meth:`~idem.hotstore.RedisHotStore.complete_buckets` hand a :class:`CompleteCalls`
each bucket's keys as a :class:`~idem.hotstore_types.BucketKeys`, read one call's
worth at a time. A bucket that fits one call is one ``all`` call; a bigger one is
``part`` calls counted in a session key, then an ``end`` call that moves the
watermark only if every part arrived. The replies are read whenever
:data:`FLUSH_KEYS` keys are in flight, so the keys this process holds as text are
those of the calls in flight, never a whole batch's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

from idem.claim_calls import as_text
from idem.hotstore_types import BucketKeys, CompleteResult

if TYPE_CHECKING:
    from idem.hotstore import RedisHotStore

FLUSH_KEYS = 16_000
"""Keys sent to Redis before the replies are read (and the keys' text let go)."""


def listed_keys(bucket: int, keys: Sequence[str], fingerprints: Mapping[str, str]) -> BucketKeys:
    """The ``keys`` of ``bucket`` with their ``fingerprints``, checked before anything is sent."""
    try:
        prints = [fingerprints[key] for key in keys]
    except KeyError as exc:
        raise ValueError(f"fingerprints: no fingerprint for key {exc.args[0]!r}") from None
    if "|" in "".join(prints):
        raise ValueError("fingerprints: a fingerprint must not contain '|'")

    def read(start: int, stop: int) -> tuple[Sequence[str], Sequence[str]]:
        return keys[start:stop], prints[start:stop]

    return BucketKeys(bucket, len(keys), read)


@dataclass
class _Tally:
    """What the replies read so far said."""

    completed: int = 0
    fenced: list[str] = field(default_factory=list)
    lagging: set[int] = field(default_factory=set)

    def add(self, bucket: int, keys: Sequence[str], decides: bool, reply: Any) -> None:
        codes = as_text(reply[0])
        fenced_here = codes.count("F")
        self.completed += len(codes) - fenced_here
        if fenced_here:
            self.fenced += [keys[i] for i, code in enumerate(codes) if code == "F"]
        if decides and reply[1] != 1:
            self.lagging.add(bucket)

    def result(self) -> CompleteResult:
        return CompleteResult(
            self.completed, self.fenced, not self.lagging, frozenset(self.lagging)
        )


class CompleteCalls:
    """The ``complete.lua`` calls of one completion by ``owner``, at one instant.

    Args:
        store: The store whose buckets are completed.
        owner: Whose claims the keys are.
        version: The ledger version that holds the keys.
        completed_at_ms: When the keys were completed (``None``: the call's instant).
        chunk: Keys per call.
    """

    def __init__(
        self,
        store: RedisHotStore,
        owner: str,
        *,
        version: int,
        completed_at_ms: int | None,
        chunk: int,
    ) -> None:
        self._store = store
        self._when = store.instant()
        self._at = self._when.ms if completed_at_ms is None else completed_at_ms
        self._head = store.complete_arguments(owner, self._when.arg, self._at, version)
        self._token = uuid.uuid4().hex
        self._chunk = chunk
        self._calls = store.complete_calls()
        self._sent: list[tuple[int, Sequence[str], bool]] = []  # bucket, keys, decides
        self._in_flight = 0
        self._tally = _Tally()

    def run(self, parts: Iterable[BucketKeys]) -> CompleteResult:
        """Complete every key of ``parts``' buckets and move those buckets' watermarks."""
        try:
            for part in parts:
                self._bucket(part)
            self._flush()
        except BaseException:
            self._calls.abandon()  # read what was sent: the connection goes back to the pool
            raise
        return self._tally.result()

    def _bucket(self, part: BucketKeys) -> None:
        tag, routing = self._store.complete_route(
            part.bucket, self._token, self._when, self._at, keys=part.count > 0
        )
        head = [tag, *self._head]
        if part.count <= self._chunk:
            keys, prints = part.read(0, part.count)
            args = [*head, "all", "0", *self._pairs(keys, prints)]
            self._add(part.bucket, tag, routing, args, keys, decides=True)
            return
        starts = range(0, part.count, self._chunk)
        ttl = str(self._store.session_ttl_ms)
        for start in starts:
            keys, prints = part.read(start, min(start + self._chunk, part.count))
            args = [*head, "part", ttl, *self._pairs(keys, prints)]
            self._add(part.bucket, tag, routing, args, keys, decides=False)
        self._add(part.bucket, tag, routing, [*head, "end", str(len(starts))], (), decides=True)

    def _pairs(self, keys: Sequence[str], prints: Sequence[str]) -> Iterable[str]:
        """Each key followed by its value, ``<fingerprint>|<completed_at_ms>``."""
        tail = f"|{self._at}"
        return chain.from_iterable(zip(keys, [p + tail for p in prints], strict=True))

    def _add(
        self,
        bucket: int,
        tag: str,
        routing: list[str],
        args: list[str],
        keys: Sequence[str],
        *,
        decides: bool,
    ) -> None:
        """Send one call of ``keys``; read the replies in flight first when there are enough."""
        if self._in_flight >= FLUSH_KEYS:
            self._flush()
        self._calls.add(tag, routing, args)
        self._sent.append((bucket, keys, decides))
        self._in_flight += len(keys)

    def _flush(self) -> None:
        """Read the replies of the calls in flight and tally them."""
        calls, self._calls = self._calls, self._store.complete_calls()
        sent, self._sent = self._sent, []
        self._in_flight = 0
        replies = self._store.checked(calls.replies(), "complete")
        for (bucket, keys, decides), reply in zip(sent, replies, strict=True):
            self._tally.add(bucket, keys, decides, reply)
