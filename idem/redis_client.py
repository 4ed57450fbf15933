"""Connecting to Redis, and the start-up check that it will not evict idem's keys."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from idem.errors import ConfigError, StoreUnavailable, UnsafeRedisConfig
from idem.redis_cluster import RedisClient, for_each_primary

log = logging.getLogger(__name__)


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""URL schemes that name a Redis Cluster (any node of it), and the scheme redis-py gets."""


def connect(
    url: str, *, connect_timeout: float = 5.0, read_timeout: float = 30.0, retries: int = 3
) -> RedisClient:
    """A redis-py client for a ``redis://``, ``rediss://`` or ``unix://`` URL (ACL user in it).

    ``redis+cluster://host:port`` (or ``rediss+cluster://``) names a Redis Cluster by
    any of its nodes: the client reads the slot map and follows redirects. It gives
    up after ``retries`` quick reconnect attempts, a 5 s connect and a 30 s read
    timeout (by default), so an unreachable Redis surfaces as an error instead of a
    hang (a Cluster client reads the slot map at once, so an unreachable Cluster
    raises here).
    """
    scheme, sep, rest = url.partition("://")
    if sep and scheme in CLUSTER_SCHEMES:
        if rest.partition("/")[2] not in ("", "0"):
            raise ConfigError(
                f"redis_url: a Redis Cluster has only database 0, the URL names {rest!r}"
            )
        return RedisCluster.from_url(
            f"{CLUSTER_SCHEMES[scheme]}://{rest}",
            socket_timeout=read_timeout,
            socket_connect_timeout=connect_timeout,
            retry=_retry(retries),
        )
    return redis.Redis.from_url(
        url,
        socket_timeout=read_timeout,
        socket_connect_timeout=connect_timeout,
        retry=_retry(retries),
        health_check_interval=30,
    )


def _retry(attempts: int) -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), attempts)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def check_eviction_policy(client: RedisClient) -> None:
    """Refuse a Redis that may evict keys: ``maxmemory-policy`` must be ``noeviction``.

    An evicted COMPLETED key would let a duplicate through unnoticed, an evicted
    schedule entry would lose a retry. On a Cluster every primary is checked. When
    ``CONFIG`` is not allowed (ACL, managed Redis) the policy cannot be read: a
    warning is logged and the check passes.
    """
    for_each_primary(client, _check_one)


def _check_one(client: redis.Redis) -> None:
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


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
