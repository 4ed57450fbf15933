"""The Redis side of one group's resend path: schedule queues, ``%RETRY%<group>``, the cursor.

Every key of a group shares the hash tag ``rmq:{<group>}`` so that a move from a
schedule queue to the retry topic is one atomic script, also on Redis Cluster:

=====================================  ======  ==============================================
``rmq:{g}:SCHEDULE_TOPIC_XXXX:<qid>``  ZSET    one schedule queue per delay level (qid = level
                                               - 1) plus ``timer``; arrival:msg_id -> due ms
``rmq:{g}:schedule:heads``             ZSET    qid -> due ms of the queue's head
``rmq:{g}:schedule:messages``          HASH    msg_id -> wire of a scheduled message
``rmq:{g}:schedule:progress``          HASH    per queue: last due moved, count moved (the
                                               ``delayOffset``); arrival and retry offsets
``rmq:{g}:%RETRY%<g>``                 STREAM  the retry topic, read by consumer group ``g``
``rmq:{g}:live``                       HASH    msg_id -> where it is (scheduled / retrying)
``rmq:{g}:replaced``                   ZSET    msg_id -> journal time it was replaced (kept
                                               :data:`REPLACED_KEPT_MS`)
``rmq:{g}:journal:cursor``             STRING  next retry-journal position applied here
=====================================  ======  ==============================================

Check-then-act lives in ``lua/apply.lua`` and ``lua/move.lua``; this class only
builds their arguments. Transient failures are left to the caller (see
:mod:`idem.retry.faults`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from importlib import resources
from typing import Any, Literal

import redis
from redis.commands.core import Script

from idem.redis_cluster import RedisClient
from idem.retry.message import SCHEDULE_TOPIC, TIMER_QUEUE, retry_topic

REPLACED_KEPT_MS = 6 * 3600 * 1000
"""How long (journal time) a replaced message is remembered: a copy of it sent back again
within that time, or the message placed again, is a late copy and changes nothing. Copies
outlive their replacement by a consume timeout and a few re-submits, not by hours."""

APPLY_CHUNK = 1000
"""Ops per apply.lua call: large enough to amortise the round trip, small enough not to stall
Redis (a call of 1,000 ops takes about a millisecond)."""


def load_script(client: RedisClient, name: str) -> Script:
    """Register ``retry/lua/<name>`` on ``client`` (EVALSHA, reloaded when flushed)."""
    source = (resources.files("idem.retry") / "lua" / name).read_text(encoding="utf-8")
    return client.register_script(source)


@dataclass(frozen=True, slots=True)
class RetryKeys:
    """Redis key names of one consumer group (all under the hash tag ``rmq:{<group>}``)."""

    group: str

    @property
    def prefix(self) -> str:
        """``rmq:{<group>}``."""
        return f"rmq:{{{self.group}}}"

    @property
    def fixed(self) -> list[str]:
        """The group's keys other than its schedule queues, in apply.lua's KEYS order."""
        return [
            self.cursor,
            self.live,
            self.payloads,
            self.heads,
            self.stream,
            self.progress,
            self.replaced,
        ]

    def queue(self, queue_id: str) -> str:
        """The schedule queue ``queue_id`` (``level - 1``, or ``timer``)."""
        return f"{self.prefix}:{SCHEDULE_TOPIC}:{queue_id}"

    @property
    def heads(self) -> str:
        """Queue id -> due time of the queue's head."""
        return f"{self.prefix}:schedule:heads"

    @property
    def payloads(self) -> str:
        """Msg id -> wire of each scheduled message."""
        return f"{self.prefix}:schedule:messages"

    @property
    def progress(self) -> str:
        """Per-queue progress of the schedule service (RocketMQ's ``delayOffset``)."""
        return f"{self.prefix}:schedule:progress"

    @property
    def stream(self) -> str:
        """The retry topic ``%RETRY%<group>``."""
        return f"{self.prefix}:{retry_topic(self.group)}"

    @property
    def live(self) -> str:
        """Msg id -> state of every message scheduled or in the retry topic."""
        return f"{self.prefix}:live"

    @property
    def replaced(self) -> str:
        """Msg id -> journal time (ms) of the send-back that replaced it."""
        return f"{self.prefix}:replaced"

    @property
    def cursor(self) -> str:
        """The next retry-journal position this Redis has applied up to."""
        return f"{self.prefix}:journal:cursor"

    @property
    def journal(self) -> str:
        """The Delta table id of the retry journal this Redis follows (its cursor's table)."""
        return f"{self.prefix}:journal:id"

    @property
    def compacted(self) -> str:
        """Marker that the group's journal was compacted recently (expires after the interval)."""
        return f"{self.prefix}:journal:compacted"

    @property
    def files_compacted(self) -> str:
        """Marker that the journal's files were compacted recently (expires after the interval)."""
        return f"{self.prefix}:journal:files-compacted"

    @property
    def wake_channel(self) -> str:
        """Pub/sub channel telling schedule services that an earlier message arrived."""
        return f"{self.prefix}:schedule:wake"


class LiveState(StrEnum):
    """Where a live message is."""

    SCHEDULED = "S"
    RETRYING = "R"


@dataclass(frozen=True, slots=True)
class Op:
    """One step of apply.lua: schedule a message (``S``), do all a scheduling does but
    schedule it (``X``: it is removed again later in the same slice), or remove one (``R``).

    ``replaces`` names the message a schedule takes the place of; ``at_ms`` is the journal
    time of the event, against which :data:`REPLACED_KEPT_MS` is measured.
    """

    kind: Literal["S", "X", "R"]
    msg_id: str
    origin: str = ""
    queue_id: str = ""
    due_ms: int = 0
    wire: str = ""
    replaces: str = ""
    at_ms: int = 0


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What one apply did."""

    scheduled: int = 0
    removed: int = 0
    skipped: int = 0

    def __add__(self, other: ApplyResult) -> ApplyResult:
        return ApplyResult(
            self.scheduled + other.scheduled,
            self.removed + other.removed,
            self.skipped + other.skipped,
        )


@dataclass(frozen=True, slots=True)
class MoveResult:
    """What one move did; ``next_due_ms`` is the earliest head left (``None``: nothing)."""

    moved: int
    dropped: int
    next_due_ms: int | None
    lateness_ms: tuple[int, ...] = ()
    """How long past due the head of each queue moved from was (one per queue)."""


@dataclass(frozen=True, slots=True)
class LiveEntry:
    """A live message as Redis knows it."""

    msg_id: str
    state: LiveState
    origin_msg_id: str
    location: str


@dataclass(frozen=True, slots=True)
class ScheduleStats:
    """A snapshot of one group's Redis side."""

    scheduled_by_queue: dict[str, int] = field(default_factory=dict)
    retry_topic_length: int = 0
    undelivered: int = 0
    delivered_unacked: int = 0
    live: int = 0
    next_due_ms: int | None = None
    cursor: str | None = None
    progress: dict[str, str] = field(default_factory=dict)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ScheduleStore:
    """One group's schedule queues, retry topic and journal cursor in Redis."""

    def __init__(self, client: RedisClient, group: str) -> None:
        self.client = client
        self.group = group
        self.keys = RetryKeys(group)
        self._apply = load_script(client, "apply.lua")
        self._move = load_script(client, "move.lua")

    # -- applying journal events ---------------------------------------------------------

    def _apply_args(self, ops: Sequence[Op]) -> tuple[list[str], list[Any]]:
        keys = self.keys.fixed
        index: dict[str, int] = {}
        args: list[Any] = []
        for op in ops:
            if op.kind == "S":
                if op.queue_id not in index:
                    keys.append(self.keys.queue(op.queue_id))
                    index[op.queue_id] = len(keys)
                args += [
                    "S",
                    op.msg_id,
                    op.origin,
                    index[op.queue_id],
                    op.queue_id,
                    op.due_ms,
                    op.wire,
                    op.replaces,
                    op.at_ms,
                ]
            else:
                args += [op.kind, op.msg_id, "", "", "", "", "", op.replaces, op.at_ms]
        return keys, args

    def apply(self, ops: Sequence[Op], *, expect: str | None, new: str) -> ApplyResult | str:
        """Apply ``ops`` and move the cursor from ``expect`` (``None``: missing) to ``new``.

        Returns the current cursor (a string; ``""`` when missing) instead when it is not
        ``expect``: someone else applied that slice already, or Redis lost it.
        """
        keys, args = self._apply_args(ops)
        reply = self._apply(
            keys=keys,
            args=[
                "cursor",
                expect or "",
                new,
                self.group,
                self.keys.wake_channel,
                REPLACED_KEPT_MS,
                *args,
            ],
        )
        if int(reply[0]) == 0:
            return _text(reply[1])
        return ApplyResult(int(reply[1]), int(reply[2]), int(reply[3]))

    def apply_direct(self, ops: Sequence[Op]) -> ApplyResult:
        """Apply ``ops`` without touching the cursor (the client-side resend path)."""
        total = ApplyResult()
        for start in range(0, len(ops), APPLY_CHUNK):
            keys, args = self._apply_args(ops[start : start + APPLY_CHUNK])
            reply = self._apply(
                keys=keys,
                args=[
                    "direct",
                    "",
                    "",
                    self.group,
                    self.keys.wake_channel,
                    REPLACED_KEPT_MS,
                    *args,
                ],
            )
            total += ApplyResult(int(reply[1]), int(reply[2]), int(reply[3]))
        return total

    def follow(self, journal_id: str) -> str | None:
        """Bind this group's Redis state to the journal table ``journal_id``; returns the id
        it already follows when that is another table (then nothing is changed)."""
        key = self.keys.journal
        if self.client.set(key, journal_id, nx=True):
            return None
        current = self.client.get(key)
        if current is None or _text(current) == journal_id:
            return None
        return _text(current)

    def cursor(self) -> str | None:
        """The journal position applied so far (``None``: lost or never set)."""
        value = self.client.get(self.keys.cursor)
        return None if value is None else _text(value)

    # -- the schedule service's step -----------------------------------------------------

    def move_due(self, now_ms: int, budget: int) -> MoveResult:
        """Move up to ``budget`` due messages to the retry topic (one script call)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.zrangebyscore(self.keys.heads, "-inf", now_ms, withscores=True)
        pipe.zrange(self.keys.heads, 0, 0, withscores=True)
        due_queues, head = pipe.execute()
        if not due_queues:
            return MoveResult(0, 0, int(head[0][1]) if head else None)
        queue_ids = [_text(q) for q, _due in due_queues]
        lateness = tuple(max(0, now_ms - int(due)) for _q, due in due_queues)
        keys = [
            self.keys.heads,
            self.keys.live,
            self.keys.payloads,
            self.keys.stream,
            self.keys.progress,
            *(self.keys.queue(q) for q in queue_ids),
        ]
        moved, dropped, next_due = self._move(keys=keys, args=[now_ms, budget, *queue_ids])
        nxt = _text(next_due)
        return MoveResult(int(moved), int(dropped), int(float(nxt)) if nxt else None, lateness)

    def next_due_ms(self) -> int | None:
        """Due time of the earliest scheduled message (``None`` when none is scheduled)."""
        head = self.client.zrange(self.keys.heads, 0, 0, withscores=True)
        return int(head[0][1]) if head else None

    def queue_heads(self) -> dict[str, int]:
        """Due time (ms) of each schedule queue's head, by queue id (``level - 1``, or
        ``timer``); a queue holding nothing is absent."""
        heads = self.client.zrange(self.keys.heads, 0, -1, withscores=True)
        return {_text(entry[0]): int(entry[1]) for entry in heads}

    def wake(self) -> None:
        """Tell every schedule service of the group to look at the queues now."""
        self.client.publish(self.keys.wake_channel, "wake")

    # -- inspection ----------------------------------------------------------------------

    def pending(self) -> int:
        """Messages scheduled or in the retry topic and not yet acknowledged."""
        return int(self.client.hlen(self.keys.live))

    def live_entries(self) -> Iterator[LiveEntry]:
        """Every live message (HSCAN, so it is safe on a big group)."""
        for raw_id, raw_state in self.client.hscan_iter(self.keys.live, count=1000):
            state = _text(raw_state)
            tag, location, origin = state.split("|", 2)
            yield LiveEntry(_text(raw_id), LiveState(tag), origin, location)

    def stats(self) -> ScheduleStats:
        """Counts per queue, retry topic lag, cursor and progress."""
        heads = [_text(q) for q in self.client.zrange(self.keys.heads, 0, -1)]
        pipe = self.client.pipeline(transaction=False)
        for queue_id in heads:
            pipe.zcard(self.keys.queue(queue_id))
        pipe.xlen(self.keys.stream)
        pipe.hlen(self.keys.live)
        pipe.hgetall(self.keys.progress)
        replies = pipe.execute()
        by_queue = {q: int(n) for q, n in zip(heads, replies[: len(heads)], strict=True)}
        length, live, progress = replies[len(heads) :]
        undelivered, delivered = int(length), 0  # no consumer group yet: none was delivered
        try:
            for info in self.client.xinfo_groups(self.keys.stream):
                if _text(info.get("name", "")) == self.group:
                    delivered = int(info.get("pending", 0))
                    undelivered = max(int(length) - delivered, 0)
        except redis.ResponseError:  # no stream yet
            pass
        return ScheduleStats(
            scheduled_by_queue=by_queue,
            retry_topic_length=int(length),
            undelivered=undelivered,
            delivered_unacked=delivered,
            live=int(live),
            next_due_ms=self.next_due_ms(),
            cursor=self.cursor(),
            progress={_text(k): _text(v) for k, v in progress.items()},
        )

    def purge(self) -> int:
        """Delete every key of the group (before a forced rebuild); returns keys deleted.

        The keys are found by name, never by ``SCAN`` (which a group's ACL user may not
        run: it lists every group's keys): the fixed names, and every schedule queue
        that ``heads`` lists (each queue holding messages) or ``progress`` has a count
        for (each queue ever moved from), plus the timer queue.
        """
        pipe = self.client.pipeline(transaction=False)
        pipe.zrange(self.keys.heads, 0, -1)
        pipe.hkeys(self.keys.progress)
        heads, progress = pipe.execute()
        queues = {_text(q) for q in heads} | {TIMER_QUEUE}
        queues |= {_text(f).removesuffix(":moved") for f in progress if _text(f).endswith(":moved")}
        names = {*self.keys.fixed, self.keys.journal, self.keys.compacted}
        names.add(self.keys.files_compacted)
        names |= {self.keys.queue(q) for q in queues}
        return int(self.client.delete(*sorted(names)))
