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

from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

hiredis: Any
try:
    import hiredis
except ImportError:  # pragma: no cover - hiredis is an optional extra
    hiredis = None

ScriptCall = tuple[str, list[str], list[Any]]
"""One script call: the hash tag it routes by, its KEYS and its ARGV."""


def pack_script_call(connection: Any, sha: str, keys: Sequence[str], args: Sequence[object]) -> Any:
    """EVALSHA ``sha`` with ``keys`` and ``args`` in the Redis protocol, for ``connection``.

    With hiredis and the default UTF-8 encoding this calls hiredis's packer directly:
    redis-py's own wrapper first walks every argument in Python (to turn bytearrays
    into bytes), which costs as much as the packing itself for a call of thousands
    of keys. The bytes are the same.
    """
    encoder = connection.encoder
    if (
        hiredis is not None
        and encoder.encoding.lower().replace("-", "").replace("_", "") == "utf8"
        and encoder.encoding_errors == "strict"
    ):
        try:
            command: Any = ("EVALSHA", sha, len(keys), *keys, *args)
            return [hiredis.pack_command(command)]
        except TypeError:
            pass  # e.g. a bytearray argument: redis-py converts it (or names the bad type)
    return connection.pack_command("EVALSHA", sha, len(keys), *keys, *args)


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
            packed = pack_script_call(self._connection, script.sha, keys, args)
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


class ScriptCalls:
    """Calls of one script, streamed to a single server as they are added
    (:class:`StreamedCalls`); on a Cluster, and for whatever could not stream, sent
    through ``pipelined`` (one routed round trip) when the replies are read."""

    def __init__(
        self,
        client: Any,
        script: Script,
        pipelined: Callable[[list[ScriptCall]], list[Any]],
        *,
        stream: bool,
    ) -> None:
        self._script = script
        self._pipelined = pipelined
        self._calls: list[ScriptCall] = []
        self._stream = StreamedCalls(client) if stream else None

    def add(self, tag: str, keys: list[str], args: list[Any]) -> None:
        """One call (routed by ``tag``): sent now on a single server."""
        self._calls.append((tag, keys, args))
        if self._stream is not None:
            self._stream.call(self._script, keys, args)

    def abandon(self) -> None:
        """Read and drop the replies of what was sent (nothing is sent again)."""
        if self._stream is not None:
            self._stream.replies()

    def replies(self) -> list[Any]:
        """The replies in call order; a failed call's error (a :class:`redis.RedisError`)
        in its place. Raises what ``pipelined`` raises."""
        if not self._calls:
            return []
        replies = self._stream.replies() if self._stream is not None else None
        if replies is None:  # a Cluster, or a connection error: it is unknown what ran
            return self._pipelined(self._calls)
        again = [i for i, reply in enumerate(replies) if not_run(reply)]
        if again:
            rerun = self._pipelined([self._calls[i] for i in again])
            for i, reply in zip(again, rerun, strict=True):
                replies[i] = reply
        return replies
