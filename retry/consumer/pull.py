"""The pull side of the push consumer (``PullMessageService``), with flow control.

One thread per subscribed topic pulls every assigned queue of that topic in a
single ``XREAD`` (long polling: it waits up to ``pull_block_ms`` when nothing is
new). A queue is skipped while it caches more than ``pull_threshold_for_queue``
messages (1000), more than ``pull_threshold_size_for_queue_mib`` (100 MiB), or —
concurrently — spans more than ``consume_concurrently_max_span`` offsets (2000).
An orderly queue is pulled only while this instance holds its lock.
``%RETRY%<group>`` is read through the retry engine (a Redis consumer group).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import redis

from idem.errors import IdemError
from idem.redis_cluster import RedisClient
from idem.retry.consumer.process_queue import ProcessQueue
from idem.retry.consumer.rebalance import RebalanceImpl
from idem.retry.consumer.settings import ConsumerSettings
from idem.retry.consumer.stats import ConsumerStats
from idem.retry.consumer.topics import UNDECODABLE, MessageQueue, TopicStore
from idem.retry.engine import RetryEngine
from idem.retry.faults import REDIS_TRANSIENT
from idem.retry.message import MessageExt

log = logging.getLogger(__name__)

PULL_TIME_DELAY_MILLS_WHEN_EXCEPTION = 3000

RETAKE_IDLE_MS = 10_000
"""``%RETRY%<group>``: deliveries unacknowledged this long (or twice the offset persist
interval, if longer) are taken over by the queue's owner, checked as often."""
"""A pull that failed is tried again this much later (RocketMQ: 3 s)."""

MIB = 1024 * 1024

_PULL_FAILURES: tuple[type[BaseException], ...] = (*REDIS_TRANSIENT, IdemError)


class TagFilter:
    """``subscribe(topic, "TagA || TagB")``: which tags a subscription accepts (``*``: all)."""

    def __init__(self, expression: str = "*") -> None:
        self.expression = expression.strip() or "*"
        tags = {t.strip() for t in self.expression.split("||") if t.strip()}
        self.tags: frozenset[str] | None = None if "*" in tags else frozenset(tags)

    def matches(self, message: MessageExt) -> bool:
        """Whether ``message`` is for this subscription."""
        return self.tags is None or (message.tags or "") in self.tags


Delivered = Callable[[MessageQueue, ProcessQueue, Sequence[MessageExt]], None]


class PullService:
    """Pull threads of one consumer instance."""

    def __init__(
        self,
        *,
        client_id: str,
        topics: TopicStore,
        rebalance: RebalanceImpl,
        settings: ConsumerSettings,
        stats: ConsumerStats,
        filters: dict[str, TagFilter],
        orderly: bool,
        clustering: bool,
        on_pulled: Delivered,
        on_filtered: Callable[[MessageQueue, ProcessQueue, int], None],
        client: RedisClient,
        engine: RetryEngine | None = None,
        retry_topic: str | None = None,
        on_failure: Callable[[], object] | None = None,
        before_pull: Callable[[], object] | None = None,
    ) -> None:
        self.client_id = client_id
        self.on_failure = on_failure
        """Called when a pull fails (Redis may come back with less than it had)."""
        self.before_pull = before_pull
        """Called before every pull (the consumer checks its queues after a failure)."""
        self.topics = topics
        self.rebalance = rebalance
        self.settings = settings
        self.stats = stats
        self.filters = filters
        self.orderly = orderly
        self.clustering = clustering
        self.on_pulled = on_pulled
        self.on_filtered = on_filtered
        self.client = client
        self.engine = engine
        self.retry_topic = retry_topic
        self._stop = threading.Event()
        self._last_retake = time.monotonic()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """One pull thread per subscribed topic."""
        self._stop.clear()
        for topic in self.filters:
            thread = threading.Thread(
                target=self._loop, args=(topic,), daemon=True, name=f"{self.client_id}-pull-{topic}"
            )
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop pulling (a blocked read returns within ``pull_block_ms``)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        self._threads.clear()

    def may_pull(self, pq: ProcessQueue) -> bool:
        """Flow control (and, orderly, the lock) for one queue."""
        s = self.settings
        if pq.dropped:
            return False
        if self.orderly and self.clustering and not pq.locked:
            return False
        if (
            pq.msg_count > s.pull_threshold_for_queue
            or pq.msg_size > s.pull_threshold_size_for_queue_mib * MIB
            or (not self.orderly and pq.max_span() > s.consume_concurrently_max_span)
        ):
            self.stats.add(flow_control=1)
            return False
        return True

    def _loop(self, topic: str) -> None:
        delay = self.settings.pull_time_delay_when_flow_control_ms / 1000
        while not self._stop.is_set():
            try:
                if self.before_pull is not None:
                    self.before_pull()
                pqs = [pq for pq in self.rebalance.process_queues(topic) if self.may_pull(pq)]
                if not pqs:
                    self._stop.wait(delay)
                    continue
                if topic == self.retry_topic:
                    self._pull_retry(pqs[0])
                else:
                    self._pull(pqs)
            except _PULL_FAILURES as exc:
                if self.on_failure is not None:
                    self.on_failure()
                log.warning(
                    "%s: pull of %s failed (%s); again in %d ms",
                    self.client_id,
                    topic,
                    exc,
                    PULL_TIME_DELAY_MILLS_WHEN_EXCEPTION,
                )
                self._stop.wait(PULL_TIME_DELAY_MILLS_WHEN_EXCEPTION / 1000)
            except Exception:
                log.exception("%s: pull of %s failed", self.client_id, topic)
                self._stop.wait(PULL_TIME_DELAY_MILLS_WHEN_EXCEPTION / 1000)

    def _pull(self, pqs: Sequence[ProcessQueue]) -> None:
        offsets = {pq.mq: pq.next_offset for pq in pqs}
        anchors = {pq.mq: pq.last_pulled for pq in pqs if pq.last_pulled is not None}
        if anchors and isinstance(self.client, redis.Redis):
            # Checked in the same round trip: a queue Redis rewound under this consumer
            # hands its offsets out again, and a pull from the old offset would skip them.
            found, rewound = self.topics.read_many_anchored(
                offsets,
                anchors,
                self.settings.pull_batch_size,
                self.settings.pull_block_ms or None,
                client=self.client,
            )
            if rewound and self.on_failure is not None:
                self.on_failure()  # the consumer restarts those queues before the next pull
        else:
            found = self.topics.read_many(
                offsets,
                self.settings.pull_batch_size,
                self.settings.pull_block_ms or None,
                client=self.client,
            )
        for pq in pqs:
            messages = found.get(pq.mq)
            if messages and pq.next_offset == offsets[pq.mq]:
                self._deliver(pq, messages)

    def _pull_retry(self, pq: ProcessQueue) -> None:
        assert self.engine is not None
        now = time.monotonic()
        # A new owner takes over every delivery a previous owner left unacknowledged. Later,
        # now and then, those idle for long: a previous owner's read still in flight when
        # the queue moved lands in its pending list after the takeover, and it may die.
        # Past the retry acks' own delay: they are sent with the next offset persist.
        retake_ms = max(RETAKE_IDLE_MS, 2 * self.settings.persist_consumer_offset_interval_ms)
        stale = now - self._last_retake >= retake_ms / 1000
        if pq.take_over_deliveries or stale:
            idle_ms = 0 if pq.take_over_deliveries else retake_ms
            taken = self._take_over_deliveries(idle_ms)
            pq.take_over_deliveries = False
            self._last_retake = now
            if taken:
                log.info(
                    "%s: took over %d unacknowledged retry deliveries", self.client_id, len(taken)
                )
                self._deliver(pq, taken)
        messages = self.engine.poll_retry(
            self.client_id, self.settings.pull_batch_size, self.settings.pull_block_ms or None
        )
        if messages:
            self._deliver(pq, messages)

    def _take_over_deliveries(self, min_idle_ms: int = 0) -> list[MessageExt]:
        """Claim the pending entries of ``%RETRY%<group>`` idle at least ``min_idle_ms``
        (``XAUTOCLAIM``; this consumer's own are re-read too, and its process queue drops
        those it still holds)."""
        assert self.engine is not None
        self.engine.catch_up()  # the journal may have removed some since (a dead letter)
        topic = self.engine.topic
        taken: list[MessageExt] = []
        start: Any = "0-0"
        try:
            while True:
                reply: list[Any] = cast(
                    Any,
                    self.engine.client.xautoclaim(
                        topic.key,
                        topic.group,
                        self.client_id,
                        min_idle_time=min_idle_ms,
                        start_id=start,
                        count=1000,
                    ),
                )
                taken += topic.entries_to_messages(reply[1])
                start = reply[0]
                if start in (b"0-0", "0-0"):
                    return taken
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            return taken

    def _deliver(self, pq: ProcessQueue, messages: Sequence[MessageExt]) -> None:
        if pq.dropped or self.rebalance.get(pq.mq) is not pq:
            return  # the queue moved while the pull was in flight
        if messages[-1].queue_offset + 1 > pq.next_offset:
            pq.next_offset = messages[-1].queue_offset + 1
            pq.last_pulled = (messages[-1].queue_offset, messages[-1].msg_id)
        subscription = self.filters.get(pq.mq.topic)
        # An entry that is not a message has no tags to filter on: it goes on to be
        # dead-lettered (never filtered out unseen).
        matched = [
            m
            for m in messages
            if subscription is None or UNDECODABLE in m.properties or subscription.matches(m)
        ]
        added = pq.put_messages(matched)
        self.stats.add(pulled=len(added))
        if len(matched) < len(messages):
            self.on_filtered(pq.mq, pq, pq.next_offset)
        if added:
            self.on_pulled(pq.mq, pq, added)
