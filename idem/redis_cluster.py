"""Redis Cluster: one round trip per primary for commands of many hash tags.

Every idem key carries a hash tag, so everything one script touches is in one
slot, but one batch touches many buckets and so many slots. On a single server
that is one pipeline; redis-py's cluster pipeline refuses ``EVALSHA``, so on a
Cluster :class:`RoutedPipelines` keeps one plain pipeline per primary (the node
that owns each tag's slot) and sends them one after another. A node that
answers ``MOVED`` or drops the connection (a failover, a finished resharding)
gets the slot map refreshed and its commands sent again to the new owner; every
idem script is safe to run twice. A slot in the middle of a migration (``ASK``,
``TRYAGAIN``) is waited for, never followed (see :meth:`RoutedPipelines._execute_node`).

:class:`LocalCluster` starts a throw-away Cluster of real ``redis-server``
processes on loopback ports, for tests and for trying idem on a Cluster.
"""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import Callable
from typing import Any, TypeAlias

import redis
from redis.cluster import RedisCluster
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError

from idem.errors import StoreUnavailable
from idem.redis_server import RedisServer

RedisClient: TypeAlias = "redis.Redis | RedisCluster"
"""A client of one server or of a Cluster (see :func:`idem.redis_client.connect`)."""

CLUSTER_SLOTS = 16_384
BUS_PORT_OFFSET = 10_000
"""A Cluster node also listens on its port + 10000 (the cluster bus)."""
_ROUTING_ERRORS = (MovedError, AskError, TryAgainError, ClusterDownError)
_MIGRATING = (AskError, TryAgainError)
_ATTEMPTS = 3
MIGRATION_WAIT_S = 30.0
"""How long a command on a slot in the middle of a migration is retried before it fails."""


class _Lost(redis.ConnectionError):
    """The connection dropped before the reply came: send the command again (raised, it
    is the connection error it stands for)."""


_RESEND = (*_ROUTING_ERRORS, _Lost)


class RoutedPipelines:
    """Commands of many hash tags, sent as one pipeline per server that owns their slots.

    Call :meth:`pipe` with a command's hash tag and queue exactly one command on
    the pipeline it returns; :meth:`execute` returns the replies in the order the
    commands were queued. On a single server this is one plain pipeline.
    """

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        self._cluster: Any = client if isinstance(client, RedisCluster) else None
        self._single: Any = None if self._cluster else client.pipeline(transaction=False)
        self._pipes: dict[str, Any] = {}
        self._queued: list[tuple[str, int]] = []  # node name, index in its pipeline

    def pipe(self, tag: str) -> Any:
        """The pipeline for the server owning ``tag``'s slot (queue one command on it)."""
        if self._cluster is None:
            return self._single
        node = self._cluster.get_node_from_key(tag)
        pipe = self._pipes.get(node.name)
        if pipe is None:
            pipe = self._cluster.get_redis_connection(node).pipeline(transaction=False)
            self._pipes[node.name] = pipe
        self._queued.append((node.name, len(pipe.command_stack)))
        return pipe

    def execute(self) -> list[Any]:
        """Send everything; the replies in queue order. Raises what redis-py raises."""
        if self._cluster is None:
            replies: list[Any] = self._single.execute()
            return replies
        by_node = {name: self._execute_node(pipe) for name, pipe in self._pipes.items()}
        return [by_node[name][index] for name, index in self._queued]

    def _execute_node(self, pipe: Any) -> list[Any]:
        """One node's pipeline. A command the node no longer owns (``MOVED``) goes to the
        slot's owner in a refreshed slot map; ``CLUSTERDOWN`` and lost connections are sent
        again after a short wait, 3 times, then the error is raised (the claim fails as
        "Redis unavailable", and its caller retries later).

        ``ASK`` and ``TRYAGAIN`` mean the slot is being migrated: the command is sent again
        until the migration ends (up to ``MIGRATION_WAIT_S``), never followed to the
        importing node. Every idem script declares all the keys it touches, so the node
        refuses to run it while any of them is elsewhere (see ``idem/lua/_prelude.lua``).
        """
        commands = list(pipe.command_stack)
        scripts = set(pipe.scripts)
        try:
            replies: list[Any] = pipe.execute(raise_on_error=False)
        except (redis.ConnectionError, redis.TimeoutError, *_ROUTING_ERRORS) as exc:
            replies = [_Lost(str(exc))] * len(commands)
        deadline = time.monotonic() + MIGRATION_WAIT_S
        attempt = 0
        while True:
            stray = [i for i, r in enumerate(replies) if isinstance(r, _RESEND)]
            if not stray:
                break
            migrating = all(isinstance(replies[i], _MIGRATING) for i in stray)
            if attempt >= _ATTEMPTS and not (migrating and time.monotonic() < deadline):
                break
            time.sleep(min(0.05 * 2**attempt, 0.5))
            attempt += 1
            self._cluster.nodes_manager.initialize()  # the slot map may have changed
            for i in stray:
                replies[i] = self._resend(commands[i], scripts)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _resend(self, command: Any, scripts: set[Any]) -> Any:
        """Send one queued command again, to the owner of its first key's slot now.
        Returns the reply, or the error to retry on."""
        args, options = command
        node = self._cluster.get_node_from_key(_first_key(args))
        pipe = self._cluster.get_redis_connection(node).pipeline(transaction=False)
        pipe.scripts = set(scripts)
        pipe.execute_command(*args, **options)
        try:
            return pipe.execute(raise_on_error=False)[0]
        except (redis.ConnectionError, redis.TimeoutError, *_ROUTING_ERRORS) as exc:
            return exc if isinstance(exc, _ROUTING_ERRORS) else _Lost(str(exc))


def _first_key(args: tuple[Any, ...]) -> Any:
    """The first key of a queued command (``EVALSHA sha numkeys key ...`` or ``CMD key ...``)."""
    name = args[0].upper() if isinstance(args[0], str) else args[0].decode().upper()
    return args[3] if name in ("EVALSHA", "EVAL") else args[1]


def for_each_primary(client: RedisClient, fn: Callable[[redis.Redis], None]) -> None:
    """Run ``fn`` with a client of every primary (of the one server when not a Cluster)."""
    if isinstance(client, RedisCluster):
        cluster: Any = client
        for node in cluster.get_primaries():
            fn(cluster.get_redis_connection(node))
    else:
        fn(client)


class LocalCluster:
    """A Redis Cluster of ``primaries`` real ``redis-server`` processes on 127.0.0.1.

    No replicas: it protects nothing and is for tests and trying things out
    (``deploy/redis/cluster/`` has a 6-node cluster with replicas for that too).
    """

    def __init__(self, primaries: int = 3) -> None:
        if primaries < 1:
            raise ValueError(f"primaries: {primaries} must be at least 1")
        ports: list[int] = []
        while len(ports) < primaries:
            port = free_cluster_port()
            taken = {q + d for q in ports for d in (0, BUS_PORT_OFFSET)}
            if port not in taken and port + BUS_PORT_OFFSET not in taken:
                ports.append(port)
        self.nodes = [
            RedisServer(
                port=port,
                extra={
                    "cluster-enabled": "yes",
                    "cluster-config-file": "nodes.conf",
                    "cluster-node-timeout": "5000",
                },
            )
            for port in ports
        ]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:<port of the first node>`` (see ``connect``)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def client(self, **kwargs: Any) -> RedisCluster:
        """A new redis-py Cluster client."""
        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, **kwargs)

    def start(self, timeout: float = 30.0) -> LocalCluster:
        """Start the nodes, give each an equal range of slots, join them, wait until ok."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()  # never leave nodes of a half-made cluster running
            raise
        return self

    def _start(self, timeout: float) -> None:
        for node in self.nodes:
            node.start()
        share = CLUSTER_SLOTS // len(self.nodes)
        clients: list[Any] = [redis.Redis(host="127.0.0.1", port=n.port) for n in self.nodes]
        try:
            for i, client in enumerate(clients):
                last = CLUSTER_SLOTS - 1 if i == len(clients) - 1 else (i + 1) * share - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
            for node in self.nodes[1:]:
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            deadline = time.monotonic() + timeout
            while not all(_cluster_ok(c, len(clients)) for c in clients):
                if time.monotonic() > deadline:
                    raise StoreUnavailable(f"the local Redis Cluster was not ok in {timeout}s")
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()

    def stop(self) -> None:
        """Stop every node and remove its directory."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_cluster_port(attempts: int = 200) -> int:
    """A loopback port that is free, with its cluster bus port (+10000) free too."""
    for _ in range(attempts):
        port = random.randint(20_000, 65_535 - BUS_PORT_OFFSET)
        if _bindable(port) and _bindable(port + BUS_PORT_OFFSET):
            return port
    raise StoreUnavailable("no free pair of loopback ports for a Redis Cluster node")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_ok(client: Any, nodes: int) -> bool:
    with contextlib.suppress(redis.RedisError):
        info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
        known = int(fields.get("cluster_known_nodes", 0))
        return fields.get("cluster_state") == "ok" and known == nodes
    return False
