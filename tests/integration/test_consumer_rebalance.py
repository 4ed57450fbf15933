"""Rebalance under load: three instances join and leave while 50,000 messages flow.

With idem's dedup hook the sink's durable state holds every key exactly once,
and — checked continuously while it runs — the group's committed offsets never
move past a message that has not finished (written to the sink, or handed to
the retry path).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from redis_backends import RealRedis
from waiting import FAST, eventually

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.retry import RetryEngine
from idem.retry.consumer import (
    DedupMiddleware,
    MessageQueue,
    Producer,
    PushConsumer,
    TopicStore,
    consumer_offsets,
    new_message,
)
from idem.retry.message import MessageExt
from idem.retry.status import ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus

pytestmark = pytest.mark.integration


TOTAL = 50_000
CHUNK = 2_000
QUEUES = 8


class BatchSink:
    """One append of a JSON line per message per consume call; then the keys count as done."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: set[str] = set()
        self.lock = threading.Lock()

    def __call__(
        self, messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        lines = "".join(json.dumps({"key": m.keys, "msg_id": m.msg_id}) + "\n" for m in messages)
        with self.lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
            self.done.update(m.keys or "" for m in messages)
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

    def counts(self) -> Counter[str]:
        with self.path.open(encoding="utf-8") as handle:
            return Counter(json.loads(line)["key"] for line in handle)


class OffsetWatch:
    """Polls the committed offsets; every message below one must be finished."""

    def __init__(
        self,
        client: redis.Redis,
        group: str,
        at: dict[MessageQueue, list[str]],
        finished: Callable[[str], bool],
    ) -> None:
        self.client, self.group, self.at, self.finished = client, group, at, finished
        self.verified: dict[MessageQueue, int] = {}
        self.violations: list[tuple[MessageQueue, int, int]] = []
        self.checks = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.checks += 1
            for mq, committed in consumer_offsets(self.client, self.group).items():
                keys = self.at.get(mq, [])
                for offset in range(self.verified.get(mq, 0), min(committed, len(keys))):
                    if not self.finished(keys[offset]):
                        self.violations.append((mq, offset, committed))
                self.verified[mq] = max(self.verified.get(mq, 0), committed)

    def __enter__(self) -> OffsetWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_three_consumers_join_and_leave_under_50k_messages(
    real_backend: RealRedis, tmp_path: Path
) -> None:
    real_redis = real_backend.client
    group = f"rb-{uuid.uuid4().hex[:8]}"
    config = IdemConfig(
        group=group, redis_url=real_backend.url, data_dir=str(tmp_path), delay_levels="1s 1s 1s"
    )
    TopicStore(real_redis).create_topic("orders", QUEUES)
    settings = replace(
        FAST,
        consume_message_batch_max_size=256,
        pull_batch_size=256,
        consume_thread_nums=16,
        heartbeat_expire_ms=800,
        persist_consumer_offset_interval_ms=200,
    )
    sink = BatchSink(tmp_path / "sink.jsonl")
    sent_back: set[str] = set()

    def on_stage(stage: str, messages: Sequence[MessageExt]) -> None:
        if stage == "journaled":
            sent_back.update(m.keys or "" for m in messages)

    middlewares: list[DedupMiddleware] = []

    def start(name: str) -> PushConsumer:
        client = real_backend.new_client()
        consumer = PushConsumer(
            config,
            settings=settings,
            client=client,
            instance_name=name,
            engine=RetryEngine(config, client=client, on_stage=on_stage),
        )
        consumer.subscribe("orders")
        mw = DedupMiddleware(Dedup(config, client=client))
        middlewares.append(mw)
        consumer.use(mw)
        consumer.register_message_listener_concurrently(sink)
        return consumer.start()

    producer = Producer("p", client=real_redis)
    at: dict[MessageQueue, list[str]] = {}
    wanted: list[str] = []

    def produce() -> None:
        for start_at in range(0, TOTAL, CHUNK):
            batch = [
                new_message("orders", b"{}", keys=f"K{i:06d}")
                for i in range(start_at, start_at + CHUNK)
            ]
            for result, message in zip(producer.send_batch(batch), batch, strict=True):
                keys = at.setdefault(result.message_queue, [])
                assert result.queue_offset == len(keys)
                keys.append(message.keys or "")
            wanted.extend(m.keys or "" for m in batch)
            time.sleep(0.1)

    began = time.monotonic()
    with OffsetWatch(real_redis, group, at, lambda k: k in sink.done or k in sent_back) as watch:
        flow = threading.Thread(target=produce)
        flow.start()
        c1 = start("c1")
        time.sleep(1.0)
        c2 = start("c2")
        time.sleep(1.0)
        c3 = start("c3")
        time.sleep(1.5)
        c1.shutdown()  # leaves cleanly
        time.sleep(1.5)
        c2.kill()  # crashes: unpersisted offsets, in-flight results lost
        flow.join()

        def left() -> dict[str, object]:
            """What is not done yet (empty when everything is)."""
            offsets = consumer_offsets(real_redis, group)
            behind = {str(mq): (offsets.get(mq, -1), len(keys)) for mq, keys in at.items()}
            out: dict[str, object] = {
                "keys not in the sink": TOTAL - len(sink.done),
                "queues behind (offset, end)": {q: v for q, v in behind.items() if v[0] < v[1]},
                "retries pending": -1 if c3.engine is None else c3.engine.pending(),
            }
            return {what: n for what, n in out.items() if n}

        try:
            try:
                eventually(lambda: not left(), timeout=60.0, interval=0.1)
            except AssertionError as exc:
                # A rare stall was seen once in CI: say which part never finished.
                raise AssertionError(f"{exc}; still left: {left()}") from None
        finally:
            c3.shutdown()
    elapsed = time.monotonic() - began

    counts = sink.counts()
    assert len(wanted) == TOTAL
    assert [k for k in wanted if counts[k] == 0] == []
    assert {k: n for k, n in counts.items() if n > 1} == {}
    assert watch.checks > 50
    assert watch.violations == [], watch.violations[:5]
    duplicates = Counter[str]()
    for mw in middlewares:
        duplicates.update(mw.stats.duplicates)
    print(
        f"\n50k with 3 instances joining/leaving: {elapsed:.1f}s, "
        f"duplicates absorbed: {dict(duplicates)}, offset checks: {watch.checks}"
    )
    assert sum(duplicates.values()) > 0, "the joins and the crash must have caused redeliveries"
