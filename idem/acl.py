"""Redis ACL users per consumer group: one group's credentials reach only its own keys.

Every Redis key and pub/sub channel idem uses names its group inside a hash tag, so
one group's share of the keyspace is a short list of glob patterns:

==========================================  ==============================================
``idem:{<group>:*``                         dedup buckets: claims, completed keys, watermark
``idem:{<group>}:*``                        the Spark sink's batch records and totals
``rmq:{<group>}:*``                         schedule queues, ``%RETRY%<group>``, journal cursor
``rmq:lock:{<group>}:*``                    orderly queue locks, the group-commit lock
``rmq:cg:{<group>}:*``                      consumer-group membership (heartbeats, epoch)
``rmq:offset:{<group>}``                    consume offsets
``rmq:offset-reset:{<group>}``              operator resets of those offsets, and their
``rmq:offset-reset-epoch:{<group>}``        counter
==========================================  ==============================================

Channels: ``rmq:{<group>}:*`` (the schedule service's wake-up) and ``rmq:cg:{<group>}:*``
(rebalance notices). Group names are letters, digits, ``_ . -`` (``IdemConfig.group``),
so a group's patterns never match another group's names.

Topics (``rmq:topic:{<topic>}:*``) are shared: producers write them, every group
subscribed to a topic reads it. A group's user gets read-only access (``%R~``) to the
topics it consumes; a producer gets its own user (:func:`producer_user_line`) with
write access to the topics it sends to and no group keys.

The commands are those idem runs at run time (:data:`GROUP_COMMANDS`). Left out on
purpose: ``SCAN`` and ``KEYS`` (they list every group's key names whatever the key
patterns say) and ``CONFIG GET`` (it reveals ``masterauth`` and every other setting;
without it idem's start-up eviction check logs a warning instead). Maintenance that
needs more (``FLUSHALL``, changing the config) runs as the ``admin`` user.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from idem.errors import ConfigError

GROUP_COMMANDS: tuple[str, ...] = (
    "evalsha",
    "eval",
    "script|load",
    "script|exists",
    "get",
    "mget",
    "set",
    "del",
    "exists",
    "pexpire",
    "xadd",
    "xread",
    "xreadgroup",
    "xack",
    "xautoclaim",
    "xgroup",
    "xlen",
    "xpending",
    "xrange",
    "xrevrange",
    "xdel",
    "xinfo|groups",
    "xinfo|stream",
    "incr",
    "zadd",
    "zrange",
    "zrangebyscore",
    "zremrangebyscore",
    "zscore",
    "zpopmin",
    "zrem",
    "zcard",
    "hset",
    "hsetnx",
    "hget",
    "hmget",
    "hgetall",
    "hincrby",
    "hexists",
    "hdel",
    "hlen",
    "hkeys",
    "hscan",
    "publish",
    "subscribe",
    "unsubscribe",
    "multi",
    "exec",
    "discard",
    "info",
    "ping",
    "time",
    "cluster|slots",
    "cluster|shards",
    "command",
)
"""Commands a group's user may run: what idem's Lua scripts and redis-py calls send
(``TIME``: leases and the dedup window run on Redis's clock; ``INFO``: a push
consumer notices a restarted Redis by its ``run_id``; ``CLUSTER
SLOTS``/``SHARDS`` and ``COMMAND``: redis-py's cluster client reads the slot map)."""

PRODUCER_COMMANDS: tuple[str, ...] = (
    "hget",
    "hset",
    "xadd",
    "multi",
    "exec",
    "discard",
    "ping",
    "cluster|slots",
    "cluster|shards",
    "command",
)
"""Commands a producer's user may run: read a topic's queue count, create a topic,
append messages."""

_GROUP = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_USER = re.compile(r"[A-Za-z0-9_.\-]{1,200}")
_GLOB = re.compile(r"([*?\[\]\\])")


def _group(group: str) -> str:
    if not isinstance(group, str) or not _GROUP.fullmatch(group) or not group.strip("."):
        raise ConfigError(
            f"group: {group!r} must be 1..200 characters of letters, digits, '_', '.', '-'"
        )
    return group


def _topic(topic: str) -> str:
    """``topic`` with Redis's glob characters escaped, for a key pattern."""
    if (
        not isinstance(topic, str)
        or not topic
        or any(c in topic for c in "{}:")
        or any(c.isspace() or not c.isprintable() for c in topic)
    ):
        raise ConfigError(
            f"topic: {topic!r} must be non-empty, without '{{', '}}', ':' or white space "
            "(an ACL rule is one word)"
        )
    return _GLOB.sub(r"\\\1", topic)


def group_key_patterns(group: str) -> list[str]:
    """The key patterns of ``group``'s own keys (read and write)."""
    g = _group(group)
    return [
        f"idem:{{{g}:*",
        f"idem:{{{g}}}:*",
        f"rmq:{{{g}}}:*",
        f"rmq:lock:{{{g}}}:*",
        f"rmq:cg:{{{g}}}:*",
        f"rmq:offset:{{{g}}}",
        f"rmq:offset-reset:{{{g}}}",
        f"rmq:offset-reset-epoch:{{{g}}}",
    ]


def group_channel_patterns(group: str) -> list[str]:
    """The pub/sub channel patterns of ``group`` (schedule wake-ups, rebalance notices)."""
    g = _group(group)
    return [f"rmq:{{{g}}}:*", f"rmq:cg:{{{g}}}:*"]


def topic_key_patterns(topic: str) -> list[str]:
    """The key pattern of ``topic``'s metadata and queues (glob characters escaped)."""
    return [f"rmq:topic:{{{_topic(topic)}}}:*"]


def _password_rule(user: str, password: str | None, password_sha256: str | None) -> str:
    if password is not None and password_sha256 is not None:
        raise ConfigError("password: give password or password_sha256, not both")
    if password_sha256 is not None:
        if not re.fullmatch(r"[0-9a-f]{64}", password_sha256):
            raise ConfigError("password_sha256: must be 64 lower-case hex digits")
        return f"#{password_sha256}"
    if password is None:
        return f">CHANGE-ME-{user}-password"
    if not password or any(c.isspace() or not c.isprintable() for c in password):
        raise ConfigError(
            "password: must be non-empty printable text without white space "
            "(an ACL file rule is one word)"
        )
    return f">{password}"


def _user(user: str) -> str:
    if not isinstance(user, str) or not _USER.fullmatch(user):
        raise ConfigError(
            f"user: {user!r} must be 1..200 characters of letters, digits, '_', '.', '-'"
        )
    return user


def _line(
    user: str,
    password_rule: str,
    keys: Iterable[str],
    channels: Iterable[str],
    commands: Sequence[str],
) -> str:
    rules = [
        "user",
        user,
        "on",
        password_rule,
        "resetkeys",
        *keys,
        "resetchannels",
        *(f"&{c}" for c in channels),
        "-@all",
        *(f"+{c}" for c in commands),
    ]
    return " ".join(rules)


def acl_user_line(
    group: str,
    *,
    user: str | None = None,
    topics: Sequence[str] = (),
    write_topics: Sequence[str] = (),
    password: str | None = None,
    password_sha256: str | None = None,
) -> str:
    """The ACL file line (``user <name> on ...``) of a user for ``group``.

    ``user`` defaults to ``idem-<group>``; ``topics`` are the topics the group's push
    consumers subscribe to (read-only); ``write_topics`` those its own code also sends
    to with a :class:`~idem.retry.consumer.Producer` on the same credentials (read and
    write). Without ``password`` or ``password_sha256`` the line carries the placeholder
    ``>CHANGE-ME-<user>-password``: replace it before use. Feed the rules after the
    user name to ``ACL SETUSER`` to create the user at run time.
    """
    name = _user(user if user is not None else f"idem-{_group(group)}")
    keys = [f"~{p}" for p in group_key_patterns(group)]
    keys += [f"~{p}" for t in write_topics for p in topic_key_patterns(t)]
    keys += [f"%R~{p}" for t in topics if t not in write_topics for p in topic_key_patterns(t)]
    return _line(
        name,
        _password_rule(name, password, password_sha256),
        keys,
        group_channel_patterns(group),
        GROUP_COMMANDS,
    )


def producer_user_line(
    user: str,
    *,
    topics: Sequence[str],
    password: str | None = None,
    password_sha256: str | None = None,
) -> str:
    """The ACL file line of a producer's user: read and write on ``topics``, nothing else."""
    if not topics:
        raise ConfigError("topics: a producer's user needs at least one topic")
    name = _user(user)
    keys = [f"~{p}" for t in topics for p in topic_key_patterns(t)]
    return _line(name, _password_rule(name, password, password_sha256), keys, (), PRODUCER_COMMANDS)


def setuser_args(line: str) -> list[str]:
    """``ACL SETUSER`` arguments (name, then ``reset`` and the rules) of an ACL file line."""
    words = line.split()
    if len(words) < 2 or words[0] != "user":
        raise ConfigError(f"ACL line: {line[:40]!r}... does not start with 'user <name>'")
    return [words[1], "reset", *words[2:]]
