"""Script calls written to one Redis server as they are made; the replies read at the end.

redis-py's pipeline packs and sends every command at ``execute``: during a big
claim this process packs while Redis idles, then Redis runs the scripts while
this process waits. :class:`StreamedCalls` writes each call to the connection
at once, so Redis runs the first calls while this process prepares the next
(the claim validates and buckets the next slice of the batch meanwhile), and
reads every reply when asked.

Only for a single server (a Cluster routes per slot, see
:mod:`idem.redis_cluster`). What cannot stream falls back to the caller's
pipelined path: a call whose script the server does not know (``NOSCRIPT``:
it did not run) and, after a connection error, every call (each idem script
is safe to run twice, as with redis-py's own pipeline retry).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError


class StreamedCalls:
    """EVALSHA calls on one connection of ``client``'s pool, sent as they are added."""

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        self._connection: Any = None
        self._sent = 0
        self._broken = False

    def call(self, script: Script, keys: Sequence[str], args: Sequence[object]) -> None:
        """Send ``script`` with ``keys`` and ``args`` now (its reply is read by :meth:`replies`).

        After a connection error nothing more is sent; :meth:`replies` then says so.
        """
        if self._broken:
            return
        try:
            if self._connection is None:
                self._connection = self._pool.get_connection()
            packed = self._connection.pack_command("EVALSHA", script.sha, len(keys), *keys, *args)
            # A health check reads a reply: only before the first call, never with calls
            # in flight whose replies it would swallow.
            self._connection.send_packed_command(packed, check_health=self._sent == 0)
            self._sent += 1
        except (redis.ConnectionError, redis.TimeoutError):
            self._broken = True

    def replies(self) -> list[Any] | None:
        """The replies in call order (a failed call's error in its place, ``NOSCRIPT`` as
        :class:`~redis.exceptions.NoScriptError`); ``None`` after a connection error, when
        it is unknown which calls ran. Gives the connection back to the pool."""
        connection, self._connection = self._connection, None
        if connection is None:
            return None if self._broken else []
        try:
            if self._broken:
                connection.disconnect()
                return None
            replies: list[Any] = []
            for _ in range(self._sent):
                try:
                    replies.append(connection.read_response())
                except redis.ResponseError as exc:
                    replies.append(exc)
            return replies
        except redis.RedisError:  # lost, timed out or garbled: which calls ran is unknown
            connection.disconnect()
            return None
        finally:
            self._pool.release(connection)


def not_run(reply: Any) -> bool:
    """Whether a streamed call did not run because the server lacked its script."""
    return isinstance(reply, NoScriptError)
