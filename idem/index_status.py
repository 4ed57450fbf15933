"""Where a group's Redis index stands against its Delta ledger, bucket by bucket.

``idem index status`` prints this and ``idem console`` shows it: per bucket, the
ledger version Redis has indexed and how many completed keys it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.hotstore import RedisHotStore


@dataclass(frozen=True, slots=True)
class BucketIndex:
    """One bucket's index."""

    bucket: int
    indexed_version: int | None
    """The ledger version Redis has indexed (``None``: never indexed, or lost)."""
    keys: int
    """Completed keys Redis holds for the bucket."""
    state: str
    """``current``, ``behind``, ``missing``, or ``ahead`` (Redis indexes another ledger)."""


@dataclass(frozen=True, slots=True)
class IndexStatus:
    """A group's index at one moment."""

    group: str
    ledger_path: str
    ledger_version: int
    """``-1``: no ledger table yet."""
    buckets: tuple[BucketIndex, ...]

    @property
    def to_catch_up(self) -> int:
        """Buckets missing or behind the ledger."""
        return sum(b.state in ("missing", "behind") for b in self.buckets)

    @property
    def ahead(self) -> int:
        """Buckets that indexed versions past this ledger's (another table was indexed)."""
        return sum(b.state == "ahead" for b in self.buckets)

    @property
    def held(self) -> int:
        """Completed keys held in Redis, all buckets."""
        return sum(b.keys for b in self.buckets)

    @property
    def missing(self) -> int:
        """Buckets with no indexed version (never used yet, or Redis lost them): each is
        rebuilt from the ledger by the first claim that touches it."""
        return sum(b.indexed_version is None for b in self.buckets)

    @property
    def lag(self) -> int | None:
        """Ledger versions the furthest-behind indexed bucket has not indexed yet
        (``None``: no bucket is indexed)."""
        marks = [b.indexed_version for b in self.buckets if b.indexed_version is not None]
        if not marks:
            return None
        return max(max(self.ledger_version - m, 0) for m in marks)


def bucket_state(mark: int | None, version: int) -> str:
    """A bucket's index against the ledger: ``ahead`` means another ledger was indexed."""
    if mark is None:
        return "missing"
    if mark < version:
        return "behind"
    return "ahead" if mark > version else "current"


def open_index(config: IdemConfig) -> tuple[Dedup, RedisHotStore]:
    """The group's dedup layer and its Redis index (``config`` must carry the bucket count
    its ledger was created with)."""
    hot = RedisHotStore.from_config(config)
    return Dedup(config, hot=hot), hot


def index_status(dd: Dedup, hot: RedisHotStore) -> IndexStatus:
    """Read each bucket's indexed version and held keys, and the ledger's version."""
    version = dd.ledger.version()
    marks = hot.watermarks()
    held = hot.held_keys()
    return IndexStatus(
        group=hot.group,
        ledger_path=dd.ledger.path,
        ledger_version=version,
        buckets=tuple(
            BucketIndex(b, marks[b], held[b], bucket_state(marks[b], version))
            for b in range(hot.buckets)
        ),
    )
