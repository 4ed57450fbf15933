"""Connecting to Redis, and the start-up check that it will not evict idem's keys."""

from __future__ import annotations

import logging

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from idem.errors import StoreUnavailable, UnsafeRedisConfig

log = logging.getLogger(__name__)


def connect(url: str) -> redis.Redis:
    """A redis-py client for a ``redis://``, ``rediss://`` or ``unix://`` URL (ACL user in it).

    It gives up after 3 quick reconnect attempts, a 5 s connect and a 30 s read
    timeout, so an unreachable Redis surfaces as an error instead of a hang.
    """
    return redis.Redis.from_url(
        url,
        socket_timeout=30.0,
        socket_connect_timeout=5.0,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), 3),
        health_check_interval=30,
    )


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def check_eviction_policy(client: redis.Redis) -> None:
    """Refuse a Redis that may evict keys: ``maxmemory-policy`` must be ``noeviction``.

    An evicted COMPLETED key would let a duplicate through unnoticed, an evicted
    schedule entry would lose a retry. When ``CONFIG`` is not allowed (ACL,
    managed Redis) the policy cannot be read: a warning is logged and the check
    passes.
    """
    try:
        reply = client.config_get("maxmemory-policy")
    except redis.ResponseError as exc:
        log.warning(
            "idem could not read Redis maxmemory-policy (%s); make sure it is "
            "'noeviction', or evicted keys will let duplicates through",
            exc,
        )
        return
    except redis.RedisError as exc:
        raise StoreUnavailable(f"Redis CONFIG GET maxmemory-policy failed: {exc}") from exc
    raw = next((v for k, v in reply.items() if k and _text(k) == "maxmemory-policy"), None)
    policy = None if raw is None else _text(raw)
    if policy is None:
        log.warning("Redis did not report maxmemory-policy; make sure it is 'noeviction'")
        return
    if policy != "noeviction":
        raise UnsafeRedisConfig(
            f"Redis maxmemory-policy is {policy!r}: under memory pressure Redis would "
            "evict idem's keys silently, and an evicted COMPLETED key lets a duplicate "
            "through. Set it to 'noeviction' (redis.conf: 'maxmemory-policy noeviction', "
            "or CONFIG SET maxmemory-policy noeviction then CONFIG REWRITE; on a managed "
            "Redis, in its parameter group)"
        )
