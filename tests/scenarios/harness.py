"""Shared pieces of the redelivery scenarios C1-C9 (and the consumer integration tests).

Every scenario runs twice on a real redis-server: without dedup the sink must
*show* the duplicate (the case is really reproduced), with idem's dedup hook
every key must reach the sink exactly once, none lost, and the duplicate must
be counted with its cause.

The sink's durable state is a JSON-lines file, one line per message written,
flushed before the listener returns (so it survives a SIGKILL of the process);
the dedup hook completes a key only after that write.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.redis_client import connect
from idem.redis_server import RedisServer
from idem.retry.consumer import (
    ConsumeFromWhere,
    ConsumerSettings,
    DedupMiddleware,
    DefaultMessageListenerConcurrently,
    Middleware,
    Producer,
    PushConsumer,
    TopicStore,
    consumer_offsets,
    new_message,
)
from idem.retry.message import MessageExt

TOPIC = "orders"

FAST = ConsumerSettings(
    consume_from_where=ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET,
    persist_consumer_offset_interval_ms=300,
    rebalance_interval_ms=1000,
    heartbeat_interval_ms=200,
    heartbeat_expire_ms=1000,
    pull_block_ms=100,
    consume_thread_nums=4,
    lock_interval_ms=300,
)
"""RocketMQ's intervals, shortened so a scenario takes seconds."""


class FileSink:
    """A sink whose durable state is a file: one flushed JSON line per message written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self._lock = threading.Lock()

    def write(self, message: MessageExt, by: str = "") -> None:
        """Append ``message`` (its key, id, queue, offset, retry count, writer)."""
        line = (
            json.dumps(
                {
                    "key": message.keys,
                    "msg_id": message.msg_id,
                    "origin": message.origin_msg_id,
                    "topic": message.topic,
                    "queue_id": message.queue_id,
                    "offset": message.queue_offset,
                    "reconsume": message.reconsume_times,
                    "by": by,
                }
            )
            + "\n"
        )
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)

    def rows(self) -> list[dict[str, Any]]:
        """Every line written so far."""
        text = self.path.read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def counts(self) -> Counter[str]:
        """How many times each key was written."""
        return Counter(row["key"] for row in self.rows())

    def duplicates(self) -> dict[str, int]:
        """Keys written more than once."""
        return {k: n for k, n in self.counts().items() if n > 1}

    def rows_of(self, key: str) -> list[dict[str, Any]]:
        """The lines of one key."""
        return [row for row in self.rows() if row["key"] == key]

    def has_all(self, keys: Iterable[str]) -> bool:
        """Whether every key was written at least once."""
        counts = self.counts()
        return all(counts[k] >= 1 for k in keys)


@dataclass
class Group:
    """One consumer group on a redis-server: topic, producer, sink, consumers, dedup."""

    redis_url: str
    base: Path
    name: str
    dedup: bool
    queues: int = 4
    max_reconsume_times: int = 16
    lease_ms: int = 60_000
    consumers: list[PushConsumer] = field(default_factory=list)
    middlewares: list[DedupMiddleware] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.client = connect(self.redis_url)
        self.config = IdemConfig(
            group=self.name,
            redis_url=self.redis_url,
            data_dir=str(self.base / "data"),
            delay_levels="1s 1s 1s",
            max_reconsume_times=self.max_reconsume_times,
            lease_ms=self.lease_ms,
            consume_timeout_ms=60_000,
        )
        self.sink = FileSink(self.base / f"sink-{self.name}.jsonl")
        self.topics = TopicStore(self.client)
        self.topics.create_topic(TOPIC, self.queues)
        self.producer = Producer(f"{self.name}-producer", client=self.client)

    def produce(self, keys: Sequence[str], topic: str = TOPIC) -> list[str]:
        """Send one message per key (round robin over the queues)."""
        self.producer.send_batch([new_message(topic, k.encode(), keys=k) for k in keys])
        return list(keys)

    def writer(self, by: str) -> Callable[[MessageExt], None]:
        """A ``handle_message`` that writes to the sink."""
        return lambda message: self.sink.write(message, by)

    def consumer(
        self,
        name: str,
        *,
        listener: Any = None,
        settings: ConsumerSettings = FAST,
        orderly: bool = False,
        offset_client: redis.Redis | None = None,
        middleware: Sequence[Middleware] = (),
        dedup_group: str | None = None,
        start: bool = True,
    ) -> PushConsumer:
        """A consumer instance (with the dedup hook when this run uses dedup)."""
        consumer = PushConsumer(
            self.config,
            settings=settings,
            client=connect(self.redis_url),
            offset_client=offset_client,
            instance_name=name,
        )
        consumer.subscribe(TOPIC)
        for layer in middleware:
            consumer.use(layer)
        if self.dedup:
            config = (
                self.config if dedup_group is None else self.config.with_changes(group=dedup_group)
            )
            mw = DedupMiddleware(Dedup(config, client=connect(self.redis_url)))
            self.middlewares.append(mw)
            consumer.use(mw)
        if listener is None:
            listener = DefaultMessageListenerConcurrently(self.writer(name))
        if orderly:
            consumer.register_message_listener_orderly(listener)
        else:
            consumer.register_message_listener_concurrently(listener)
        self.consumers.append(consumer)
        if start:
            consumer.start()
        return consumer

    def duplicates_by_cause(self) -> Counter[str]:
        """Duplicates the dedup hooks counted, by cause."""
        total: Counter[str] = Counter()
        for mw in self.middlewares:
            total.update(mw.stats.duplicates)
        return total

    def retries_pending(self) -> int:
        """Messages scheduled or in ``%RETRY%<group>`` and not yet acknowledged."""
        engines = [c.engine for c in self.consumers if c.engine is not None]
        return engines[0].pending() if engines else 0

    def caught_up(self, offset_client: redis.Redis | None = None) -> bool:
        """The group's persisted offsets reached the end of every queue."""
        stored = consumer_offsets(offset_client or self.client, self.name)
        return all(
            stored.get(mq, -1) >= self.topics.max_offset(mq)
            for mq in self.topics.message_queues(TOPIC)
        )

    def settled(self, keys: Iterable[str], offset_client: redis.Redis | None = None) -> bool:
        """Every key written, every queue consumed to its end, no retry left in flight."""
        return (
            self.sink.has_all(keys)
            and self.caught_up(offset_client)
            and self.retries_pending() == 0
        )

    def assert_exactly_once(self, keys: Iterable[str]) -> None:
        """Every key in the sink's durable state exactly once, none lost, none extra."""
        assert_exactly_once(self.sink, keys)

    def close(self) -> None:
        """Shut every consumer down."""
        for consumer in self.consumers:
            consumer.shutdown()
        self.producer.shutdown()
        self.client.close()


def assert_exactly_once(sink: FileSink, keys: Iterable[str]) -> None:
    """Every key in ``sink``'s durable state exactly once, none lost, none extra."""
    counts = sink.counts()
    wanted = list(keys)
    missing = [k for k in wanted if counts[k] == 0]
    doubled = {k: n for k, n in counts.items() if n > 1}
    extra = set(counts) - set(wanted)
    assert not missing, f"lost: {missing[:10]}"
    assert not doubled, f"written more than once: {dict(list(doubled.items())[:10])}"
    assert not extra, f"unexpected keys: {sorted(extra)[:10]}"


def offset_client(server: RedisServer) -> redis.Redis:
    """A client to a separate offset store that fails fast when the store is down."""
    return server.client(retry=Retry(NoBackoff(), 0), socket_connect_timeout=0.5, socket_timeout=2)


def keys(prefix: str, n: int) -> list[str]:
    """``n`` business keys."""
    return [f"{prefix}{i:04d}" for i in range(n)]
