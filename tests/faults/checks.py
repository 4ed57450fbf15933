"""What the fault tests read back: the ledger, the retry journal, acknowledged offsets.

Read straight from the Delta tables on disk and from Redis itself (never through a
fault proxy), so a check sees what a restarted consumer would see.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import redis
from deltalake import DeltaTable
from harness import TOPIC

from idem.config import IdemConfig
from idem.retry.consumer import MessageQueue, TopicStore, consumer_offsets
from idem.retry.message import MessageExt


def _table(path: str, columns: Sequence[str]) -> pa.Table | None:
    """Those columns of the Delta table at ``path`` (``None`` when it does not exist yet)."""
    if not (Path(path) / "_delta_log").is_dir():
        return None
    return DeltaTable(path).to_pyarrow_table(columns=list(columns))


def ledger_keys(config: IdemConfig) -> Counter[str]:
    """How many rows the group's ledger holds of each key."""
    table = _table(config.resolved_ledger_path, ["key"])
    return Counter() if table is None else Counter(table.column("key").to_pylist())


def ledger_owners(config: IdemConfig) -> dict[str, str]:
    """Which owner committed each key to the ledger (one row per key read)."""
    table = _table(config.resolved_ledger_path, ["key", "owner"])
    if table is None:
        return {}
    keys, owners = table.column("key").to_pylist(), table.column("owner").to_pylist()
    return dict(zip(keys, owners, strict=True))


_SENT_BACK = pa.array(["SCHEDULED", "DEAD"])


def sent_back_origins(config: IdemConfig) -> set[str]:
    """Original msg ids the retry journal holds a send-back (``SCHEDULED``) or a dead letter
    (``DEAD``) of."""
    table = _table(config.resolved_journal_path, ["event", "origin_msg_id"])
    if table is None:
        return set()
    table = table.filter(pc.is_in(table.column("event"), value_set=_SENT_BACK))
    return {v for v in table.column("origin_msg_id").to_pylist() if v is not None}


def main_topic_messages(client: redis.Redis) -> list[MessageExt]:
    """Every message of the main topic, every queue."""
    topics = TopicStore(client)
    return [m for mq in topics.message_queues(TOPIC) for m in topics.messages(mq)]


def acknowledged_but_not_durable(
    client: redis.Redis, config: IdemConfig, messages: Sequence[MessageExt]
) -> list[str]:
    """Messages behind a persisted offset whose key is not in the ledger and that were not
    sent back (journaled) or dead-lettered: acknowledged on an outcome nobody recorded.

    The offsets are read first: what the tables hold afterwards is at least what they
    held when the offsets were written.
    """
    offsets = consumer_offsets(client, config.group)
    acked = [
        m for m in messages if m.queue_offset < offsets.get(MessageQueue(m.topic, m.queue_id), 0)
    ]
    if not acked:
        return []
    done = set(ledger_keys(config))
    origins = sent_back_origins(config)
    return [
        f"{m.keys} (queue {m.queue_id}, offset {m.queue_offset}, msg {m.msg_id})"
        for m in acked
        if m.keys not in done and m.msg_id not in origins and m.origin_msg_id not in origins
    ]


class AckWatch:
    """Checks :func:`acknowledged_but_not_durable` every ``interval_s`` in a thread while
    faults are injected; :attr:`violations` holds what it found."""

    def __init__(
        self,
        client: redis.Redis,
        config: IdemConfig,
        messages: list[MessageExt],
        interval_s: float = 0.25,
    ) -> None:
        self.client = client
        self.config = config
        self.messages = messages
        self.interval_s = interval_s
        self.violations: list[str] = []
        self.checks = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ack-watch")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check_now()

    def check_now(self) -> None:
        """One check (also the last one, after the run)."""
        try:
            found = acknowledged_but_not_durable(self.client, self.config, list(self.messages))
        except Exception as exc:  # a table caught mid-commit: read again next time
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return
        self.checks += 1
        for item in found:
            if item not in self.violations:
                self.violations.append(item)

    def __enter__(self) -> AckWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
