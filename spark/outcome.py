"""What happened to the rows of one micro-batch: the result of ``@exactly_once``'s steps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from idem.spark.stats import once_counters


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What happened to the rows of one micro-batch."""

    batch_id: int
    query_id: str
    owner: str
    messages: int = 0
    """Rows in the batch (main stream and retries)."""
    retried_rows: int = 0
    """Rows that came back from the retry stream (``reconsume_times`` > 0)."""
    applied: int = 0
    """Rows the sink accepted and that were committed."""
    applied_keys: tuple[str, ...] = ()
    """The applied rows' keys: all of them up to 100, else 100 of them."""
    failed_keys: tuple[str, ...] = ()
    busy: int = 0
    invalid: int = 0
    """Rows whose key is bad (null, empty, too long, not text); dead-lettered at once."""
    malformed: int = 0
    """Rows whose values could not be read (``_idem_malformed``); dead-lettered at once."""
    mismatched: int = 0
    duplicates: Mapping[str, int] = field(default_factory=dict)
    """Rows not handed to the sink, by cause (``in_batch``, ``completed``, ``slipped``)."""
    retried_by_level: Mapping[int, int] = field(default_factory=dict)
    """Rows sent back, by the delay level they were scheduled on."""
    dead: int = 0
    """Rows routed to ``%DLQ%<group>`` by this batch."""
    retaken: int = 0
    """Claims this batch's owner held already: a replay; the sink may see these rows again
    (counted in ``possible_repeats`` when claimed)."""
    commit_version: int | None = None
    commit_replayed: bool = False
    timings: Mapping[str, float] = field(default_factory=dict)
    """Seconds spent per step (``arrow``, ``claim``, ``sink``, ``commit``, ``send_back``)."""

    @property
    def failed(self) -> int:
        """Rows the sink rejected."""
        return len(self.failed_keys)

    def once_counters(self) -> dict[str, int]:
        """The batch's counters for the group's totals (see :class:`StatsStore`)."""
        return once_counters(
            counts={
                "messages": self.messages,
                "retried_rows": self.retried_rows,
                "applied": self.applied,
                "failed": self.failed,
                "busy": self.busy,
                "invalid": self.invalid,
                "malformed": self.malformed,
                "mismatched": self.mismatched,
                "dead": self.dead,
            },
            duplicates=self.duplicates,
            retried_by_level=self.retried_by_level,
        )
