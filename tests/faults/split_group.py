"""A consumer group whose topic and whose idem state live on two redis-servers.

The *broker* holds the topic and is never faulted (a broker that loses messages
loses them for everyone); the *store* holds idem's claims and index, the retry
engine (schedule queues, ``%RETRY%<group>``) and the consume offsets, and is the
one a fault test stops, kills or fills. While the store is away the consumers keep
pulling from the broker, so every message consumed then meets the outage.

Consumers run in this process (real :class:`~idem.retry.consumer.PushConsumer`
instances with the dedup hook), and write the scenarios' :class:`~harness.FileSink`;
a listener fails the first attempt of the keys in :attr:`SplitGroup.fail_first`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import redis
from checks import main_topic_messages
from harness import TOPIC, FileSink

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.redis_client import connect
from idem.retry import RetryEngine
from idem.retry.consumer import (
    ConsumerSettings,
    DedupMiddleware,
    DefaultMessageListenerConcurrently,
    Producer,
    PushConsumer,
    TopicStore,
    consumer_offsets,
    new_message,
)
from idem.retry.faults import FaultTolerance
from idem.retry.message import MessageExt


class SplitGroup:
    """One consumer group: topic on ``broker_url``, idem's state on ``store_url``.

    ``store_url`` is what the consumers dial (it may carry socket time-outs in its
    query); ``config`` names the group, its data directory and its timings.
    """

    def __init__(
        self,
        config: IdemConfig,
        *,
        broker_url: str,
        store_url: str,
        settings: ConsumerSettings,
        base: Path,
        faults: FaultTolerance | None = None,
        queues: int = 4,
    ) -> None:
        self.config = config
        self.name = config.group
        self.store_url = store_url
        self.settings = settings
        self.faults = faults or FaultTolerance()
        self.broker = connect(broker_url)
        self.topics = TopicStore(self.broker)
        self.topics.create_topic(TOPIC, queues)
        self.producer = Producer(f"{self.name}-producer", client=self.broker)
        self.sink = FileSink(base / f"sink-{self.name}.jsonl")
        self.fail_first: set[str] = set()
        self.consumers: list[PushConsumer] = []
        self.engines: list[RetryEngine] = []
        self._broker_url = broker_url

    def consumer(self, name: str | None = None) -> PushConsumer:
        """Start one more consumer instance with the dedup hook."""
        name = name or f"c{len(self.consumers)}-{uuid.uuid4().hex[:4]}"
        engine = RetryEngine(self.config, client=connect(self.store_url), faults=self.faults)
        consumer = PushConsumer(
            self.config,
            settings=self.settings,
            client=connect(self._broker_url),
            engine=engine,
            offset_client=connect(self.store_url),
            instance_name=name,
        )
        consumer.subscribe(TOPIC)
        dedup = Dedup(self.config, client=connect(self.store_url))
        consumer.use(DedupMiddleware(dedup, owner=name))
        consumer.register_message_listener_concurrently(
            DefaultMessageListenerConcurrently(self._handler(name))
        )
        self.consumers.append(consumer)
        self.engines.append(engine)
        consumer.start()
        return consumer

    def _handler(self, name: str) -> Callable[[MessageExt], None]:
        def handle(message: MessageExt) -> None:
            if message.keys in self.fail_first and message.reconsume_times == 0:
                raise RuntimeError(f"{message.keys}: the sink refuses its first attempt")
            self.sink.write(message, name)

        return handle

    def produce(self, keys: Sequence[str]) -> list[str]:
        """Send one message per key."""
        self.producer.send_batch([new_message(TOPIC, k.encode(), keys=k) for k in keys])
        return list(keys)

    def messages(self) -> list[MessageExt]:
        """Every message of the topic, read from the broker."""
        return main_topic_messages(self.broker)

    def settled(self, keys: Iterable[str], store: redis.Redis) -> bool:
        """Every key written, every queue's offset persisted to its end, no retry live."""
        try:
            if not self.sink.has_all(keys):
                return False
            stored = consumer_offsets(store, self.name)
            if any(
                stored.get(mq, -1) < self.topics.max_offset(mq)
                for mq in self.topics.message_queues(TOPIC)
            ):
                return False
            return self.engines[0].pending() == 0
        except redis.RedisError:  # the store is still coming back
            return False

    def close(self) -> None:
        """Shut every consumer down, then close their retry engines."""
        for consumer in self.consumers:
            consumer.shutdown()
        for engine in self.engines:
            engine.close()
        self.producer.shutdown()
        self.broker.close()
