"""Adversarial payloads through a consumer with the dedup hook: every one dead-lettered
with its reason, nothing crashes, nothing is unpickled.

The group's business key is ``body.order_id``; the listener is a strict sink (a JSON
object, a text ``order_id``, a finite ``amount``, at most ``MAX_PROPERTIES``
properties). Thousands of hostile messages — random bytes, pickles whose unpickling
would create a sentinel file, a body of 4 MiB + 1, nesting deeper than the parser's
recursion limit, invalid UTF-8, NaN, huge property maps — are mixed with valid
orders. Every hostile message ends in ``%DLQ%<group>`` once, with a reason that
names what is wrong; every valid order reaches the sink once; the sentinel file is
never created; the consumer keeps consuming.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from harness import FileSink
from seeds import Seed
from waiting import FAST, eventually

from idem.config import IdemConfig, LedgerEngine
from idem.dedup import Dedup
from idem.delay_levels import DelayLevels
from idem.redis_server import RedisServer
from idem.retry.consumer import (
    BatchResult,
    ConsumeScope,
    DedupMiddleware,
    Producer,
    PushConsumer,
    TopicStore,
    mark_done,
    new_message,
)
from idem.retry.consumer.listener import CallNext
from idem.retry.dlq import DEAD_REASON_PROPERTY
from idem.retry.message import MessageExt
from idem.retry.status import ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus

pytestmark = pytest.mark.faults

PAYLOADS = int(os.environ.get("IDEM_ADVERSARIAL_PAYLOADS", "2000"))
"""Hostile messages per run: 2,000 in the default run; ``IDEM_ADVERSARIAL_PAYLOADS=10000``
runs the full count (every dead-letter commit adds to one DLQ table)."""
MAX_PROPERTIES = 64
"""The strict sink's limit on a message's properties."""
MAX_BODY = 4 * 1024 * 1024
"""RocketMQ's ``maxMessageSize``: a failed message larger than this cannot be sent back."""

EXPECTED = {
    "random-bytes": r"body\.order_id",
    "pickle": r"body\.order_id.*not JSON",
    "invalid-utf8": r"body\.order_id.*not JSON",
    "deep-nesting": r"body\.order_id.*(recursion|nest)",
    "nan-key": r"body\.order_id",
    "nan-amount": r"amount: nan is not a finite number",
    "huge-properties": rf"properties: \d+ entries, over the limit of {MAX_PROPERTIES}",
    "oversize": rf"body: {MAX_BODY + 1} bytes, over the limit of {MAX_BODY}",
}
"""What each kind's dead-letter reason must say."""


class _Sentinel:
    """Unpickling this creates the sentinel file (``open(path, "w")``)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _payloads(seed: Seed, n: int, sentinel: Path) -> list[tuple[str, bytes, dict[str, str]]]:
    """``n`` hostile messages (kind, body, properties), drawn from the seed."""
    rng = seed.rng
    head, tail = b'{"order_id": "BIG", "pad": "', b'"}'
    oversize = head + b"x" * (MAX_BODY + 1 - len(head) - len(tail)) + tail
    out: list[tuple[str, bytes, dict[str, str]]] = [("oversize", oversize, {})]
    kinds = ["random-bytes", "pickle", "invalid-utf8", "nan-key", "nan-amount"]
    for i in range(n - 1):
        if i % 500 == 0:
            depth = rng.randint(5_000, 200_000)
            body = b'{"order_id": ' + b"[" * depth + b"]" * depth + b"}"
            out.append(("deep-nesting", body, {}))
        elif i % 250 == 1:
            props = {f"p{j}": "v" * rng.randint(0, 64) for j in range(rng.randint(65, 5_000))}
            out.append(("huge-properties", json.dumps({"order_id": f"HP{i}"}).encode(), props))
        else:
            kind = rng.choice(kinds)
            if kind == "random-bytes":
                body = rng.randbytes(rng.randint(0, 600))
                try:  # random bytes that happen to be JSON holding a text order_id are an order
                    if isinstance(json.loads(body).get("order_id"), str):
                        continue
                except (ValueError, AttributeError):
                    pass
            elif kind == "pickle":
                body = pickle.dumps(_Sentinel(sentinel), protocol=rng.randint(0, 5))
            elif kind == "invalid-utf8":
                bad = bytes(rng.choice([0xFF, 0xFE, 0xC0, 0xC1, 0xF5]) for _ in range(4))
                body = b'{"order_id": "' + bad + b'"}'
            elif kind == "nan-key":
                body = rng.choice([b'{"order_id": NaN}', b'{"order_id": Infinity}'])
            else:
                body = json.dumps({"order_id": f"NAN{i}", "amount": math.nan}).encode()
            out.append((kind, body, {}))
    return out


def _problem(message: MessageExt) -> str | None:
    """What the strict sink refuses in ``message`` (the field and the limit), or ``None``."""
    if len(message.body) > MAX_BODY:
        return f"body: {len(message.body)} bytes, over the limit of {MAX_BODY}"
    order = json.loads(message.body)  # the dedup hook read its key: a JSON object
    amount = order.get("amount", 0)
    if not isinstance(amount, int | float) or not math.isfinite(amount):
        return f"amount: {amount} is not a finite number"
    own = {k for k in message.properties if k.isupper()}  # the broker's and idem's own
    if len(message.properties) - len(own) > MAX_PROPERTIES:
        count = len(message.properties) - len(own)
        return f"properties: {count} entries, over the limit of {MAX_PROPERTIES}"
    return None


class StrictSink:
    """The innermost layer: dead-letters what the sink refuses, with its reason, and
    writes the rest (the listener after it acknowledges them)."""

    def __init__(self, sink: FileSink) -> None:
        self.sink = sink

    def __call__(
        self, messages: Sequence[MessageExt], scope: ConsumeScope, call_next: CallNext
    ) -> BatchResult:
        result = BatchResult(len(messages))
        good: list[int] = []
        for i, message in enumerate(messages):
            problem = _problem(message)
            if problem is None:
                good.append(i)
            else:
                result.dead[i] = problem
        for i in good:
            self.sink.write(messages[i], "strict")
        if good:
            inner = call_next([messages[i] for i in good]).subset(good, len(messages))
            result.failed.update(inner.failed)
            result.dead.update(inner.dead)
            result.pending.update(inner.pending)
        return result


def _acknowledge(
    messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
) -> ConsumeConcurrentlyStatus:
    for message in messages:
        mark_done(message)
    return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


def test_adversarial_payloads_each_end_in_the_dlq_with_their_reason(
    redis_server: RedisServer, real_redis: redis.Redis, tmp_path: Path, seed: Seed
) -> None:
    sentinel = tmp_path / "unpickled-sentinel"
    config = IdemConfig(
        group=f"g-{uuid.uuid4().hex[:8]}",
        redis_url=redis_server.url,
        data_dir=str(tmp_path / "data"),
        delay_levels=DelayLevels.parse("1s 1s 1s"),
        max_reconsume_times=0,
        engine=LedgerEngine.DELTA_RS,
    )
    TopicStore(real_redis).create_topic("orders", 2)
    hostile = _payloads(seed, PAYLOADS, sentinel)
    valid = [f"OK{i:05d}" for i in range(max(10, PAYLOADS // 50))]
    messages: list[MessageExt] = []
    for i, (kind, body, props) in enumerate(hostile):
        messages.append(new_message("orders", body, keys=f"{kind}#{i}", properties=props))
    for key in valid:
        messages.append(
            new_message("orders", json.dumps({"order_id": key, "amount": 1}).encode(), keys=key)
        )
    seed.rng.shuffle(messages)
    producer = Producer("p", client=real_redis)
    started = time.monotonic()
    for start in range(0, len(messages), 500):
        producer.send_batch(messages[start : start + 500])
    sink = FileSink(tmp_path / "sink.jsonl")
    settings = FAST.with_changes(consume_message_batch_max_size=64, pull_batch_size=64)
    consumer = PushConsumer(config, settings=settings, client=redis_server.client())
    consumer.subscribe("orders")
    consumer.use(DedupMiddleware(Dedup(config, client=redis_server.client()), key="body.order_id"))
    consumer.use(StrictSink(sink))
    consumer.register_message_listener_concurrently(_acknowledge)
    consumer.start()
    engine = consumer.engine
    assert engine is not None
    try:
        eventually(
            lambda: engine.dlq.count() >= len(hostile) and sink.has_all(valid),
            timeout=600,
            interval=1.0,
            what=seed.tag("every hostile message dead-lettered, every order written"),
        )
        eventually(lambda: engine.pending() == 0, timeout=60, what=seed.tag("no retry left"))
        letters = engine.dlq.list()
    finally:
        consumer.shutdown()
    took = time.monotonic() - started
    assert not sentinel.exists(), seed.tag("a payload was unpickled")
    assert sink.counts() == Counter(valid), seed.tag("every valid order once, nothing else")
    by_key = Counter(letter.key for letter in letters)
    assert all(n == 1 for n in by_key.values()), seed.tag(
        f"dead-lettered twice: {[k for k, n in by_key.items() if n > 1][:5]}"
    )
    wanted = {f"{kind}#{i}": kind for i, (kind, _, _) in enumerate(hostile)}
    assert set(by_key) == set(wanted), seed.tag(
        f"missing from the DLQ: {sorted(set(wanted) - set(by_key))[:5]}"
    )
    wrong: list[str] = []
    for letter in letters:
        reason = f"{letter.properties.get(DEAD_REASON_PROPERTY, '')} | {letter.last_error or ''}"
        kind = wanted[letter.key or ""]
        if not re.search(EXPECTED[kind], reason, re.DOTALL):
            wrong.append(f"{letter.key}: {reason[:200]}")
    assert not wrong, seed.tag(f"{len(wrong)} dead letters without their reason, e.g. {wrong[:3]}")
    kinds = Counter(kind for kind, _, _ in hostile)
    by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
    print(
        f"{len(hostile)} hostile messages ({by_kind}) "
        f"and {len(valid)} orders: all dead-lettered with their reason in {took:.1f}s"
    )
