"""Keeping Redis a complete index of the Delta ledger (DESIGN §1 step 3).

Before a claim may answer "new", every bucket it touches must have indexed
every ledger version (its watermark). A bucket that is behind loads only the
keys of the versions it missed, after giving a live writer a moment to index
its own commit; a bucket whose watermark is gone (FLUSHALL, empty restart) is
rebuilt from the ledger's dedup window.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from idem.clock import Clock
from idem.config import IdemConfig
from idem.hotstore import HotStore
from idem.ledger import Ledger

log = logging.getLogger(__name__)

CATCH_UP_GRACE_MS = 250
"""How long a claim waits for a live writer to index its own commit before loading it.

A watermark behind the ledger usually means another writer has committed and is
marking the keys COMPLETED right now (its claims still guard them meanwhile);
re-reading that version's files would duplicate its work. Only a writer that
died or stalled costs the load, after this wait.
"""


@dataclass
class IndexStats:
    """What keeping Redis a complete index of the ledger has cost so far."""

    rebuilt_buckets: int = 0
    rebuilt_keys: int = 0
    caught_up_versions: int = 0
    caught_up_keys: int = 0
    writer_waits: int = 0
    writer_waits_ms: int = 0


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
    ) -> None:
        self._config = config
        self._hot = hot
        self._ledger = ledger
        self._clock = clock
        self.catch_up_grace_ms = grace_ms
        self.stats = IndexStats()

    def catch_up(self, buckets: Iterable[int] | None = None) -> int:
        """Bring the Redis index of ``buckets`` (default all) up to the ledger; return its version.

        Steady state costs one cheap ledger version check and one Redis round trip.
        Buckets behind the ledger first get ``catch_up_grace_ms`` for the writer of
        the missing versions to index them itself.
        """
        wanted = list(range(self._config.buckets)) if buckets is None else list(buckets)
        version = self._ledger.version()
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
        return version

    def _wait_for_writers(
        self, marks: dict[int, int | None], version: int
    ) -> dict[int, int | None]:
        """Re-read lagging watermarks for up to the grace period; return the latest marks."""
        started = self._clock.now_ms()
        deadline = started + self.catch_up_grace_ms
        pause = 0.005
        lagging = [b for b, mark in marks.items() if mark is not None and mark < version]
        while lagging and self._clock.now_ms() < deadline:
            self._clock.sleep(pause)
            pause = min(pause * 2, 0.05)
            marks.update(self._hot.watermarks(lagging))
            lagging = [b for b in lagging if (mark := marks[b]) is not None and mark < version]
        self.stats.writer_waits += 1
        self.stats.writer_waits_ms += self._clock.now_ms() - started
        return marks

    def _rebuild(self, buckets: Sequence[int]) -> None:
        since = self._clock.now_ms() - self._config.dedup_window_ms
        snapshot = self._ledger.window(since, buckets)
        log.info(
            "rebuilding the Redis index of %d bucket(s) from ledger version %d (%d keys)",
            len(buckets),
            snapshot.version,
            snapshot.keys.num_rows,
        )
        self.stats.rebuilt_buckets += len(buckets)
        self.stats.rebuilt_keys += snapshot.keys.num_rows
        by_bucket = _split_by_bucket(snapshot.keys, buckets)
        for bucket in buckets:
            keys, prints, ats = by_bucket.get(bucket, ([], [], []))
            self._hot.index_completed(
                bucket, keys, prints, ats, to_version=snapshot.version, from_version=None
            )
        self._hot.settle_index(buckets)

    def _load_missed(self, behind: Mapping[int, int]) -> None:
        changes = self._ledger.keys_added_since(min(behind.values()))
        if changes is None:
            # The versions we missed were cleaned from the log: rebuild from the window.
            log.warning("ledger log no longer holds the missed versions; rebuilding the window")
            since = self._clock.now_ms() - self._config.dedup_window_ms
            snapshot = self._ledger.window(since, list(behind))
            table, to_version = snapshot.keys, snapshot.version
        else:
            table, to_version = changes.keys, changes.version
            self.stats.caught_up_versions += to_version - min(behind.values())
            self.stats.caught_up_keys += table.num_rows
        by_bucket = _split_by_bucket(table, behind)
        for bucket, mark in behind.items():
            keys, prints, ats = by_bucket.get(bucket, ([], [], []))
            self._hot.index_completed(
                bucket, keys, prints, ats, to_version=to_version, from_version=mark
            )
        if changes is None:
            self._hot.settle_index(list(behind))


def _split_by_bucket(
    table: pa.Table, buckets: Iterable[int]
) -> dict[int, tuple[list[str], list[str], list[int]]]:
    """Columns ``bucket, key, fingerprint, completed_at_ms`` split per wanted bucket."""
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
