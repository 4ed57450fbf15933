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
from idem.index_status import IndexStatus, index_status
from idem.metrics import GroupState
from idem.redis_cluster import RedisClient
from idem.retry.engine import RetryEngine
from idem.retry.message import TIMER_QUEUE
from idem.retry.store import ScheduleStats


@dataclass(frozen=True, slots=True)
class GroupSnapshot:
    """One group's state: what is scheduled and retrying, dead, done and indexed."""

    group: str
    retry: ScheduleStats
    journal_version: int | None
    dlq: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """Dead letters by (original topic, status)."""
    index: IndexStatus | None = None
    """``None`` when not read."""

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
        index = self.index
        if index is not None:
            state["ledger_version"] = [({}, float(index.ledger_version))]
            state["index_lag_versions"] = [({}, float(index.lag or 0))]
            state["index_buckets_behind"] = [({}, float(buckets_behind(index)))]
            state["index_buckets_missing"] = [({}, float(buckets_missing(index)))]
        return state


def buckets_behind(index: IndexStatus) -> int:
    """Indexed buckets behind the ledger (the next claim in one loads what it missed)."""
    return sum(b.state == "behind" for b in index.buckets)


def buckets_missing(index: IndexStatus) -> int:
    """Buckets with no index of a ledger that has versions (rebuilt on first use)."""
    return index.missing if index.ledger_version >= 0 else 0


def _level(queue_id: str) -> int:
    """A schedule queue's delay level (queue id = level - 1; the timer queue is level 0)."""
    return 0 if queue_id == TIMER_QUEUE else int(queue_id) + 1


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
        state = index_status(Dedup(config, hot=store), store)
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
            "lag_versions": index.lag or 0,
            "buckets": len(index.buckets),
            "buckets_behind": buckets_behind(index),
            "buckets_missing": buckets_missing(index),
            "held_keys": index.held,
        }
    return out


def _dlq(counts: Mapping[tuple[str, str], int]) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    by_topic: dict[str, dict[str, int]] = {}
    for (topic, status), n in sorted(counts.items()):
        by_status[status] = by_status.get(status, 0) + n
        by_topic.setdefault(topic, {})[status] = n
    return {"by_status": by_status, "by_topic": by_topic}
