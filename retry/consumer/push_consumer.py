"""``PushConsumer``: RocketMQ's push consumer for one group, on Redis.

::

    consumer = PushConsumer(IdemConfig(group="billing", redis_url=...),
                            settings=ConsumerSettings(consume_message_batch_max_size=16))
    consumer.subscribe("orders")
    consumer.register_message_listener_concurrently(listener)
    consumer.use(DedupMiddleware(Dedup(config), key="keys"))   # exactly once per key
    consumer.start()

Clustering (default): the group's instances share the queues (rebalance), a
failed message is sent back through the retry engine, ``%RETRY%<group>`` is
subscribed automatically, offsets live in Redis and are persisted every 5 s.
Broadcasting: every instance consumes every queue, offsets live in a local
file, and a failed message is logged and *dropped* — RocketMQ does not retry
broadcast messages, and neither does this consumer.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import redis
from redis.cluster import RedisCluster

from idem.clock import SYSTEM_CLOCK, Clock
from idem.config import IdemConfig
from idem.errors import ConfigError, LedgerError
from idem.redis_client import connect
from idem.redis_cluster import RedisClient
from idem.retry.consumer.concurrently import ConcurrentlyService
from idem.retry.consumer.listener import (
    BatchResult,
    CallNext,
    ConsumeScope,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    Middleware,
    chain,
    invoke_concurrently,
    invoke_orderly,
)
from idem.retry.consumer.middleware import DedupMiddleware
from idem.retry.consumer.offset_store import (
    LocalFileOffsetStore,
    OffsetStore,
    ReadOffsetType,
    RemoteOffsetStore,
)
from idem.retry.consumer.orderly import OrderlyService, QueueLocks
from idem.retry.consumer.process_queue import ProcessQueue
from idem.retry.consumer.pull import PullService, TagFilter
from idem.retry.consumer.rebalance import (
    Membership,
    RebalanceImpl,
    RebalanceService,
)
from idem.retry.consumer.scheduler import Scheduler
from idem.retry.consumer.settings import ConsumeFromWhere, ConsumerSettings
from idem.retry.consumer.stats import ConsumerStats
from idem.retry.consumer.topics import UNDECODABLE, MessageQueue, TopicStore
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt, retry_topic
from idem.retry.schedule import ScheduleService
from idem.retry.status import (
    MessageModel,
)

log = logging.getLogger(__name__)

HALF_HOUR_MS = 30 * 60_000
RESET_NOTICE = "reset:"

SHUTDOWN_FLUSH_MS = 30_000
"""How long a shutdown waits, at least, for the acknowledgements a layer holds back (idem's
group commit of messages already consumed), whatever ``await_termination_ms`` says: the
sink holds those messages, and an offset persisted before their commit lets them be
consumed again. A commit taking longer finishes in the background, uncounted."""


class PushConsumer:
    """One instance of a consumer group (``DefaultMQPushConsumer``).

    Configure it (:meth:`subscribe`, a listener, :meth:`use`) before :meth:`start`.
    Listeners and middleware are called on the consumer's consume threads, one
    call per batch of at most ``consume_message_batch_max_size`` messages of one
    queue; the middleware run outermost first, around the listener. A listener
    returns its status (an exception counts as ``RECONSUME_LATER``). Listener and
    middleware should finish within ``consume_timeout_ms``: a concurrent
    consumer sends a message still in flight after that back to be consumed
    again. They must not call :meth:`shutdown` of their own consumer (it waits
    up to ``await_termination_ms`` for the running calls, their own included).

    Args:
        config: The group's settings: its name, Redis URL, delay levels,
            ``max_reconsume_times`` (unless ``settings`` sets it) and the paths of
            the retry journal and the DLQ.
        settings: RocketMQ's consumer settings (message model, thread counts,
            batch sizes, consume-from-where, timeouts); RocketMQ's defaults if
            omitted.
        client: The Redis client of the topics and the retry engine; built from
            ``config.redis_url`` if omitted.
        engine: The retry engine failed messages are sent back through; by
            default one on ``client`` with the consumer's ``max_reconsume_times``.
            Broadcasting consumers have none (RocketMQ does not retry their
            messages).
        offset_client: The Redis client of the consume offsets (clustering);
            ``client`` if omitted.
        instance_name: This instance's name in the group (its client id, and the
            offset file's name when broadcasting); a random one if omitted.
        middleware: Layers around the listener (e.g. :class:`DedupMiddleware`),
            the first outermost; :meth:`use` adds more.
        run_schedule_service: Run the group's schedule service (due retries move
            to ``%RETRY%<group>``) in this process while the consumer runs. Pass
            ``False`` when ``idem schedule`` or another process runs it.
        clock: The time source of delays, timeouts and offsets' persistence.
    """

    def __init__(
        self,
        config: IdemConfig,
        *,
        settings: ConsumerSettings | None = None,
        client: RedisClient | None = None,
        engine: RetryEngine | None = None,
        offset_client: RedisClient | None = None,
        instance_name: str | None = None,
        middleware: Sequence[Middleware] = (),
        run_schedule_service: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.config = config
        self.group = config.group
        self.settings = settings or ConsumerSettings()
        self.clock = clock
        self.client = client if client is not None else connect(config.redis_url)
        name = instance_name or uuid.uuid4().hex[:8]
        self.client_id = f"{socket.gethostname()}@{os.getpid()}@{name}"
        self.topics = TopicStore(self.client, clock=clock)
        self.stats = ConsumerStats()
        self.scheduler = Scheduler(f"{self.client_id}-timer")
        clustering = self.settings.message_model is MessageModel.CLUSTERING
        if engine is None and clustering:  # the send-back applies the consumer's limit
            engine = RetryEngine(
                config.with_changes(max_reconsume_times=self.max_reconsume_times),
                client=self.client,
                clock=clock,
            )
        self.engine = engine
        self.offset_store: OffsetStore
        if clustering:
            self.offset_store = RemoteOffsetStore(offset_client or self.client, self.group)
        else:
            directory = self.settings.offset_store_dir or str(Path.home() / ".rocketmq_offsets")
            # A restart must find its offsets: without an instance name the file is
            # DEFAULT's, as RocketMQ keeps "DEFAULT" for broadcasting consumers.
            self.offset_store = LocalFileOffsetStore(
                directory, instance_name or "DEFAULT", self.group
            )
        self.run_schedule_service = run_schedule_service and engine is not None
        self._middleware: list[Middleware] = list(middleware)
        self._filters: dict[str, TagFilter] = {}
        self._concurrently: MessageListenerConcurrently | None = None
        self._orderly: MessageListenerOrderly | None = None
        self._consume_timeout_ms = self.settings.consume_timeout_ms
        self._retry_topic = retry_topic(self.group)
        self._retry_acks: list[MessageExt] = []
        self._acks_lock = threading.Lock()
        self._reset_lock = threading.Lock()
        self._redis_suspect = threading.Event()
        """A pull failed: the queues are checked before the next pull or persist."""
        self._suspect_lock = threading.Lock()
        self._run_id: str | None = None
        self._next_identity_check = 0.0
        self._started = False
        self._consume_timestamp_ms = 0
        self.rebalance: RebalanceImpl | None = None
        self.rebalance_service: RebalanceService | None = None
        self.membership: Membership | None = None
        self.pull_service: PullService | None = None
        self.concurrently_service: ConcurrentlyService | None = None
        self.orderly_service: OrderlyService | None = None
        self.schedule_service: ScheduleService | None = None

    # -- configuration -------------------------------------------------------------------

    def subscribe(self, topic: str, sub_expression: str = "*") -> None:
        """Consume ``topic`` (messages whose tag matches ``"TagA || TagB"``; ``*`` = all)."""
        if self._started:
            raise ConfigError("subscribe: call it before start()")
        self._filters[topic] = TagFilter(sub_expression)

    def register_message_listener_concurrently(self, listener: MessageListenerConcurrently) -> None:
        """Consume with a concurrent listener (``MessageListenerConcurrently``)."""
        self._concurrently, self._orderly = listener, None
        self._adopt_middleware(listener)

    def register_message_listener_orderly(self, listener: MessageListenerOrderly) -> None:
        """Consume with an orderly listener (``MessageListenerOrderly``)."""
        self._orderly, self._concurrently = listener, None
        self._adopt_middleware(listener)

    def _adopt_middleware(self, listener: object) -> None:
        attached = getattr(listener, "idem_middleware", None)
        if attached is not None and attached not in self._middleware:
            self._middleware.append(attached)

    def use(self, middleware: Middleware) -> None:
        """Add a middleware layer (inside the ones added before)."""
        self._middleware.append(middleware)

    @property
    def consume_timeout_ms(self) -> int:
        """Per-message consume timeout; settable while running (takes effect within 250 ms)."""
        return self._consume_timeout_ms

    @consume_timeout_ms.setter
    def consume_timeout_ms(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1000:
            raise ConfigError(f"consume_timeout_ms: {value!r} must be a whole number >= 1000")
        self._consume_timeout_ms = value
        if self.concurrently_service is not None:
            self.concurrently_service.watchdog.poke()

    @property
    def max_reconsume_times(self) -> int:
        """The settings' value, or the group's (``IdemConfig.max_reconsume_times``)."""
        configured = self.settings.max_reconsume_times
        return self.config.max_reconsume_times if configured < 0 else configured

    @property
    def broadcasting(self) -> bool:
        """Whether this consumer broadcasts (failed messages are dropped)."""
        return self.settings.message_model is MessageModel.BROADCASTING

    @property
    def orderly(self) -> bool:
        """Whether the listener is orderly."""
        return self._orderly is not None

    # -- the chain -----------------------------------------------------------------------

    def build_chain(self, mq: MessageQueue, *, orderly: bool) -> CallNext:
        """The middleware chain ending in the listener, for one call on ``mq``."""
        scope = ConsumeScope(
            mq=mq, client_id=self.client_id, orderly=orderly, defer_acks=not orderly
        )
        terminal = self._call_orderly if orderly else self._call_concurrently
        return _dead_lettering_undecodable(chain(self._middleware, terminal, scope))

    def _call_concurrently(self, messages: Sequence[MessageExt]) -> BatchResult:
        assert self._concurrently is not None
        return invoke_concurrently(self._concurrently, messages)

    def _call_orderly(self, messages: Sequence[MessageExt]) -> BatchResult:
        assert self._orderly is not None
        return invoke_orderly(self._orderly, messages)

    # -- offsets -------------------------------------------------------------------------

    def is_retry_queue(self, mq: MessageQueue) -> bool:
        """Whether ``mq`` is ``%RETRY%<group>``."""
        return mq.topic == self._retry_topic

    def commit_offset(
        self, mq: MessageQueue, pq: ProcessQueue, offset: int, *, increase_only: bool
    ) -> None:
        """``updateConsumeOffset``, unless the queue was dropped (its results do not count)."""
        if self.is_retry_queue(mq):
            return
        with pq.unless_dropped() as assigned:
            if assigned:
                self.offset_store.update_offset(mq, offset, increase_only)

    def ack_retried(self, messages: Sequence[MessageExt]) -> None:
        """Retry-topic messages consumed: acknowledged with the next offset persist."""
        with self._acks_lock:
            self._retry_acks.extend(messages)

    def _flush_retry_acks(self) -> None:
        with self._acks_lock:
            pending, self._retry_acks = self._retry_acks, []
        if not pending or self.engine is None:
            return
        try:
            self.engine.ack(pending)
        except Exception:
            log.warning(
                "ack of %d retried message(s) failed; again with the next persist",
                len(pending),
                exc_info=True,
            )
            with self._acks_lock:
                self._retry_acks[:0] = pending

    def _check_queues_if_redis_changed(self) -> None:
        """After a failed pull or a Redis restart (its ``run_id`` changed: a restart the
        client's quick reconnect hid, or a failover), before anything pulls or persists
        again: Redis may be back with less than it had (:meth:`correct_illegal_offsets`).
        A persist first would write this instance's offsets over the ones Redis came
        back with, and a pull would move past offsets it handed out again."""
        now = time.monotonic()
        if not self._redis_suspect.is_set() and now >= self._next_identity_check:
            with self._suspect_lock:
                if now >= self._next_identity_check:
                    self._next_identity_check = now + 1.0
                    run_id = self._server_run_id()
                    if run_id != self._run_id and self._run_id is not None:
                        self._redis_suspect.set()
                    self._run_id = run_id or self._run_id
        if not self._redis_suspect.is_set():
            return
        with self._suspect_lock:
            if not self._redis_suspect.is_set():
                return
            self.correct_illegal_offsets()  # raises while Redis is away: checked next time
            self._redis_suspect.clear()

    def _server_run_id(self) -> str | None:
        """The topic Redis server's ``run_id`` (``None`` on a Cluster, or unknown)."""
        client = self.topics.client
        if isinstance(client, RedisCluster):
            return None
        try:
            return str(client.info("server").get("run_id")) or None
        except redis.RedisError:
            return None

    def persist_consumer_offset(self) -> None:
        """Write the offsets of every assigned queue out (the 5 s timer), ack retried ones."""
        try:
            self._check_queues_if_redis_changed()
        except Exception:
            log.warning("%s: checking the queues failed; not persisting", self.client_id)
            return
        self._flush_retry_acks()
        if self.rebalance is None:
            return
        mqs = [pq.mq for pq in self.rebalance.process_queues() if not self.is_retry_queue(pq.mq)]
        try:
            missed = self.offset_store.persist_all(mqs)
        except Exception:
            log.warning("%s: persisting offsets failed", self.client_id, exc_info=True)
            return
        by_epoch: dict[int, dict[MessageQueue, int]] = {}
        for mq, reset in missed.items():
            by_epoch.setdefault(reset.epoch, {})[mq] = reset.offset
        for epoch, offsets in sorted(by_epoch.items()):
            log.warning(
                "%s: missed the notice of offset reset %d (%d queue(s)); applying it now",
                self.client_id,
                epoch,
                len(offsets),
            )
            self.reset_offsets(offsets, epoch=epoch)

    # -- rebalance hooks -----------------------------------------------------------------

    def queues_of(self, topic: str) -> list[MessageQueue]:
        """Every queue of ``topic`` (``%RETRY%<group>`` has one)."""
        if topic == self._retry_topic:
            return [MessageQueue(topic, 0)]
        return self.topics.message_queues(topic)

    def compute_pull_from_where(self, mq: MessageQueue) -> int:
        """The stored offset, or — a topic new to the group — last / first / timestamp.

        A queue without an offset in a group that has offsets of its topic (the topic
        got more queues, or one offset was lost) starts at its first message: what
        producers put there before the rebalance handed it out belongs to the group
        already (RocketMQ's broker answers 0 for a queue that still starts at 0). A
        topic the group never consumed follows ``consume_from_where`` on every one of
        its queues, decided once: the first queue assigned records the start of all of
        them in the store at once, so the group's other queues (here or on another
        instance) start there too, and a crash before the first timed persist cannot
        move a start to a later "last offset" and skip what arrived meanwhile
        (RocketMQ's client would).
        """
        if self.is_retry_queue(mq):
            return 0
        stored = self.offset_store.read_offset(mq, ReadOffsetType.READ_FROM_STORE)
        if stored >= 0:
            return stored
        if self.offset_store.has_offsets(mq.topic):
            # Recorded like a new topic's starts: an instance that started the topic since
            # this one read no offset above has recorded this queue's start, which wins.
            offset = self.offset_store.record_starts({mq: self.topics.min_offset(mq)})[mq]
            self.offset_store.update_offset(mq, offset, False)
            return offset
        queues = {q for q in self.queues_of(mq.topic) if not self.is_retry_queue(q)} | {mq}
        starts = {q: self._start_of(q) for q in sorted(queues)}
        try:
            offset = self.offset_store.record_starts(starts)[mq]
        except Exception:
            log.warning("%s: could not record the start of %s", self.client_id, mq, exc_info=True)
            offset = starts[mq]
        self.offset_store.update_offset(mq, offset, False)
        return offset

    def _start_of(self, mq: MessageQueue) -> int:
        """Where ``consume_from_where`` starts ``mq`` of a topic new to the group."""
        where = self.settings.consume_from_where
        if where is ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET:
            return 0
        if where is ConsumeFromWhere.CONSUME_FROM_TIMESTAMP:
            return self.topics.search_offset(mq, self._consume_timestamp_ms)
        return self.topics.max_offset(mq)

    def lock_queue(self, mq: MessageQueue, pq: ProcessQueue) -> bool:
        """Orderly clustering: a queue is taken only with its lock."""
        if self.orderly_service is None or self.is_retry_queue(mq):
            return True
        return self.orderly_service.lock_queue(mq, pq)

    def on_queue_added(self, mq: MessageQueue, pq: ProcessQueue) -> None:
        """``%RETRY%<group>`` is read through a Redis consumer group, not by offset: its new
        owner first takes over the deliveries a previous owner left unacknowledged, as a
        queue's new owner starts again from its committed offset."""
        pq.take_over_deliveries = self.is_retry_queue(mq)

    def remove_unnecessary_queue(self, mq: MessageQueue, pq: ProcessQueue) -> bool:
        """Persist and forget a queue taken away; orderly: release its lock."""
        if self.is_retry_queue(mq):
            self._flush_retry_acks()
            return True
        try:
            self.offset_store.persist(mq)
        except Exception:
            log.warning("%s: could not persist the offset of %s", self.client_id, mq, exc_info=True)
        self.offset_store.remove_offset(mq)
        if self.orderly_service is not None:
            return self.orderly_service.unlock_queue(mq, pq)
        return True

    # -- pulled messages -----------------------------------------------------------------

    def _on_pulled(
        self, mq: MessageQueue, pq: ProcessQueue, messages: Sequence[MessageExt]
    ) -> None:
        if self.orderly_service is not None:
            self.orderly_service.submit(messages, pq, mq)
        elif self.concurrently_service is not None:
            self.concurrently_service.submit(messages, pq, mq)

    def _on_filtered(self, mq: MessageQueue, pq: ProcessQueue, next_offset: int) -> None:
        # Past the filtered-out messages, never past one still in flight: cached, or
        # consumed and awaiting its ledger commit.
        first = pq.first_offset()
        offset = next_offset if first is None else min(first, next_offset)
        self.commit_offset(mq, pq, offset, increase_only=True)

    # -- reset offset (RESET_CONSUMER_CLIENT_OFFSET) -------------------------------------

    def _on_notice(self, data: str) -> None:
        if not data.startswith(RESET_NOTICE) or self.rebalance is None:
            return
        try:
            body = json.loads(data[len(RESET_NOTICE) :])
            epoch = int(body["epoch"]) if "epoch" in body else None  # older admins: none
            offsets = {MessageQueue.parse(k): int(v) for k, v in body.get("offsets", body).items()}
        except (ValueError, TypeError, AttributeError, KeyError):
            log.warning("ignoring a malformed reset notice: %r", data[:200])
            return
        self.reset_offsets(offsets, epoch=epoch)

    def reset_offsets(
        self, offsets: dict[MessageQueue, int], *, persist: bool = False, epoch: int | None = None
    ) -> None:
        """Drop the given queues here and restart them from ``offsets`` (``resetOffset``).

        ``persist``: also write the offsets to the store (the admin tool already did).
        ``epoch``: the operator reset these offsets come from; a queue is reset once per
        epoch, whether its notice or the next persist brought it (one reset at a time: the
        notice thread and the persist timer may both bring the same one).
        """
        assert self.rebalance is not None
        store = self.offset_store
        with self._reset_lock:
            if epoch is not None:
                offsets = {mq: o for mq, o in offsets.items() if store.reset_epoch(mq) < epoch}
            # Dropped first: a consume result of the old queue can no longer move the offset.
            for mq, pq in self.rebalance.drop(list(offsets)):
                pq.clear()
                if self.orderly_service is not None:
                    self.orderly_service.unlock_queue(mq, pq)
                log.warning("%s: offset of %s reset to %d", self.client_id, mq, offsets[mq])
            for mq, offset in offsets.items():
                if epoch is None:
                    store.update_offset(mq, offset, False)
                else:
                    store.apply_reset(mq, epoch, offset)
                if persist:
                    store.persist(mq)
        if self.rebalance_service is not None:
            self.rebalance_service.wakeup()

    def correct_illegal_offsets(self) -> dict[MessageQueue, int]:
        """``OFFSET_ILLEGAL``: a queue pulled from outside the broker's bounds starts again
        within them (``DefaultMessageStore.getMessage``): below the minimum, at the minimum.

        Beyond the maximum, or where the queue no longer holds the message last pulled
        from it, Redis lost data under this consumer (a restart from an older snapshot,
        a failover to a lagging replica, a flush): the queue's offsets were handed out
        again, to messages this consumer has not seen. It starts again where the
        restored offset store says (:meth:`_restart_point`), else at the queue's first
        message: delivering again (the dedup hook absorbs it) rather than skipping what
        producers sent since (RocketMQ's broker would answer the maximum). Runs on the
        persist timer and before the pull goes on after a failed pull.
        """
        illegal: dict[MessageQueue, int] = {}
        for pq in self.process_queues():
            if self.is_retry_queue(pq.mq) or pq.dropped:
                continue
            # Read before the bounds: a pull running meanwhile moves it only over messages
            # that exist, so it cannot pass a maximum read after it.
            offset, last = pq.next_offset, pq.last_pulled
            low, high = self.topics.min_offset(pq.mq), self.topics.max_offset(pq.mq)
            reason = f"pull offset {offset} is outside"
            if offset < low:
                illegal[pq.mq] = low
            elif offset > high:
                illegal[pq.mq] = self._restart_point(pq.mq, low, high)
            elif last is not None and last[0] >= low:
                found = self.topics.msg_id_at(pq.mq, last[0])
                if found is not None and found != last[1]:
                    illegal[pq.mq] = self._restart_point(pq.mq, low, high)
                    reason = f"holds {found} where {last[1]} was pulled (Redis lost data); within"
            if pq.mq in illegal:
                log.warning(
                    "%s: %s: %s [%d, %d]; resetting to %d",
                    self.client_id,
                    pq.mq,
                    reason,
                    low,
                    high,
                    illegal[pq.mq],
                )
        if illegal:
            self.reset_offsets(illegal, persist=True)
        return illegal

    def _restart_point(self, mq: MessageQueue, low: int, high: int) -> int:
        """Where a queue Redis rewound starts again: at the group's stored offset when the
        store went back with it (one Redis, restored together: the stored offset is at or
        before the rewind), else at the queue's first message."""
        mine = self.offset_store.read_offset(mq, ReadOffsetType.READ_FROM_MEMORY)
        try:
            stored = self.offset_store.read_offset(mq, ReadOffsetType.READ_FROM_STORE)
        except Exception:
            stored = -1
        return stored if low <= stored < mine and stored <= high else low

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> PushConsumer:
        """Join the group, take queues, and consume."""
        if self._started:
            return self
        if not self._filters:
            raise ConfigError("start: subscribe to at least one topic first")
        if self._concurrently is None and self._orderly is None:
            raise ConfigError("start: register a message listener first")
        s = self.settings
        clustering = not self.broadcasting
        # with a dedup layer, it counts what it completed; else every success is applied
        dedup = any(isinstance(m, DedupMiddleware) for m in self._middleware)
        self.stats.count_as(self.group, applied=not dedup)
        now = self.clock.now_ms()
        self._consume_timestamp_ms = s.consume_timestamp_ms or now - HALF_HOUR_MS
        if clustering and not self.orderly:
            self._filters.setdefault(self._retry_topic, TagFilter("*"))
        self.offset_store.load()
        if clustering:
            self._settle_dead_letters()
        if self.orderly:
            locks = (
                QueueLocks(self.client, self.group, self.client_id, ttl_ms=s.effective_lock_ttl_ms)
                if clustering
                else None
            )
            self.orderly_service = OrderlyService(self, locks)
        else:
            self.concurrently_service = ConcurrentlyService(self)
        self.membership = Membership(
            self.client,
            self.group,
            self.client_id,
            expire_ms=s.effective_heartbeat_expire_ms,
            clock=self.clock,
        )
        self.rebalance = RebalanceImpl(
            client_id=self.client_id, model=s.message_model, topics=list(self._filters), hooks=self
        )
        self.rebalance_service = RebalanceService(
            self.membership,
            self.rebalance,
            rebalance_interval_ms=s.rebalance_interval_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms,
            on_notice=self._on_notice,
            name=f"{self.client_id}-rebalance",
        )
        self.pull_service = PullService(
            client_id=self.client_id,
            topics=self.topics,
            rebalance=self.rebalance,
            settings=s,
            stats=self.stats,
            filters=self._filters,
            orderly=self.orderly,
            clustering=clustering,
            on_pulled=self._on_pulled,
            on_filtered=self._on_filtered,
            client=self.client,
            engine=self.engine,
            retry_topic=self._retry_topic,
            on_failure=self._redis_suspect.set,
            before_pull=self._check_queues_if_redis_changed,
        )
        self.scheduler.start()
        (self.orderly_service or self.concurrently_service).start()  # type: ignore[union-attr]
        self.rebalance_service.rebalance_now()
        self.rebalance_service.start()
        self.pull_service.start()
        self.scheduler.every(
            s.persist_consumer_offset_interval_ms,
            self.persist_consumer_offset,
            name="persist-offsets",
        )
        self.scheduler.every(
            s.persist_consumer_offset_interval_ms,
            self.correct_illegal_offsets,
            name="offset-illegal",
        )
        if self.orderly_service is not None and clustering:
            self.scheduler.every(s.lock_interval_ms, self._lock_all, name="lock-all")
        if self.run_schedule_service and self.engine is not None:
            self.schedule_service = self.engine.schedule_service(
                max_idle_ms=200, name=f"{self.client_id}-schedule"
            ).start()
        self._open_middleware()
        self._started = True
        log.info("%s: started (group %s, %s)", self.client_id, self.group, s.message_model)
        return self

    def _settle_dead_letters(self) -> None:
        """Before consuming: finish the dead-letterings a crashed instance of the group cut
        short, so a message it dead-lettered is not consumed again from the retry topic."""
        if self.engine is None:
            return
        try:
            self.engine.settle_dead_letters()
        except LedgerError:  # Delta away: the next start (or idem retry rebuild) settles them
            log.warning(
                "%s: could not settle the group's dead letters", self.client_id, exc_info=True
            )

    def _lock_all(self) -> None:
        if self.orderly_service is not None and self.rebalance is not None:
            queues = [(pq.mq, pq) for pq in self.rebalance.process_queues()]
            self.orderly_service.lock_all(queues)

    def process_queues(self) -> list[ProcessQueue]:
        """The queues this instance consumes now."""
        return self.rebalance.process_queues() if self.rebalance is not None else []

    def _stop_threads(self) -> None:
        if self.rebalance_service is not None:
            self.rebalance_service.stop()
        if self.pull_service is not None:
            self.pull_service.stop()
        if self.schedule_service is not None:
            self.schedule_service.stop()

    def shutdown(self) -> None:
        """Stop consuming, persist offsets, release locks, leave the group."""
        if not self._started:
            return
        self._started = False
        self._stop_threads()
        service = self.orderly_service or self.concurrently_service
        if service is not None:
            service.shutdown(self.settings.await_termination_ms)
        self._flush_middleware()
        self.persist_consumer_offset()
        assert self.rebalance is not None
        assert self.membership is not None
        for mq, pq in self.rebalance.drop_all():
            if self.orderly_service is not None:
                self.orderly_service.unlock_queue(mq, pq)
        try:
            self.membership.leave()
        except Exception:
            log.warning("%s: could not leave the group cleanly", self.client_id, exc_info=True)
        self.scheduler.stop()
        log.info("%s: shut down", self.client_id)

    def _flush_middleware(self) -> None:
        """Let layers that hold acknowledgements back (idem's group commit) finish them, so the
        offsets persisted next include them (waiting :data:`SHUTDOWN_FLUSH_MS` at least:
        ``await_termination_ms`` bounds the wait for running listeners, RocketMQ's default
        of 0 would persist before any pending commit)."""
        timeout_ms = max(self.settings.await_termination_ms, SHUTDOWN_FLUSH_MS)
        for layer in self._middleware:
            flush = getattr(layer, "flush", None)
            if flush is None:
                continue
            try:
                if not flush(timeout_ms):
                    log.warning(
                        "%s: %r did not finish its pending acknowledgements in time",
                        self.client_id,
                        layer,
                    )
            except Exception:
                log.warning("%s: flushing %r failed", self.client_id, layer, exc_info=True)
        self._close_middleware()

    def _open_middleware(self) -> None:
        """Tell the layers with threads of their own that this consumer uses them (one
        layer may serve several consumers: it stops when the last one does)."""
        for layer in self._middleware:
            open_ = getattr(layer, "open", None)
            if open_ is not None:
                open_()

    def _close_middleware(self) -> None:
        """Stop the layers' own threads (idem's lease renewal: a stopped or crashed
        instance's leases must run out)."""
        for layer in self._middleware:
            close = getattr(layer, "close", None)
            if close is not None:
                close()

    def kill(self) -> None:
        """Stop as a crash would: nothing persisted, no leave, no unlock.

        Threads cannot be killed: a listener already running finishes, but its
        results are not committed (every queue is marked dropped).
        """
        if not self._started:
            return
        self._started = False
        self._close_middleware()
        self.scheduler.stop()
        if self.rebalance_service is not None:
            self.rebalance_service.stop()
        if self.rebalance is not None:
            self.rebalance.drop_all()
        self._stop_threads()
        service = self.orderly_service or self.concurrently_service
        if service is not None:
            service.shutdown(0)


def _dead_lettering_undecodable(call: CallNext) -> CallNext:
    """``call`` for the messages that are messages; queue entries that are not (see
    :func:`~idem.retry.consumer.topics.undecodable_message`) skip the middleware and the
    listener and come back dead, with their reason: bad input goes to the DLQ, and the
    queue moves on past it."""

    def clean(messages: Sequence[MessageExt]) -> BatchResult:
        bad = {
            i: m.properties[UNDECODABLE]
            for i, m in enumerate(messages)
            if UNDECODABLE in m.properties
        }
        if not bad:
            return call(messages)
        good = [i for i in range(len(messages)) if i not in bad]
        inner = call([messages[i] for i in good]) if good else BatchResult(0)
        merged = BatchResult(len(messages), dead=bad, suspend_ms=inner.suspend_ms)
        for k, i in enumerate(good):
            if k in inner.failed:
                merged.failed[i] = inner.failed[k]
            if k in inner.dead:
                merged.dead[i] = inner.dead[k]
            if k in inner.pending:
                merged.pending[i] = inner.pending[k]
        return merged

    return clean
