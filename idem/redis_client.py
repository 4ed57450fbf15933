"""Connecting to Redis, and the start-up check that it will not evict idem's keys."""

from __future__ import annotations

import functools
import inspect
import logging
import re
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.connection import Connection, ConnectionPool, parse_url
from redis.retry import Retry

from idem.errors import ConfigError, StoreUnavailable, UnsafeRedisConfig
from idem.redis_cluster import RedisClient, for_each_primary

log = logging.getLogger(__name__)


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""URL schemes that name a Redis Cluster (any node of it), and the scheme redis-py gets."""

URL_SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)
"""Every scheme :func:`connect` takes."""

PORT_RANGE = (1, 65535)
"""TCP ports a Redis URL may name (port 0 would silently mean redis-py's default, 6379)."""

_NUMBER = re.compile(r"-?[0-9]+")
_DIGITS = re.compile(r"[0-9]+")


def redis_url_problem(url: object) -> str | None:
    """What is wrong with ``url`` as a Redis URL for :func:`connect`, or ``None``.

    Checked before any connection: the scheme, the port (a number in
    :data:`PORT_RANGE`), the database in the path (a whole number; a Cluster has only 0),
    a ``unix://`` socket path, and the query arguments redis-py reads. The answer
    names the part and the limit, never the password.
    """
    if not isinstance(url, str):
        return f"expected a URL string, got {type(url).__name__}"
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in URL_SCHEMES:
        return (
            f"{redacted(url)!r} must start with redis://, rediss://, unix:// or (a Redis "
            "Cluster, by any node) redis+cluster://, rediss+cluster://"
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        return f"{redacted(url)!r} is not a valid URL ({exc})"
    if scheme != "unix" and _userinfo_spilled(parts):
        # whatever urllib took for the port or the database is part of the password
        return (
            "the user or password holds an unencoded '/', '?' or '#', which ends the "
            "host part early: percent-encode it (%2F, %3F, %23); the URL is not shown"
        )
    problem = _unix_problem(parts) if scheme == "unix" else _tcp_problem(parts)
    return problem or _options_problem(scheme, rest)


def _userinfo_spilled(parts: SplitResult) -> bool:
    """Whether the ``@`` that ends the user and password comes after urllib's host part.

    An unencoded ``/``, ``?`` or ``#`` in a password ends the host part there, so the
    rest of the password lands in the path, query or fragment, and its start reads as
    a port. A TCP URL's path is a database number and a fragment means nothing, so an
    ``@`` there always means this; in the query it does unless it sits in a value
    (``?password=a@b``, which redis-py takes).
    """
    if "@" in parts.netloc:
        return False
    if "@" in parts.path or "@" in parts.fragment:
        return True
    before, at, _ = parts.query.partition("@")
    return bool(at) and "=" not in before.rpartition("&")[2]


def _tcp_problem(parts: SplitResult) -> str | None:
    host_port = parts.netloc.rpartition("@")[2]
    if host_port.startswith("["):  # [IPv6]:port
        host_port = host_port.partition("]")[2]
    _, sep, port = host_port.partition(":")  # the split urllib makes
    if sep and port:
        if _NUMBER.fullmatch(port) is None:
            return f"port {port!r} is not a number"
        low, high = PORT_RANGE
        if port.startswith("-") or not low <= int(port) <= high:
            return f"port {int(port)} is out of range {low}-{high}"
    database = parts.path.strip("/")
    if database and _DIGITS.fullmatch(database) is None:
        return f"database {database!r} (the URL's path) is not a whole number, e.g. /0"
    return None


def _options_problem(scheme: str, rest: str) -> str | None:
    """What redis-py makes of the URL: its query arguments, a Cluster's database."""
    plain = f"{CLUSTER_SCHEMES.get(scheme, scheme)}://{rest}"
    try:
        options = parse_url(plain)  # type: ignore[no-untyped-call]
    except ValueError as exc:  # a query argument redis-py cannot read, e.g. ?db=x
        return str(exc).rstrip(".")
    if scheme in CLUSTER_SCHEMES and options.get("db", 0) != 0:
        return f"a Redis Cluster has only database 0, the URL names {options['db']}"
    return _query_problem(options, cluster=scheme in CLUSTER_SCHEMES)


def _query_problem(options: dict[str, Any], *, cluster: bool) -> str | None:
    """A query argument no connection takes (redis-py passes it on: a ``TypeError`` at the
    first command), or a negative time-out (a ``ValueError`` then)."""
    kind = options.get("connection_class", Connection)
    known = _init_parameters(kind) | _init_parameters(ConnectionPool) | {"connection_class"}
    if cluster:
        known |= _init_parameters(RedisCluster)
    unknown = sorted(set(options) - known)
    if unknown:
        return f"query argument {unknown[0]!r} is not a Redis connection option"
    for name in _NON_NEGATIVE:
        value = options.get(name)
        if isinstance(value, float) and not value >= 0:
            return f"query argument {name!r}: {value:g} must be >= 0 seconds"
    return None


_NON_NEGATIVE = ("socket_timeout", "socket_connect_timeout", "health_check_interval")


@functools.cache
def _init_parameters(kind: type) -> frozenset[str]:
    names: set[str] = set()
    for klass in kind.__mro__:  # SSLConnection passes **kwargs on to Connection
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= set(inspect.signature(init).parameters) - {"self", "args", "kwargs"}
    return frozenset(names)


def _unix_problem(parts: SplitResult) -> str | None:
    if not parts.path:
        return "a unix:// URL needs the socket's path, e.g. unix:///run/redis/redis.sock"
    return None


def connect(
    url: str, *, connect_timeout: float = 5.0, read_timeout: float = 30.0, retries: int = 3
) -> RedisClient:
    """A redis-py client for a ``redis://``, ``rediss://`` or ``unix://`` URL (ACL user in it).

    ``redis+cluster://host:port`` (or ``rediss+cluster://``) names a Redis Cluster by
    any of its nodes: the client reads the slot map and follows redirects. It gives
    up after ``retries`` quick reconnect attempts, a 5 s connect and a 30 s read
    timeout (by default), so an unreachable Redis surfaces as an error instead of a
    hang (a Cluster client reads the slot map at once, so an unreachable Cluster
    raises here). A malformed URL is a :class:`ConfigError` saying what is wrong.
    """
    problem = redis_url_problem(url)
    if problem is not None:
        raise ConfigError(f"redis_url: {problem}")
    scheme, sep, rest = url.partition("://")
    if sep and scheme in CLUSTER_SCHEMES:
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


_QUERY_PASSWORD = re.compile(r"(^|&)(\w*password=)[^&]*", re.IGNORECASE)
"""A query argument carrying a secret: ``password=``, ``ssl_password=`` (a key file's)."""


def redacted(url: str) -> str:
    """``url`` with its password replaced by ``***``, for logs and error messages: the
    one after the user, or redis-py's ``?password=`` query argument."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL urllib can split: hide whatever precedes an '@'
        return _hide_before_at(url)
    if _userinfo_spilled(parts):  # urllib sees no password, but one is there
        return _hide_before_at(url)
    query = _QUERY_PASSWORD.sub(r"\1\2***", parts.query)
    netloc = parts.netloc
    if password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _hide_before_at(url: str) -> str:
    """``url`` with everything between its scheme and its last ``@`` hidden."""
    scheme, sep, rest = url.rpartition("://")
    _, at, host = rest.rpartition("@")
    return f"{scheme}{sep}***@{host}" if at else url
