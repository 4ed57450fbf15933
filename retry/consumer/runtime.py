"""What the consume services need from their push consumer (a Protocol, to avoid cycles)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from idem.clock import Clock
from idem.retry.consumer.listener import CallNext
from idem.retry.consumer.offset_store import OffsetStore
from idem.retry.consumer.process_queue import ProcessQueue
from idem.retry.consumer.scheduler import Scheduler
from idem.retry.consumer.settings import ConsumerSettings
from idem.retry.consumer.stats import ConsumerStats
from idem.retry.consumer.topics import MessageQueue
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt


class Runtime(Protocol):
    """The parts of a :class:`~idem.retry.consumer.PushConsumer` its services use."""

    client_id: str
    group: str
    settings: ConsumerSettings
    engine: RetryEngine | None
    offset_store: OffsetStore
    scheduler: Scheduler
    clock: Clock
    stats: ConsumerStats

    @property
    def consume_timeout_ms(self) -> int:
        """The consume timeout now (it may change at run time)."""
        ...

    @property
    def max_reconsume_times(self) -> int:
        """After this many reconsumes a message is dead-lettered."""
        ...

    @property
    def broadcasting(self) -> bool:
        """Whether failed messages are dropped instead of sent back."""
        ...

    def build_chain(self, mq: MessageQueue, *, orderly: bool) -> CallNext:
        """The middleware chain ending in the listener, for one call on ``mq``."""
        ...

    def process_queues(self) -> list[ProcessQueue]:
        """The queues the consumer holds now."""
        ...

    def is_retry_queue(self, mq: MessageQueue) -> bool:
        """Whether ``mq`` is ``%RETRY%<group>`` (acknowledged per message, not by offset)."""
        ...

    def ack_retried(self, messages: Sequence[MessageExt]) -> None:
        """Acknowledge consumed messages of the retry topic (flushed with the offsets)."""
        ...

    def commit_offset(
        self, mq: MessageQueue, pq: ProcessQueue, offset: int, *, increase_only: bool
    ) -> None:
        """Record a queue's new consume offset in memory (unless the queue was dropped)."""
        ...
