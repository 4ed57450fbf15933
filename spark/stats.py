"""Counters of a group's Spark batches, kept in Redis so every run and restart adds up.

Each micro-batch records what happened to its rows once, even when Spark
replays it after a crash (``lua/record_batch.lua``); what only a replay can
show — claims re-taken by the same owner, i.e. rows a non-transactional sink
may have seen twice — is counted on every attempt. ``idem run`` and ``idem
demo`` print their reports from these totals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any, Protocol

import redis

from idem import metrics
from idem.config import IdemConfig
from idem.errors import StoreUnavailable
from idem.redis_cluster import RedisClient

_LUA = resources.files("idem.spark").joinpath("lua")
_RECORD = _LUA.joinpath("record_batch.lua").read_text("utf-8")
_BEGIN = _LUA.joinpath("begin_batch.lua").read_text("utf-8")
_DUPLICATE = "duplicates."
_LEVEL = "retried.level."


class RecordedBatch(Protocol):
    """What :meth:`StatsStore.record` needs of a batch (``BatchOutcome`` is one)."""

    @property
    def query_id(self) -> str:
        """The streaming query's id."""
        ...

    @property
    def batch_id(self) -> int:
        """Spark's micro-batch id."""
        ...

    @property
    def timings(self) -> Mapping[str, float]:
        """Seconds spent per step (``claim`` and ``commit`` go into the latency metrics)."""
        ...

    def once_counters(self) -> dict[str, int]:
        """Counters that belong to the batch (added once however often it is replayed)."""
        ...


def once_counters(
    *,
    counts: Mapping[str, int],
    duplicates: Mapping[str, int],
    retried_by_level: Mapping[int, int],
) -> dict[str, int]:
    """The counter fields of a batch, named as in the totals hash (zeros left out)."""
    out = {"batches": 1, **counts}
    out.update({f"{_DUPLICATE}{cause}": n for cause, n in duplicates.items()})
    out.update({f"{_LEVEL}{level}": n for level, n in retried_by_level.items()})
    return {name: n for name, n in out.items() if n}


@dataclass(frozen=True, slots=True)
class Totals:
    """A group's counters over every batch recorded so far."""

    batches: int = 0
    messages: int = 0
    retried_rows: int = 0
    applied: int = 0
    failed: int = 0
    busy: int = 0
    invalid: int = 0
    malformed: int = 0
    """Rows whose values could not be read (a retry body that no longer fits the schema, a
    source line that is not valid JSON for it); dead-lettered at once."""
    mismatched: int = 0
    dead: int = 0
    possible_repeats: int = 0
    replayed_batches: int = 0
    duplicates: Mapping[str, int] = field(default_factory=dict)
    retried_by_level: Mapping[int, int] = field(default_factory=dict)
    dlq_replayed: int = 0
    """Dead letters sent back by ``idem dlq replay``."""

    @property
    def duplicates_total(self) -> int:
        """All rows suppressed as duplicates."""
        return sum(self.duplicates.values())

    @property
    def retried_total(self) -> int:
        """All rows sent back for a later delay level."""
        return sum(self.retried_by_level.values())

    @classmethod
    def from_hash(cls, raw: Mapping[str, int]) -> Totals:
        """Parse the Redis hash of counters."""
        dups = {k[len(_DUPLICATE) :]: v for k, v in raw.items() if k.startswith(_DUPLICATE)}
        levels = {int(k[len(_LEVEL) :]): v for k, v in raw.items() if k.startswith(_LEVEL)}
        plain = {
            name: raw.get(name, 0)
            for name in (
                "batches",
                "messages",
                "retried_rows",
                "applied",
                "failed",
                "busy",
                "invalid",
                "malformed",
                "mismatched",
                "dead",
                "possible_repeats",
                "replayed_batches",
                "dlq_replayed",
            )
        }
        return cls(duplicates=dups, retried_by_level=dict(sorted(levels.items())), **plain)


class StatsStore:
    """Reads and writes one group's counters (hash-tagged by group, cluster safe)."""

    def __init__(self, client: RedisClient, group: str, *, marker_ttl_ms: int) -> None:
        self.client = client
        self.group = group
        self.marker_ttl_ms = marker_ttl_ms
        self.totals_key = f"idem:{{{group}}}:spark:totals"
        self._record = client.register_script(_RECORD)
        self._begin = client.register_script(_BEGIN)

    def marker_key(self, query_id: str, batch_id: int) -> str:
        """The once-per-batch marker of ``(query_id, batch_id)``."""
        return f"idem:{{{self.group}}}:spark:batch:{query_id}:{batch_id}"

    def attempts_key(self, query_id: str, batch_id: int) -> str:
        """The attempt counter of ``(query_id, batch_id)``."""
        return f"idem:{{{self.group}}}:spark:attempts:{query_id}:{batch_id}"

    def begin(self, query_id: str, batch_id: int) -> int:
        """Count an attempt at the batch; returns its number (> 1: Spark replayed the batch)."""
        try:
            n = self._begin(
                keys=[self.attempts_key(query_id, batch_id), self.totals_key],
                args=[self.marker_ttl_ms],
            )
        except redis.RedisError as exc:
            raise StoreUnavailable(f"counting the batch attempt failed: {exc}") from exc
        return int(n)

    def record(self, batch: RecordedBatch) -> bool:
        """Add a batch's counters; returns False when the batch had been recorded (a replay).

        The batch is also counted into the process's metrics (:mod:`idem.metrics`): its
        rows on the first record, only a replay on a later one.

        Nothing is counted on every attempt: what a replay can repeat is counted
        (``possible_repeats``) when its claims are re-taken, before the sink runs.
        """
        once = batch.once_counters()
        argv: list[str | int] = [self.marker_ttl_ms, len(once)]
        for name, n in once.items():
            argv += [name, n]
        try:
            first = self._record(
                keys=[self.marker_key(batch.query_id, batch.batch_id), self.totals_key],
                args=argv,
            )
        except redis.RedisError as exc:
            metrics.count("redis_errors", self.group, component="spark")
            raise StoreUnavailable(f"recording batch counters failed: {exc}") from exc
        metrics.count_batch(self.group, once, timings=batch.timings, replay=not first)
        return bool(first)

    def add(self, name: str, n: int = 1) -> None:
        """Add to one counter outside a batch (e.g. ``dlq_replayed``)."""
        try:
            self.client.hincrby(self.totals_key, name, n)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"updating counter {name!r} failed: {exc}") from exc

    def totals(self) -> Totals:
        """The group's counters so far."""
        try:
            raw = self.client.hgetall(self.totals_key)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"reading batch counters failed: {exc}") from exc
        return Totals.from_hash({_text(k): int(v) for k, v in raw.items()})

    def reset(self) -> None:
        """Forget the totals (markers expire on their own)."""
        self.client.delete(self.totals_key)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def stats_section(config: IdemConfig, client: RedisClient) -> dict[str, Any]:
    """``idem stats``'s ``spark`` part: the group's batch totals (see :class:`Totals`)."""
    totals = StatsStore(client, config.group, marker_ttl_ms=config.dedup_window_ms).totals()
    return {
        "spark": {
            **asdict(totals),
            "duplicates_total": totals.duplicates_total,
            "retried_total": totals.retried_total,
        }
    }
