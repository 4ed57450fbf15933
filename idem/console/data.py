"""What the console shows, read through the functions the ``idem`` commands use.

Each page asks a :class:`GroupView` for a plain snapshot (dataclasses, no HTML);
replay and discard go through :func:`idem.spark.dlq.replay` and
:func:`idem.spark.dlq.discard`, so they record who and when exactly as ``idem dlq``
does. Nothing here writes anything else.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from idem.cli_args import with_ledger_buckets
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.errors import IdemError
from idem.hotstore import RedisHotStore
from idem.index_status import IndexStatus, index_status, open_index
from idem.retry.dlq import DeadLetter, DeadLetterStatus
from idem.retry.engine import RetryEngine
from idem.retry.message import TIMER_QUEUE, MessageExt
from idem.retry.store import LiveEntry, LiveState

if TYPE_CHECKING:  # the Spark layer needs PySpark: imported where the console runs
    from idem.spark.dlq import DiscardResult, ReplayResult

SEARCH_SCAN_LIMIT = 10_000
"""Live retry messages a search by key reads at most (their bodies are fetched one by one)."""


@dataclass(frozen=True, slots=True)
class LevelRow:
    """The messages waiting at one retry level."""

    level: str
    """``"1"``, ``"2"``... or ``"timer"`` (messages scheduled by time, not by level)."""
    waiting: int
    next_due_ms: int | None


@dataclass(frozen=True, slots=True)
class RetryView:
    """The group's resend path: what waits at each level, and what the retry topic holds."""

    levels: tuple[LevelRow, ...]
    retry_topic_length: int
    undelivered: int
    delivered_unacked: int
    live: int
    next_due_ms: int | None
    journal_version: int | None


@dataclass(frozen=True, slots=True)
class Sample:
    """The group's duplicate counters at one moment."""

    at_ms: int
    duplicates: Mapping[str, int]


@dataclass(frozen=True, slots=True)
class Whereabouts:
    """Where one key or message id is now."""

    term: str
    done: bool | None
    """The ledger holds the key (``None``: no ledger to ask, or the term is not a key)."""
    retrying: tuple[str, ...]
    """One line per live retry message that matches (``scheduled at level 2, due ...``)."""
    dead: tuple[DeadLetter, ...]


@dataclass
class DuplicateHistory:
    """Samples of the duplicate counters, taken while the console runs (in memory only)."""

    capacity: int = 240
    samples: deque[Sample] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, sample: Sample) -> None:
        """Keep ``sample``, forgetting the oldest beyond ``capacity``."""
        with self.lock:
            self.samples.append(sample)
            while len(self.samples) > self.capacity:
                self.samples.popleft()

    def snapshot(self) -> list[Sample]:
        """The samples kept, oldest first."""
        with self.lock:
            return list(self.samples)


class GroupView:
    """One consumer group, as the console reads and acts on it."""

    def __init__(self, config: IdemConfig, *, engine: RetryEngine | None = None) -> None:
        self.config = config
        from idem.spark.stats import StatsStore  # noqa: PLC0415 -- needs PySpark

        self.engine = engine if engine is not None else RetryEngine(config)
        self.stats = StatsStore(
            self.engine.client, config.group, marker_ttl_ms=config.dedup_window_ms
        )
        self.history = DuplicateHistory()
        self._index: tuple[Dedup, RedisHotStore] | None = None
        self._index_lock = threading.Lock()

    @property
    def group(self) -> str:
        """The consumer group."""
        return self.config.group

    # -- dead letters ----------------------------------------------------------------------

    def dlq_exists(self) -> bool:
        """Whether the group has a ``%DLQ%`` table yet."""
        return self.engine.dlq.exists()

    def dead_letters(self, *, status: DeadLetterStatus | None, limit: int) -> list[DeadLetter]:
        """Dead letters, newest first (none when the table does not exist yet)."""
        if not self.engine.dlq.exists():
            return []
        return self.engine.dlq.list(status=status, limit=limit)

    def dead_letter(self, msg_id: str) -> DeadLetter | None:
        """The dead letter whose ``msg_id`` (or ``origin_msg_id``) is ``msg_id``."""
        if not self.engine.dlq.exists():
            return None
        rows = self.engine.dlq.show(msg_id)
        exact = [d for d in rows if d.msg_id == msg_id]
        return (exact or rows)[0] if rows else None

    def replay(self, msg_id: str, *, by: str) -> ReplayResult:
        """Send one dead letter back through the retry path (and so the dedup layer)."""
        from idem.spark.dlq import Selection, replay  # noqa: PLC0415 -- needs PySpark

        return replay(self.engine, Selection(msg_ids=(msg_id,)), by=by)

    def discard(self, msg_id: str, *, by: str) -> DiscardResult:
        """Mark one dead letter ``DISCARDED``, recording ``by`` and when."""
        from idem.spark.dlq import Selection, discard  # noqa: PLC0415 -- needs PySpark

        return discard(self.engine, Selection(msg_ids=(msg_id,)), by=by)

    # -- retries ---------------------------------------------------------------------------

    def retries(self) -> RetryView:
        """Messages waiting per retry level and when the next of each is due."""
        stats = self.engine.stats()
        heads = self.engine.store.queue_heads()
        queues = set(stats.redis.scheduled_by_queue) | set(heads)
        rows = [
            LevelRow(_level_name(q), stats.redis.scheduled_by_queue.get(q, 0), heads.get(q))
            for q in sorted(queues, key=_queue_order)
        ]
        r = stats.redis
        return RetryView(
            levels=tuple(rows),
            retry_topic_length=r.retry_topic_length,
            undelivered=r.undelivered,
            delivered_unacked=r.delivered_unacked,
            live=r.live,
            next_due_ms=r.next_due_ms,
            journal_version=stats.journal_version,
        )

    # -- duplicates ------------------------------------------------------------------------

    def sample_duplicates(self) -> Sample:
        """Read the duplicate counters now and keep the sample."""
        totals = self.stats.totals()
        sample = Sample(int(time.time() * 1000), dict(sorted(totals.duplicates.items())))
        self.history.add(sample)
        return sample

    # -- index -----------------------------------------------------------------------------

    def index(self) -> IndexStatus | None:
        """The Redis index against the ledger (``None``: no ledger table yet)."""
        dd, hot = self._open_index()
        status = index_status(dd, hot)
        return None if status.ledger_version < 0 else status

    def _open_index(self) -> tuple[Dedup, RedisHotStore]:
        with self._index_lock:
            if self._index is None:
                self._index = open_index(with_ledger_buckets(self.config))
            return self._index

    # -- search ----------------------------------------------------------------------------

    def whereabouts(self, term: str) -> Whereabouts:
        """Where ``term`` — a business key, or a message id — is now."""
        dead: tuple[DeadLetter, ...] = ()
        if self.engine.dlq.exists():
            dead = tuple(
                d for d in self.engine.dlq.list() if term in (d.key, d.msg_id, d.origin_msg_id)
            )
        retrying = tuple(self._retrying(term))
        return Whereabouts(term, self._done(term), retrying, dead)

    def _done(self, key: str) -> bool | None:
        dd, _ = self._open_index()
        ledger = dd.ledger
        if ledger.version() < 0:
            return None
        try:
            return key in ledger.existing([key], since_ms=None)
        except IdemError:
            return None

    def _retrying(self, term: str) -> Iterator[str]:
        store = self.engine.store
        for n, entry in enumerate(store.live_entries()):
            if n >= SEARCH_SCAN_LIMIT:
                yield f"(searched the first {SEARCH_SCAN_LIMIT} live messages only)"
                return
            message = None
            if term not in (entry.msg_id, entry.origin_msg_id):
                message = self._live_message(entry)
                if message is None or message.keys != term:
                    continue
            yield _describe_live(entry, message or self._live_message(entry))

    def _live_message(self, entry: LiveEntry) -> MessageExt | None:
        store = self.engine.store
        client = store.client
        if entry.state is LiveState.SCHEDULED:
            wire = client.hget(store.keys.payloads, entry.msg_id)
        else:
            found = client.xrange(store.keys.stream, entry.location, entry.location)
            fields = found[0][1] if found else None
            wire = None if not fields else fields.get(b"m", fields.get("m"))
        if wire is None:
            return None
        try:
            return MessageExt.from_wire(wire)
        except (ValueError, TypeError):
            return None

    def close(self) -> None:
        """Close the Redis connections."""
        self.engine.close()


def _describe_live(entry: LiveEntry, message: MessageExt | None) -> str:
    times = "" if message is None else f", reconsume_times {message.reconsume_times}"
    if entry.state is LiveState.SCHEDULED:
        queue = entry.location.split(":", 1)[0]
        return (
            f"msg {entry.msg_id}: scheduled at level {_level_name(queue)}{times} "
            f"(origin {entry.origin_msg_id})"
        )
    return (
        f"msg {entry.msg_id}: due, in the retry topic at {entry.location}{times} "
        f"(origin {entry.origin_msg_id})"
    )


def _level_name(queue_id: str) -> str:
    if queue_id == TIMER_QUEUE:
        return TIMER_QUEUE
    try:
        return str(int(queue_id) + 1)
    except ValueError:
        return queue_id


def _queue_order(queue_id: str) -> tuple[int, str]:
    return (int(queue_id), "") if queue_id.isdigit() else (1 << 30, queue_id)
