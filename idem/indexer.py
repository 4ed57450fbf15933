"""Keeping Redis a complete index of the Delta ledger (docs/pages/protocol.md, "Step 3").

Before a claim may answer "new", every bucket it touches must have indexed
every ledger version (its watermark). A bucket that is behind loads only the
keys of the versions it missed, after giving a live writer a moment to index
its own commit; a bucket whose watermark is gone (FLUSHALL, empty restart) is
rebuilt from the ledger's dedup window.

In the steady state (the ledger has not moved since the buckets were last
found caught up) a catch-up reads nothing from Redis: the claim script checks
the watermark itself and answers "stale" when it is behind, and the claim then
catches up for real (``recheck``). A writer of this process that is indexing
its own commit right now is waited for directly (:class:`OwnCommits`), not
polled for.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa
import pyarrow.compute as pc

from idem.clock import Clock
from idem.config import IdemConfig
from idem.hotstore import HotStore
from idem.ledger import INDEX_SCHEMA, Ledger

log = logging.getLogger(__name__)

CATCH_UP_GRACE_MS = 250
"""How long a claim waits for a live writer to index its own commit before loading it.

A watermark behind the ledger usually means another writer has committed and is
marking the keys COMPLETED right now (its claims still guard them meanwhile);
re-reading that version's files would duplicate its work. Only a writer that
died or stalled costs the load, after this wait.
"""


WINDOW_SHARES = 16
"""A rebuild in this process reads the ledger's window in this many shares of the buckets."""


@dataclass
class IndexStats:
    """What keeping Redis a complete index of the ledger has cost so far."""

    rebuilt_buckets: int = 0
    rebuilt_keys: int = 0
    caught_up_versions: int = 0
    caught_up_keys: int = 0
    writer_waits: int = 0
    writer_waits_ms: int = 0


@dataclass(frozen=True)
class RebuiltWindow:
    """What a :class:`WindowLoad` put into Redis."""

    version: int
    """The ledger version whose window was loaded."""
    keys: int
    """Keys read from the ledger's window."""
    buckets: frozenset[int]
    """Buckets that held keys in the window (each loaded whole, with its watermark)."""


class WindowLoad(Protocol):
    """Loads the ledger's dedup window into Redis somewhere other than this process.

    The Spark glue's implementation runs it on the executors, bucket by bucket, so
    a window of millions of keys never reaches the driver. Called by a claim's
    catch-up for buckets whose watermark is gone or whose missed versions left
    the ledger's log; it must load every key of a bucket in one
    :meth:`~idem.hotstore.HotStore.index_completed` call (so its watermark moves
    only once the whole bucket is in), and must not touch a bucket it reports
    no keys for: the caller moves those buckets' watermarks itself.
    """

    def __call__(self, marks: Mapping[int, int | None], since_ms: int) -> RebuiltWindow:
        """Load the keys completed since ``since_ms`` of the buckets in ``marks``; a
        bucket's value is the ``from_version`` of its load (``None``: a rebuild)."""
        ...


class OwnCommits:
    """Ledger versions this process committed whose keys are being indexed in Redis now.

    A claim that finds a bucket behind one of them waits for that indexing to end
    instead of polling the watermark.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._versions: Counter[int] = Counter()

    @contextmanager
    def indexing(self, version: int) -> Iterator[None]:
        """Around the Redis update that indexes this process's commit ``version``."""
        with self._cond:
            self._versions[version] += 1
        try:
            yield
        finally:
            with self._cond:
                self._versions[version] -= 1
                if self._versions[version] <= 0:
                    del self._versions[version]
                self._cond.notify_all()

    def wait(self, up_to: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no version ``<= up_to`` is being indexed; return
        whether one was (so the watermarks are worth reading again)."""
        with self._cond:
            if not any(v <= up_to for v in self._versions):
                return False
            self._cond.wait_for(lambda: not any(v <= up_to for v in self._versions), timeout_s)
            return True


class Indexer:
    """Brings the Redis index of a group's buckets up to its ledger; counts the cost."""

    def __init__(
        self,
        config: IdemConfig,
        hot: HotStore,
        ledger: Ledger,
        clock: Clock,
        *,
        grace_ms: int = CATCH_UP_GRACE_MS,
        own: OwnCommits | None = None,
        load_window: WindowLoad | None = None,
    ) -> None:
        self._config = config
        self._load_window = load_window
        self._hot = hot
        self._ledger = ledger
        self._clock = clock
        self._own = own
        self.catch_up_grace_ms = grace_ms
        self.stats = IndexStats()
        self._seen: tuple[int, frozenset[int]] = (-2, frozenset())
        """A ledger version and the buckets last found to have indexed it."""

    def catch_up(self, buckets: Iterable[int] | None = None, *, recheck: bool = False) -> int:
        """Bring the Redis index of ``buckets`` (default all) up to the ledger; return its version.

        Steady state costs one cheap ledger version check: buckets found caught
        up with this very version before are not read again, since the claim
        script checks their watermark itself. ``recheck`` reads them anyway (a
        claim found one stale). Buckets behind the ledger first get
        ``catch_up_grace_ms`` for the writer of the missing versions to index
        them itself.
        """
        wanted = list(range(self._config.buckets)) if buckets is None else list(buckets)
        version = self._ledger.version()
        seen_version, seen = self._seen
        if not recheck and version == seen_version and seen.issuperset(wanted):
            return version
        # Whenever the watermarks are read (not in the steady state above): a second
        # ledger under this group is refused as soon as both write.
        self._hot.bind_ledger(self._ledger.path)
        marks = self._hot.watermarks(wanted)
        if self.catch_up_grace_ms > 0 and any(
            mark is not None and mark < version for mark in marks.values()
        ):
            marks = self._wait_for_writers(marks, version)
        missing = [b for b in wanted if marks.get(b) is None]
        behind = {b: mark for b in wanted if (mark := marks.get(b)) is not None and mark < version}
        if missing:
            self._rebuild(missing)
        if behind:
            self._load_missed(behind)
        seen_version, seen = self._seen
        known = seen if seen_version == version else frozenset()
        self._seen = (version, known.union(wanted))
        return version

    def _wait_for_writers(
        self, marks: dict[int, int | None], version: int
    ) -> dict[int, int | None]:
        """Re-read lagging watermarks for up to the grace period; return the latest marks."""
        started = self._clock.now_ms()
        deadline = started + self.catch_up_grace_ms
        pause = 0.002
        lagging = [b for b, mark in marks.items() if mark is not None and mark < version]
        if self._own is not None and self._own.wait(version, self.catch_up_grace_ms / 1000):
            marks.update(self._hot.watermarks(lagging))  # this process's own commit landed
            lagging = [b for b in lagging if (mark := marks[b]) is not None and mark < version]
        while lagging and self._clock.now_ms() < deadline:
            self._clock.sleep(pause)
            pause = min(pause * 2, 0.02)
            marks.update(self._hot.watermarks(lagging))
            lagging = [b for b in lagging if (mark := marks[b]) is not None and mark < version]
        self.stats.writer_waits += 1
        self.stats.writer_waits_ms += self._clock.now_ms() - started
        return marks

    def _rebuild(self, buckets: Sequence[int]) -> None:
        version, keys = self._window(dict.fromkeys(buckets))
        log.info(
            "rebuilt the Redis index of %d bucket(s) from ledger version %d (%d keys)",
            len(buckets),
            version,
            keys,
        )
        self.stats.rebuilt_buckets += len(buckets)
        self.stats.rebuilt_keys += keys
        self._hot.settle_index(buckets)

    def _window(self, marks: Mapping[int, int | None]) -> tuple[int, int]:
        """Load the dedup window of the buckets in ``marks`` (each one's ``from_version``)
        into Redis; the version loaded and the keys read."""
        since = self._hot.now_ms() - self._config.dedup_window_ms
        if self._load_window is not None:
            loaded = self._load_window(marks, since)
            version, keys = loaded.version, loaded.keys
            for bucket in marks.keys() - loaded.buckets:  # buckets with no key in the window
                self._index(INDEX_SCHEMA.empty_table(), {bucket: marks[bucket]}, version)
            return version, keys
        # A share of the buckets at a time (each read prunes to their partitions): this
        # process holds about 1/WINDOW_SHARES of the window's keys at once.
        wanted = sorted(marks)
        step = max(1, -(-len(wanted) // WINDOW_SHARES))
        version, keys = -1, 0
        for start in range(0, len(wanted), step):
            share = {bucket: marks[bucket] for bucket in wanted[start : start + step]}
            snapshot = self._ledger.window(since, list(share))
            self._index(snapshot.keys, share, snapshot.version)
            version, keys = max(version, snapshot.version), keys + snapshot.keys.num_rows
        return version, keys

    def _index(self, table: pa.Table, marks: Mapping[int, int | None], version: int) -> None:
        """Index ``table`` (as :data:`~idem.ledger.INDEX_SCHEMA`) into the buckets of
        ``marks``, each load from its ``from_version`` up to ``version``."""
        by_bucket = index_rows_by_bucket(table, marks)
        for bucket, mark in marks.items():
            keys, prints, ats = by_bucket.get(bucket, ([], [], []))
            self._hot.index_completed(
                bucket, keys, prints, ats, to_version=version, from_version=mark
            )

    def _load_missed(self, behind: Mapping[int, int]) -> None:
        changes = self._ledger.keys_added_since(min(behind.values()))
        if changes is None:
            # The versions we missed were cleaned from the log: load them from the window.
            log.warning("ledger log no longer holds the missed versions; loading the window")
            self._window(behind)
            self._hot.settle_index(list(behind))
            return
        self.stats.caught_up_versions += changes.version - min(behind.values())
        self.stats.caught_up_keys += changes.keys.num_rows
        self._index(changes.keys, behind, changes.version)


def index_rows_by_bucket(
    table: pa.Table, buckets: Iterable[int]
) -> dict[int, tuple[list[str], list[str], list[int]]]:
    """Rows of :data:`~idem.ledger.INDEX_SCHEMA` (``bucket, key, fingerprint,
    completed_at_ms``) as keys, fingerprints and times per wanted bucket that has any."""
    out: dict[int, tuple[list[str], list[str], list[int]]] = {}
    if table.num_rows == 0:
        return out
    # One vectorised filter per bucket: no Python loop per row.
    for bucket in set(buckets):
        part = table.filter(pc.equal(table.column("bucket"), bucket))
        if part.num_rows:
            out[bucket] = (
                part.column("key").to_pylist(),
                pc.fill_null(part.column("fingerprint"), "").to_pylist(),
                part.column("completed_at_ms").to_pylist(),
            )
    return out
