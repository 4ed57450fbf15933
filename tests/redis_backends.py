"""What a test that must hold on every real Redis deployment gets (see ``real_backend``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import redis


@dataclass(frozen=True)
class RealRedis:
    """A real Redis backend for a test: a flushed client, its URL, and more clients."""

    client: redis.Redis
    url: str
    new_client: Callable[[], redis.Redis]
