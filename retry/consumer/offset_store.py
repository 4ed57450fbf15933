"""Consume offsets: remote (Redis) for clustering, a local file for broadcasting.

Both follow RocketMQ's ``OffsetStore``: ``update_offset`` changes the client's
memory only; ``persist_all`` — run by the consumer every
``persist_consumer_offset_interval_ms`` (default 5 s) and at shutdown — writes
it out. A crash loses the progress since the last persist and the messages
after it are delivered again (case C3); a store that loses its last writes
(C4), fails over to a lagging copy (C5) or is damaged (C9) does the same.

The remote store is one hash per group, ``rmq:offset:{<group>}``, field
``<topic>:<queue id>`` -> offset; it may live on its own Redis (``client=``),
as RocketMQ's offsets live in the broker's ``consumerOffset.json``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol, cast

from idem.redis_cluster import RedisClient
from idem.retry.consumer.topics import MessageQueue

log = logging.getLogger(__name__)

DEFAULT_PERSIST_INTERVAL_MS = 5000
"""``persistConsumerOffsetInterval``."""


class ReadOffsetType(StrEnum):
    """Where ``read_offset`` looks."""

    READ_FROM_MEMORY = "READ_FROM_MEMORY"
    READ_FROM_STORE = "READ_FROM_STORE"
    MEMORY_FIRST_THEN_STORE = "MEMORY_FIRST_THEN_STORE"


class OffsetStore(Protocol):
    """What a consumer needs from an offset store."""

    def load(self) -> None:
        """Read persisted offsets at start (the local file store)."""
        ...

    def update_offset(self, mq: MessageQueue, offset: int, increase_only: bool) -> None:
        """Change the in-memory offset of ``mq``."""
        ...

    def read_offset(self, mq: MessageQueue, read_type: ReadOffsetType) -> int:
        """The offset of ``mq``; ``-1`` when there is none."""
        ...

    def persist_all(self, mqs: Iterable[MessageQueue]) -> None:
        """Write the in-memory offsets of ``mqs`` out."""
        ...

    def persist(self, mq: MessageQueue) -> None:
        """Write one queue's in-memory offset out."""
        ...

    def remove_offset(self, mq: MessageQueue) -> None:
        """Forget ``mq`` in memory (the queue was taken away)."""
        ...

    def has_offsets(self) -> bool:
        """Whether the store holds an offset of any queue (the group is not new)."""
        ...


class _MemoryTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.table: dict[MessageQueue, int] = {}

    def update_offset(self, mq: MessageQueue, offset: int, increase_only: bool) -> None:
        with self._lock:
            current = self.table.get(mq)
            if current is None or not increase_only or offset > current:
                self.table[mq] = offset

    def get(self, mq: MessageQueue) -> int | None:
        with self._lock:
            return self.table.get(mq)

    def remove_offset(self, mq: MessageQueue) -> None:
        with self._lock:
            self.table.pop(mq, None)

    def items(self, mqs: Iterable[MessageQueue] | None = None) -> dict[MessageQueue, int]:
        with self._lock:
            if mqs is None:
                return dict(self.table)
            return {mq: self.table[mq] for mq in mqs if mq in self.table}


def offsets_key(group: str) -> str:
    """The Redis hash of ``group``'s offsets."""
    return f"rmq:offset:{{{group}}}"


class RemoteOffsetStore(_MemoryTable):
    """Clustering: offsets in Redis, shared by the group (``RemoteBrokerOffsetStore``)."""

    def __init__(self, client: RedisClient, group: str) -> None:
        super().__init__()
        self.client = client
        self.group = group
        self.key = offsets_key(group)

    def load(self) -> None:
        """Nothing to load: offsets are read per queue when it is assigned."""

    def read_offset(self, mq: MessageQueue, read_type: ReadOffsetType) -> int:
        """Memory, the store, or memory then the store; ``-1`` when unknown."""
        if read_type is not ReadOffsetType.READ_FROM_STORE:
            cached = self.get(mq)
            if cached is not None or read_type is ReadOffsetType.READ_FROM_MEMORY:
                return -1 if cached is None else cached
        raw = self.client.hget(self.key, str(mq))
        if raw is None:
            return -1
        try:
            offset = int(raw)
        except ValueError:
            log.warning("the stored offset of %s is %r, not a number; ignoring it", mq, raw)
            return -1
        self.update_offset(mq, offset, False)
        return offset

    def has_offsets(self) -> bool:
        """Whether Redis holds an offset of any of the group's queues."""
        return bool(self.client.hlen(self.key))

    def persist_all(self, mqs: Iterable[MessageQueue]) -> None:
        """One ``HSET`` of every given queue's offset (RocketMQ's timer, every 5 s)."""
        values = {str(mq): offset for mq, offset in self.items(mqs).items()}
        if values:
            self.client.hset(self.key, mapping=cast(Any, values))

    def persist(self, mq: MessageQueue) -> None:
        """Write one queue's offset."""
        self.persist_all([mq])

    def stored(self) -> dict[MessageQueue, int]:
        """Every offset the store holds for the group (tools, tests)."""
        raw: Mapping[Any, Any] = self.client.hgetall(self.key)
        return {
            MessageQueue.parse(k.decode() if isinstance(k, bytes) else k): int(v)
            for k, v in raw.items()
        }


class LocalFileOffsetStore(_MemoryTable):
    """Broadcasting: offsets in ``<dir>/<client id>/<group>/offsets.json``.

    Written atomically (temp file, fsync, rename) with the previous version kept
    as ``offsets.json.bak``. A damaged file falls back to the backup; when both
    are unreadable the offsets are gone and the consumer starts from its
    ``consume_from_where`` (case C9).
    """

    def __init__(self, directory: str | Path, client_id: str, group: str) -> None:
        super().__init__()
        self.path = Path(directory) / client_id / group / "offsets.json"
        self.backup = self.path.with_suffix(".json.bak")
        self._file_lock = threading.Lock()

    def _read(self, path: Path) -> dict[MessageQueue, int] | None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return {MessageQueue.parse(k): int(v) for k, v in data["offsetTable"].items()}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("offset file %s is damaged (%s); ignoring it", path, exc)
            return None

    def load(self) -> None:
        """Read the file (or its backup)."""
        table = self._read(self.path)
        if table is None:
            table = self._read(self.backup)
        for mq, offset in (table or {}).items():
            self.update_offset(mq, offset, False)

    def read_offset(self, mq: MessageQueue, read_type: ReadOffsetType) -> int:
        """Memory, the file, or memory then the file; ``-1`` when unknown."""
        if read_type is not ReadOffsetType.READ_FROM_STORE:
            cached = self.get(mq)
            if cached is not None or read_type is ReadOffsetType.READ_FROM_MEMORY:
                return -1 if cached is None else cached
        table = self._read(self.path)
        if table is None:
            table = self._read(self.backup) or {}
        offset = table.get(mq)
        if offset is None:
            return -1
        self.update_offset(mq, offset, False)
        return offset

    def has_offsets(self) -> bool:
        """Whether the file (or its backup) holds an offset of any queue."""
        return bool(self._read(self.path) or self._read(self.backup))

    def persist_all(self, mqs: Iterable[MessageQueue]) -> None:
        """Rewrite the file with every known offset (the given queues' and the others')."""
        del mqs  # the file holds the whole table, as RocketMQ's does
        table = self.items()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(
            {"offsetTable": {str(mq): o for mq, o in sorted(table.items())}}, indent=1
        )
        with self._file_lock:
            if self.path.exists():
                self.path.replace(self.backup)
            tmp = self.path.with_suffix(".json.tmp")
            with tmp.open("w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            tmp.replace(self.path)

    def persist(self, mq: MessageQueue) -> None:
        """Rewrite the file."""
        self.persist_all([mq])
