"""Counters of one push consumer (what it consumed, sent back, dropped, expired)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields

from idem import metrics

_METRICS = {"pulled": "messages"}
"""The counters that are also idem's metrics (``idem_<name>_total``), and their names there
(``failed`` is counted where the listener's own rejections are told from busy keys)."""


@dataclass
class ConsumerStats:
    """Running totals of one consumer instance; read with :meth:`snapshot`."""

    pulled: int = 0
    consumed_ok: int = 0
    consume_failed: int = 0
    sent_back: int = 0
    dead_lettered: int = 0
    resubmitted: int = 0
    expired: int = 0
    """Messages sent back by the consume timeout."""
    dropped_results: int = 0
    """Messages consumed by a queue that was taken away meanwhile: results not committed."""
    broadcast_dropped: int = 0
    """Broadcasting: failed messages logged and dropped (RocketMQ does not retry them)."""
    flow_control: int = 0
    """Pulls skipped because a queue held too many, too large or too spread messages."""
    suspended: int = 0
    """Orderly: times a queue was suspended after a failure."""

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._group: str | None = None
        self._metrics = dict(_METRICS)

    def count_as(self, group: str, *, applied: bool) -> None:
        """Also add to the process's metrics of ``group`` from now on (see :mod:`idem.metrics`).

        ``applied``: messages consumed successfully count as applied (a consumer without
        a dedup layer; with one, the layer counts what it completed).
        """
        self._metrics = {**_METRICS, **({"consumed_ok": "applied"} if applied else {})}
        self._group = group

    def add(self, **counts: int) -> None:
        """Add to some counters at once."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)
        group = self._group
        if group is not None:
            for name, value in counts.items():
                metric = self._metrics.get(name)
                if metric is not None and value > 0:
                    metrics.count(metric, group, value)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of every counter."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}
