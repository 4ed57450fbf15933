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

An operator's reset (:func:`idem.retry.consumer.admin.reset_offsets`) also marks
each queue it moves with a new epoch (``rmq:offset-reset:{<group>}``), and the
instances' persists are conditional on it: an instance that missed the reset's
notice (its pub/sub connection was down) is refused the write of its old offset
and handed the reset instead. RocketMQ's client would overwrite the reset then.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from enum import StrEnum
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple, Protocol

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


class MissedReset(NamedTuple):
    """An operator's reset of a queue that this instance has not applied."""

    epoch: int
    offset: int


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

    def persist_all(self, mqs: Iterable[MessageQueue]) -> dict[MessageQueue, MissedReset]:
        """Write the in-memory offsets of ``mqs`` out; returns the queues not written
        because an operator reset them and this instance has not applied that yet."""
        ...

    def reset_epoch(self, mq: MessageQueue) -> int:
        """The newest operator reset of ``mq`` this instance has applied (0: none)."""
        ...

    def apply_reset(self, mq: MessageQueue, epoch: int, offset: int) -> bool:
        """Move ``mq`` to ``offset`` as operator reset ``epoch`` says, with the epoch in one
        step (a persist sees both or neither); ``False`` when that reset (or a later
        one) was applied already."""
        ...

    def persist(self, mq: MessageQueue) -> None:
        """Write one queue's in-memory offset out."""
        ...

    def remove_offset(self, mq: MessageQueue) -> None:
        """Forget ``mq`` in memory (the queue was taken away)."""
        ...

    def has_offsets(self, topic: str) -> bool:
        """Whether the store holds an offset of any queue of ``topic`` (the group already
        consumes it)."""
        ...

    def record_starts(self, starts: Mapping[MessageQueue, int]) -> dict[MessageQueue, int]:
        """A topic new to the group: store where each of its queues starts, in one step,
        keeping any offset already stored (another instance started the topic first);
        returns the offsets the store holds now."""
        ...


class _MemoryTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.table: dict[MessageQueue, int] = {}
        self.reset_epochs: dict[MessageQueue, int] = {}
        """The newest operator reset applied here, per queue (absent: none)."""

    def reset_epoch(self, mq: MessageQueue) -> int:
        with self._lock:
            return self.reset_epochs.get(mq, 0)

    def apply_reset(self, mq: MessageQueue, epoch: int, offset: int) -> bool:
        with self._lock:
            if self.reset_epochs.get(mq, 0) >= epoch:
                return False
            self.reset_epochs[mq] = epoch
            self.table[mq] = offset
            return True

    def _loaded(self, mq: MessageQueue, offset: int, epoch: int) -> None:
        """The stored ``offset`` (``-1``: none) and newest reset ``epoch`` of ``mq``, read
        together: memory takes both in one step."""
        with self._lock:
            self.reset_epochs[mq] = max(epoch, self.reset_epochs.get(mq, 0))
            if offset >= 0:
                self.table[mq] = offset

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
            self.reset_epochs.pop(mq, None)

    def items(self, mqs: Iterable[MessageQueue] | None = None) -> dict[MessageQueue, int]:
        with self._lock:
            if mqs is None:
                return dict(self.table)
            return {mq: self.table[mq] for mq in mqs if mq in self.table}


def offsets_key(group: str) -> str:
    """The Redis hash of ``group``'s offsets."""
    return f"rmq:offset:{{{group}}}"


def reset_marks_key(group: str) -> str:
    """The Redis hash of ``group``'s operator resets: queue -> ``<epoch>:<offset>``."""
    return f"rmq:offset-reset:{{{group}}}"


def reset_epoch_key(group: str) -> str:
    """The counter of ``group``'s operator resets."""
    return f"rmq:offset-reset-epoch:{{{group}}}"


def offsets_script(client: RedisClient, name: str) -> Any:
    """Register ``retry/consumer/lua/<name>`` on ``client``."""
    source = resources.files("idem.retry.consumer") / "lua" / name
    return client.register_script(source.read_text(encoding="utf-8"))


def _topic_of(field: Any) -> str:
    """The topic of an offset field ``<topic>:<queue id>``."""
    text = field.decode() if isinstance(field, bytes) else str(field)
    return text.rpartition(":")[0]


def _epoch_of(mark: Any) -> int:
    """The epoch of a reset mark ``<epoch>:<offset>`` (0 when absent or damaged)."""
    if mark is None:
        return 0
    text = mark.decode() if isinstance(mark, bytes) else str(mark)
    head, _, _ = text.partition(":")
    return int(head) if head.isdigit() else 0


class RemoteOffsetStore(_MemoryTable):
    """Clustering: offsets in Redis, shared by the group (``RemoteBrokerOffsetStore``)."""

    def __init__(self, client: RedisClient, group: str) -> None:
        super().__init__()
        self.client = client
        self.group = group
        self.key = offsets_key(group)
        self.marks_key = reset_marks_key(group)
        self._persist = offsets_script(client, "persist_offsets.lua")

    def load(self) -> None:
        """Nothing to load: offsets are read per queue when it is assigned."""

    def read_offset(self, mq: MessageQueue, read_type: ReadOffsetType) -> int:
        """Memory, the store, or memory then the store; ``-1`` when unknown."""
        if read_type is not ReadOffsetType.READ_FROM_STORE:
            cached = self.get(mq)
            if cached is not None or read_type is ReadOffsetType.READ_FROM_MEMORY:
                return -1 if cached is None else cached
        # The offset and the queue's last reset together: a reset after this read is
        # one this instance has not applied.
        pipe = self.client.pipeline(transaction=True)
        pipe.hget(self.key, str(mq))
        pipe.hget(self.marks_key, str(mq))
        raw, mark = pipe.execute()
        offset = -1
        if raw is not None:
            try:
                offset = int(raw)
            except ValueError:
                log.warning("the stored offset of %s is %r, not a number; ignoring it", mq, raw)
        self._loaded(mq, offset, _epoch_of(mark))
        return offset

    def has_offsets(self, topic: str) -> bool:
        """Whether Redis holds an offset of any of the group's queues of ``topic``."""
        fields = self.client.hkeys(self.key)
        return any(_topic_of(field) == topic for field in fields)

    def record_starts(self, starts: Mapping[MessageQueue, int]) -> dict[MessageQueue, int]:
        """Every queue's start at once (``HSETNX``: the first instance's starts win)."""
        names = [str(mq) for mq in starts]
        pipe = self.client.pipeline(transaction=True)
        for name, offset in zip(names, starts.values(), strict=True):
            pipe.hsetnx(self.key, name, offset)
        pipe.hmget(self.key, names)
        stored = pipe.execute()[-1]
        out: dict[MessageQueue, int] = {}
        damaged: dict[str, int] = {}
        for (mq, start), raw in zip(starts.items(), stored, strict=True):
            try:
                out[mq] = int(raw)
            except (TypeError, ValueError):  # not a number (logged by read_offset): replaced
                out[mq] = damaged[str(mq)] = start
        if damaged:
            self.client.hset(self.key, mapping=damaged)  # type: ignore[arg-type]
        return out

    def persist_all(self, mqs: Iterable[MessageQueue]) -> dict[MessageQueue, MissedReset]:
        """Write every given queue's offset in one script call (RocketMQ's timer, every
        5 s), except those an operator reset since this instance last applied a reset
        of them: those are returned, with the reset."""
        with self._lock:
            args: list[str | int] = []
            for mq in mqs:
                offset = self.table.get(mq)
                if offset is not None:
                    args += [str(mq), offset, self.reset_epochs.get(mq, 0)]
        if not args:
            return {}
        reply = self._persist(keys=[self.key, self.marks_key], args=args, client=self.client)
        missed: dict[MessageQueue, MissedReset] = {}
        for name, mark in zip(reply[::2], reply[1::2], strict=True):
            text = mark.decode() if isinstance(mark, bytes) else str(mark)
            epoch, _, moved_to = text.partition(":")
            queue = MessageQueue.parse(name.decode() if isinstance(name, bytes) else name)
            missed[queue] = MissedReset(int(epoch), int(moved_to))
        return missed

    def persist(self, mq: MessageQueue) -> None:
        """Write one queue's offset (unless an operator reset it meanwhile)."""
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

    def has_offsets(self, topic: str) -> bool:
        """Whether the file (or its backup) holds an offset of any queue of ``topic``."""
        table = self._read(self.path) or self._read(self.backup) or {}
        return any(mq.topic == topic for mq in table)

    def record_starts(self, starts: Mapping[MessageQueue, int]) -> dict[MessageQueue, int]:
        """Every queue's start not in the file yet, written at once."""
        table = self._read(self.path) or self._read(self.backup) or {}
        for mq, offset in starts.items():
            self.update_offset(mq, table.get(mq, offset), False)
        self.persist_all(starts)
        return {mq: table.get(mq, offset) for mq, offset in starts.items()}

    def persist_all(self, mqs: Iterable[MessageQueue]) -> dict[MessageQueue, MissedReset]:
        """Rewrite the file with every known offset (the given queues' and the others');
        nothing is missed (an operator does not reset a broadcasting consumer's file)."""
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
        return {}

    def persist(self, mq: MessageQueue) -> None:
        """Rewrite the file."""
        self.persist_all([mq])
