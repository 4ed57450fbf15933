"""Rebalance: heartbeats in Redis, average allocation, and the process-queue table.

Instances of a group heartbeat into ``rmq:cg:{<group>}:members`` (``lua/heartbeat.lua``);
a join, a clean leave or an expired heartbeat bumps the group's epoch and is
published on ``rmq:cg:{<group>}:notify``, and every member rebalances at once
(RocketMQ's ``NOTIFY_CONSUMER_IDS_CHANGED``). Rebalance also runs on a timer
(``rebalance_interval_ms``, default 20 s).

Queues are allocated with :func:`allocate_averagely`. A queue taken away is
marked *dropped*: its in-flight results are not committed (redelivery case C6),
its offset is persisted as it stands and forgotten.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

from redis.commands.core import Script

from idem.clock import SYSTEM_CLOCK, Clock
from idem.redis_cluster import RedisClient
from idem.retry.consumer.process_queue import ProcessQueue
from idem.retry.consumer.topics import MessageQueue
from idem.retry.faults import REDIS_TRANSIENT
from idem.retry.status import MessageModel

log = logging.getLogger(__name__)

DEFAULT_REBALANCE_INTERVAL_MS = 20_000
"""``RebalanceService``'s wait between two rebalances (``rocketmq.client.rebalance.waitInterval``).
"""

DEFAULT_HEARTBEAT_INTERVAL_MS = 30_000
"""``heartbeatBrokerInterval``."""


def load_script(client: RedisClient, name: str) -> Script:
    """Register ``retry/consumer/lua/<name>`` on ``client``."""
    source = (resources.files("idem.retry.consumer") / "lua" / name).read_text(encoding="utf-8")
    return client.register_script(source)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def allocate_averagely(
    current_cid: str, mq_all: Sequence[MessageQueue], cid_all: Sequence[str]
) -> list[MessageQueue]:
    """``AllocateMessageQueueAveragely``: contiguous, near-equal shares in sorted order."""
    mqs, cids = sorted(mq_all), sorted(cid_all)
    if not mqs or current_cid not in cids:
        return []
    index = cids.index(current_cid)
    mod = len(mqs) % len(cids)
    if len(mqs) <= len(cids):
        average = 1
    elif mod > 0 and index < mod:
        average = len(mqs) // len(cids) + 1
    else:
        average = len(mqs) // len(cids)
    start = index * average if mod > 0 and index < mod else index * average + mod
    count = min(average, len(mqs) - start)
    return [mqs[(start + i) % len(mqs)] for i in range(max(count, 0))]


@dataclass(frozen=True, slots=True)
class Members:
    """The group's live instances as one heartbeat saw them."""

    epoch: int
    changed: bool
    client_ids: tuple[str, ...]


class Membership:
    """One instance's heartbeat and view of its group."""

    def __init__(
        self,
        client: RedisClient,
        group: str,
        client_id: str,
        *,
        expire_ms: int,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.client = client
        self.group = group
        self.client_id = client_id
        self.expire_ms = expire_ms
        self.clock = clock
        prefix = f"rmq:cg:{{{group}}}"
        self.members_key = f"{prefix}:members"
        self.epoch_key = f"{prefix}:epoch"
        self.channel = f"{prefix}:notify"
        self._script = load_script(client, "heartbeat.lua")

    def _call(self, op: str) -> Members:
        reply = self._script(
            keys=[self.members_key, self.epoch_key],
            args=[self.clock.now_ms(), self.expire_ms, self.client_id, op, self.channel],
        )
        return Members(int(reply[0]), bool(int(reply[1])), tuple(_text(m) for m in reply[2:]))

    def beat(self) -> Members:
        """Heartbeat (join or stay); expired members are removed."""
        return self._call("beat")

    def leave(self) -> Members:
        """Leave the group (clean shutdown): the others rebalance now."""
        return self._call("leave")

    def look(self) -> Members:
        """The members, without beating."""
        return self._call("look")

    def publish(self, message: str) -> None:
        """Tell every member something (``reset:<json>``)."""
        self.client.publish(self.channel, message)


class RebalanceHooks(Protocol):
    """What a rebalance asks of its consumer."""

    def compute_pull_from_where(self, mq: MessageQueue) -> int:
        """Where a newly assigned queue starts (raises when the offset store is away)."""
        ...

    def lock_queue(self, mq: MessageQueue, pq: ProcessQueue) -> bool:
        """Orderly: take the queue's lock before consuming it (concurrently: ``True``)."""
        ...

    def remove_unnecessary_queue(self, mq: MessageQueue, pq: ProcessQueue) -> bool:
        """Persist and forget a queue taken away; ``False`` keeps it for now."""
        ...

    def queues_of(self, topic: str) -> list[MessageQueue]:
        """Every queue of a subscribed topic."""
        ...

    def on_queue_added(self, mq: MessageQueue, pq: ProcessQueue) -> None:
        """A queue was just assigned here (its process queue is in the table)."""
        ...


class RebalanceImpl:
    """The process-queue table of one instance, kept in line with its allocation."""

    def __init__(
        self,
        *,
        client_id: str,
        model: MessageModel,
        topics: Sequence[str],
        hooks: RebalanceHooks,
        allocate: Callable[
            [str, Sequence[MessageQueue], Sequence[str]], list[MessageQueue]
        ] = allocate_averagely,
    ) -> None:
        self.client_id = client_id
        self.model = model
        self.topics = list(topics)
        self.hooks = hooks
        self.allocate = allocate
        self._lock = threading.RLock()
        self.table: dict[MessageQueue, ProcessQueue] = {}
        self.epoch = -1

    def process_queues(self, topic: str | None = None) -> list[ProcessQueue]:
        """The live process queues (of ``topic``)."""
        with self._lock:
            return [
                pq
                for mq, pq in self.table.items()
                if not pq.dropped and (topic is None or mq.topic == topic)
            ]

    def get(self, mq: MessageQueue) -> ProcessQueue | None:
        """The process queue of ``mq`` (``None``: not assigned here)."""
        with self._lock:
            return self.table.get(mq)

    def do_rebalance(self, members: Members) -> bool:
        """Re-allocate every subscribed topic among ``members``; returns whether anything moved."""
        changed = False
        with self._lock:
            self.epoch = members.epoch
            for topic in self.topics:
                try:
                    mqs = self.hooks.queues_of(topic)
                except REDIS_TRANSIENT as exc:
                    log.warning("rebalance of %s: cannot read its queues (%s)", topic, exc)
                    continue
                if self.model is MessageModel.BROADCASTING:
                    allocated = mqs
                else:
                    allocated = self.allocate(self.client_id, mqs, members.client_ids)
                changed |= self._update_table(topic, set(allocated))
        return changed

    def _update_table(self, topic: str, allocated: set[MessageQueue]) -> bool:
        changed = False
        for mq, pq in list(self.table.items()):
            if mq.topic != topic:
                continue
            if mq not in allocated or pq.dropped:
                pq.dropped = True
                if self.hooks.remove_unnecessary_queue(mq, pq):
                    del self.table[mq]
                    changed = True
                    log.info("%s: dropped %s", self.client_id, mq)
        for mq in sorted(allocated):
            if mq in self.table:
                continue
            pq = ProcessQueue(mq)
            if not self.hooks.lock_queue(mq, pq):
                continue  # orderly: another instance still holds it; next round
            try:
                offset = self.hooks.compute_pull_from_where(mq)
            except Exception as exc:
                log.warning("%s: cannot start %s now (%s); next rebalance", self.client_id, mq, exc)
                continue
            pq.next_offset = offset
            self.table[mq] = pq
            self.hooks.on_queue_added(mq, pq)
            changed = True
            log.info("%s: took %s from offset %d", self.client_id, mq, offset)
        return changed

    def drop(self, mqs: Sequence[MessageQueue]) -> list[tuple[MessageQueue, ProcessQueue]]:
        """Mark ``mqs`` dropped and take them out of the table (reset, shutdown)."""
        out = []
        with self._lock:
            for mq in mqs:
                pq = self.table.pop(mq, None)
                if pq is not None:
                    pq.dropped = True
                    out.append((mq, pq))
        return out

    def drop_all(self) -> list[tuple[MessageQueue, ProcessQueue]]:
        """Mark every queue dropped and empty the table."""
        with self._lock:
            return self.drop(list(self.table))


class RebalanceService:
    """The thread that heartbeats, listens for membership changes and rebalances."""

    def __init__(
        self,
        membership: Membership,
        impl: RebalanceImpl,
        *,
        rebalance_interval_ms: int = DEFAULT_REBALANCE_INTERVAL_MS,
        heartbeat_interval_ms: int = DEFAULT_HEARTBEAT_INTERVAL_MS,
        on_notice: Callable[[str], None] | None = None,
        name: str = "idem-rebalance",
    ) -> None:
        self.membership = membership
        self.impl = impl
        self.rebalance_interval_ms = rebalance_interval_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.on_notice = on_notice
        self.name = name
        self.rebalances = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def rebalance_now(self) -> Members:
        """Heartbeat and rebalance in the caller's thread."""
        members = self.membership.beat()
        self.impl.do_rebalance(members)
        self.rebalances += 1
        return members

    def wakeup(self) -> None:
        """Rebalance as soon as possible (``rebalanceImmediately``)."""
        self._wake.set()

    def _run(self) -> None:
        clock = self.membership.clock
        pubsub: Any = None
        next_rebalance = 0
        next_beat = 0
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self.membership.client.pubsub(  # type: ignore[no-untyped-call,unused-ignore]
                        ignore_subscribe_messages=True
                    )
                    pubsub.subscribe(self.membership.channel)
                    next_rebalance = 0
                now = clock.now_ms()
                woken = self._wake.is_set()  # wakeup(): a reset dropped queues, take them back
                if now >= next_beat or now >= next_rebalance or woken:
                    if woken:  # a wakeup() after the read above stays set for the next round
                        self._wake.clear()
                    members = self.membership.beat()
                    next_beat = now + self.heartbeat_interval_ms
                    if (
                        woken
                        or members.changed
                        or members.epoch != self.impl.epoch
                        or now >= next_rebalance
                    ):
                        self.impl.do_rebalance(members)
                        self.rebalances += 1
                        next_rebalance = now + self.rebalance_interval_ms
                wait_ms = max(min(next_beat, next_rebalance) - clock.now_ms(), 1)
                message = pubsub.get_message(timeout=min(wait_ms, 200) / 1000)
                while message is not None:
                    data = _text(message.get("data", ""))
                    if data.startswith("ids_changed:"):
                        self._wake.set()
                    elif self.on_notice is not None:
                        self.on_notice(data)
                    message = pubsub.get_message(timeout=0)
            except REDIS_TRANSIENT as exc:
                log.warning("%s: Redis unavailable (%s)", self.name, exc)
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
                    pubsub = None
                self._stop.wait(0.2)
            except Exception:
                log.exception("%s: rebalance failed", self.name)
                self._stop.wait(0.2)
        if pubsub is not None:
            with contextlib.suppress(Exception):
                pubsub.close()

    def start(self) -> None:
        """Run in a daemon thread."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
