"""Operator tools of a consumer group: offsets, members, ``resetOffsetByTime``."""

from __future__ import annotations

import json
import time

from idem.redis_cluster import RedisClient
from idem.retry.consumer.offset_store import (
    RemoteOffsetStore,
    offsets_key,
    offsets_script,
    reset_epoch_key,
    reset_marks_key,
)
from idem.retry.consumer.push_consumer import RESET_NOTICE
from idem.retry.consumer.rebalance import Membership
from idem.retry.consumer.topics import MessageQueue, TopicStore


def consumer_offsets(client: RedisClient, group: str) -> dict[MessageQueue, int]:
    """The persisted offsets of ``group`` (clustering)."""
    return RemoteOffsetStore(client, group).stored()


def reset_offset_by_time(
    client: RedisClient,
    group: str,
    topic: str,
    timestamp_ms: int,
    *,
    offset_client: RedisClient | None = None,
) -> dict[MessageQueue, int]:
    """Move ``group``'s offsets of ``topic`` to the first message stored at ``timestamp_ms``.

    The new offsets are written to the store and pushed to the running
    instances, which drop those queues (in-flight results are not committed) and
    start them again from there (``RESET_CONSUMER_CLIENT_OFFSET``). Offsets moved
    backwards deliver messages again (redelivery case C8).
    """
    topics = TopicStore(client)
    offsets = {mq: topics.search_offset(mq, timestamp_ms) for mq in topics.message_queues(topic)}
    return reset_offsets(client, group, offsets, offset_client=offset_client)


def reset_offsets(
    client: RedisClient,
    group: str,
    offsets: dict[MessageQueue, int],
    *,
    offset_client: RedisClient | None = None,
) -> dict[MessageQueue, int]:
    """Set ``group``'s offsets of some queues and tell its running instances.

    Each queue is marked with the reset's epoch: an instance that misses the
    notice learns of the reset at its next offset persist instead of writing its
    old offset back (:mod:`~idem.retry.consumer.offset_store`).
    """
    if not offsets:
        return offsets
    store_client = offset_client or client
    script = offsets_script(store_client, "reset_offsets.lua")
    pairs = [part for mq, offset in offsets.items() for part in (str(mq), offset)]
    keys = [offsets_key(group), reset_marks_key(group), reset_epoch_key(group)]
    now_ms = time.time_ns() // 1_000_000
    epoch = int(script(keys=keys, args=[now_ms, *pairs], client=store_client))
    notice = json.dumps({"epoch": epoch, "offsets": {str(mq): o for mq, o in offsets.items()}})
    Membership(client, group, "admin", expire_ms=1).publish(RESET_NOTICE + notice)
    return offsets


def members(client: RedisClient, group: str) -> tuple[str, ...]:
    """The live instances of ``group`` (as of their last heartbeats)."""
    view = Membership(client, group, "admin", expire_ms=2**62)
    return view.look().client_ids
