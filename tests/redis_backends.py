"""What a test that must hold on every real Redis deployment gets (see ``real_backend``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis

from idem.redis_server import RedisServer


@dataclass(frozen=True)
class RealRedis:
    """A real Redis backend for a test: a flushed client, its URL, and more clients."""

    client: redis.Redis
    url: str
    new_client: Callable[[], redis.Redis]


def flushed_client(server: RedisServer) -> Iterator[redis.Redis]:
    """A client of ``server``, everything flushed first, closed afterwards (for fixtures)."""
    client = server.client()
    client.flushall()
    yield client
    client.close()
