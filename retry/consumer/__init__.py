"""idem.retry.consumer: RocketMQ's push consumer on Redis, with idem's dedup as a middleware.

Topics with N queues on Redis streams (:class:`TopicStore`), a producer with
RocketMQ's send retries (:class:`Producer`), and the push consumer
(:class:`PushConsumer`): process queues, remote / local offset stores,
rebalance, consume timeout, orderly locks, send-back through the retry engine.
:class:`DedupMiddleware` (or :func:`exactly_once`) makes a listener run exactly
once per business key.
"""

from idem.retry.consumer.admin import (
    consumer_offsets,
    members,
    reset_offset_by_time,
    reset_offsets,
)
from idem.retry.consumer.errors import MQClientError, SendFailed
from idem.retry.consumer.group_commit import CommitItem, GroupCommitter
from idem.retry.consumer.listener import (
    BatchResult,
    ConsumeScope,
    DefaultMessageListenerConcurrently,
    Deferred,
    Failure,
    MessageListenerConcurrently,
    MessageListenerOrderly,
    Middleware,
    mark_done,
)
from idem.retry.consumer.middleware import (
    DedupMiddleware,
    DedupStats,
    DuplicateRecord,
    ExactlyOnceListener,
    exactly_once,
    key_getter,
    precedence,
)
from idem.retry.consumer.offset_store import (
    LocalFileOffsetStore,
    OffsetStore,
    ReadOffsetType,
    RemoteOffsetStore,
)
from idem.retry.consumer.orderly import QueueLocks
from idem.retry.consumer.process_queue import ProcessQueue
from idem.retry.consumer.producer import (
    MessageQueueSelector,
    Producer,
    SendResult,
    SendStatus,
    new_message,
    select_message_queue_by_hash,
)
from idem.retry.consumer.push_consumer import PushConsumer
from idem.retry.consumer.rebalance import Members, Membership, allocate_averagely
from idem.retry.consumer.settings import ConsumeFromWhere, ConsumerSettings
from idem.retry.consumer.stats import ConsumerStats
from idem.retry.consumer.topics import MessageQueue, PullResult, PullStatus, TopicStore

__all__ = [
    "BatchResult",
    "CommitItem",
    "ConsumeFromWhere",
    "ConsumeScope",
    "ConsumerSettings",
    "ConsumerStats",
    "DedupMiddleware",
    "DedupStats",
    "DefaultMessageListenerConcurrently",
    "Deferred",
    "DuplicateRecord",
    "ExactlyOnceListener",
    "Failure",
    "GroupCommitter",
    "LocalFileOffsetStore",
    "MQClientError",
    "Members",
    "Membership",
    "MessageListenerConcurrently",
    "MessageListenerOrderly",
    "MessageQueue",
    "MessageQueueSelector",
    "Middleware",
    "OffsetStore",
    "ProcessQueue",
    "Producer",
    "PullResult",
    "PullStatus",
    "PushConsumer",
    "QueueLocks",
    "ReadOffsetType",
    "RemoteOffsetStore",
    "SendFailed",
    "SendResult",
    "SendStatus",
    "TopicStore",
    "allocate_averagely",
    "consumer_offsets",
    "exactly_once",
    "key_getter",
    "mark_done",
    "members",
    "new_message",
    "precedence",
    "reset_offset_by_time",
    "reset_offsets",
    "select_message_queue_by_hash",
]
