"""A consumer group's state at one moment: resend path, dead letters, ledger and its index.

What ``idem stats`` prints and what ``idem schedule`` exposes as gauges. Reading it
costs a few Redis round trips, a listing of the ledger's log and one aggregate over
the DLQ table's ``topic`` and ``status`` columns: once per scrape interval, not per
message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from idem.cli_args import with_ledger_buckets
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.hotstore import RedisHotStore
from idem.metrics import GroupState
from idem.redis_cluster import RedisClient
from idem.retry.engine import RetryEngine
from idem.retry.message import TIMER_QUEUE
from idem.retry.store import ScheduleStats


@dataclass(frozen=True, slots=True)
class IndexState:
    """The Redis index of the ledger: each bucket's indexed version against the ledger's."""

    ledger_version: int
    """The ledger's latest version (``-1``: no ledger yet)."""
    watermarks: Mapping[int, int | None]
    """Per bucket, the ledger version Redis has indexed (``None``: none, a rebuild is due)."""
    held_keys: int
    """Completed keys the index holds in Redis."""

    @property
    def lag_versions(self) -> int:
        """Versions the most lagging indexed bucket is behind the ledger (the next claim in
        it loads just those versions' keys)."""
        lags = [self.ledger_version - m for m in self.watermarks.values() if m is not None]
        return max([0, *lags])

    @property
    def buckets_behind(self) -> int:
        """Indexed buckets behind the ledger."""
        return sum(1 for m in self.watermarks.values() if m is not None and m < self.ledger_version)

    @property
    def buckets_missing(self) -> int:
        """Buckets with no watermark while the ledger has versions: the next claim in one
        rebuilds it from the ledger's dedup window (after FLUSHALL or an empty restart, or
        a bucket no key of the group has reached yet)."""
        if self.ledger_version < 0:
            return 0
        return sum(1 for m in self.watermarks.values() if m is None)


@dataclass(frozen=True, slots=True)
class GroupSnapshot:
    """One group's state: what is scheduled and retrying, dead, done and indexed."""

    group: str
    retry: ScheduleStats
    journal_version: int | None
    dlq: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """Dead letters by (original topic, status)."""
    index: IndexState | None = None
    """``None`` when not read (no ledger configured for the group)."""

    def scheduled_by_level(self) -> dict[int, int]:
        """Messages waiting per delay level (0: the custom-delay timer queue)."""
        return {_level(q): n for q, n in self.retry.scheduled_by_queue.items()}

    def gauges(self) -> GroupState:
        """The snapshot as the gauges of :data:`idem.metrics.GAUGES`."""
        state: dict[str, list[tuple[Mapping[str, str], float]]] = {
            "dlq_messages": [
                ({"topic": topic, "status": status}, float(n))
                for (topic, status), n in sorted(self.dlq.items())
            ],
            "retry_scheduled_messages": [
                ({"level": str(level)}, float(n))
                for level, n in sorted(self.scheduled_by_level().items())
            ],
            "retry_topic_messages": [
                ({"state": "undelivered"}, float(self.retry.undelivered)),
                ({"state": "delivered_unacked"}, float(self.retry.delivered_unacked)),
            ],
        }
        if self.index is not None:
            state["ledger_version"] = [({}, float(self.index.ledger_version))]
            state["index_lag_versions"] = [({}, float(self.index.lag_versions))]
            state["index_buckets_behind"] = [({}, float(self.index.buckets_behind))]
            state["index_buckets_missing"] = [({}, float(self.index.buckets_missing))]
        return state


def _level(queue_id: str) -> int:
    """A schedule queue's delay level (queue id = level - 1; the timer queue is level 0)."""
    return 0 if queue_id == TIMER_QUEUE else int(queue_id) + 1


def read_index(config: IdemConfig, hot: RedisHotStore) -> IndexState:
    """The group's ledger version and each bucket's watermark in Redis."""
    version = Dedup(config, hot=hot).ledger.version()
    return IndexState(
        ledger_version=version,
        watermarks=hot.watermarks(),
        held_keys=sum(hot.held_keys().values()),
    )


def read_group(
    engine: RetryEngine, *, hot: RedisHotStore | None = None, index: bool = True
) -> GroupSnapshot:
    """``engine``'s group now: Redis side, journal version, DLQ counts and (``index``) the
    ledger's index, with ``hot`` (default: a store on the engine's Redis client)."""
    stats = engine.stats()
    state = None
    if index:
        # the bucket count the ledger was made with, unless IDEM_BUCKETS says otherwise
        config = with_ledger_buckets(engine.config)
        store = hot or RedisHotStore.from_config(config, client=engine.client)
        state = read_index(config, store)
    return GroupSnapshot(
        group=engine.group,
        retry=stats.redis,
        journal_version=stats.journal_version,
        dlq=engine.dlq.counts(),
        index=state,
    )


def stats_section(config: IdemConfig, client: RedisClient) -> dict[str, Any]:
    """``idem stats``'s ``retry``, ``dlq`` and ``index`` parts for ``config.group``."""
    engine = RetryEngine(config, client=client)
    snap = read_group(engine)
    retry = snap.retry
    out: dict[str, Any] = {
        "retry": {
            "scheduled_by_level": {str(k): v for k, v in sorted(snap.scheduled_by_level().items())},
            "scheduled": sum(retry.scheduled_by_queue.values()),
            "retry_topic_undelivered": retry.undelivered,
            "retry_topic_delivered_unacked": retry.delivered_unacked,
            "live": retry.live,
            "next_due_ms": retry.next_due_ms,
            "journal_version": snap.journal_version,
        },
        "dlq": _dlq(snap.dlq),
    }
    if snap.index is not None:
        index = snap.index
        out["index"] = {
            "ledger_version": index.ledger_version,
            "lag_versions": index.lag_versions,
            "buckets": len(index.watermarks),
            "buckets_behind": index.buckets_behind,
            "buckets_missing": index.buckets_missing,
            "held_keys": index.held_keys,
        }
    return out


def _dlq(counts: Mapping[tuple[str, str], int]) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    by_topic: dict[str, dict[str, int]] = {}
    for (topic, status), n in sorted(counts.items()):
        by_status[status] = by_status.get(status, 0) + n
        by_topic.setdefault(topic, {})[status] = n
    return {"by_status": by_status, "by_topic": by_topic}
