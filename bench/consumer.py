"""Benchmark of the push consumer: throughput with and without the dedup hook, and
consume-timeout detection lateness beside RocketMQ's scan model.

    python bench/consumer.py                  # defaults below
    python bench/consumer.py --messages 100000 --batch 256 --batch 32   # shorter, noisier

1. Throughput: a group of 2 instances (2 processes) consumes pre-produced
   messages from 8 queues on a private redis-server; the sink appends one JSON
   line per message to a file per consume call. Measured from the moment a
   warm-up share was consumed until every message was; once without and once with
   idem's dedup hook (group claims in Redis, group-committed Delta ledger; a
   message counts once its ledger commit is durable). Printed as messages/second
   and the ratio (target >= 0.7), with the CPU the two instances and
   redis-server spent per message meanwhile (Linux). The default 300k messages
   keep a run long enough for a stable ratio: with 50k, a handful of ledger
   commits decide it (ratios of 0.35-0.73 from one build). ``--commit-interval-ms`` and
   ``--no-commit-lock`` tune the group commit; ``IDEM_BENCH_SAMPLE=1`` writes
   per-step timings, CPU per thread, time in the cyclic GC and stack samples of
   each worker next to its sink file,
   ``IDEM_BENCH_PROFILE=<prefix>`` a cProfile of every thread of instance 0.
2. Consume timeout: stuck messages arrive at random moments; how late after its
   deadline the watchdog found each one (p50 / p99 / max), beside RocketMQ's
   scan model: ``cleanExpiredMsg`` runs every ``consumeTimeout`` minutes, so a
   message is found up to one whole timeout after its deadline (uniform over
   the scan period: p99 = 0.99 x timeout).
3. Hook cost (``--hook-messages``, ``--hook-only``, ``--skip-hook``): the dedup
   hook's cost per message beside AWS Powertools' idempotency utility
   (``idempotent_function`` outside Lambda with ``RedisCachePersistenceLayer``),
   side by side in one process and one thread, on the same messages (each run
   sees them fresh) and the same redis-server: the handler alone, the handler
   behind the hook (one consume call per ``--hook-batch`` messages, a message
   counted once its ledger commit is durable), the handler behind Powertools (one
   call per message; its record lives in Redis only). Runs interleave over
   ``--hook-rounds`` rounds; medians are printed in microseconds per message, with
   the ratio of the two layers' own cost (handler subtracted) and of the totals.
   Needs the ``bench`` extra (``pip install 'idem-exactly-once[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import redis
from _cpu import cpu_seconds

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.redis_server import RedisServer
from idem.retry.consumer import (
    BatchResult,
    ConsumeFromWhere,
    ConsumerSettings,
    ConsumeScope,
    DedupMiddleware,
    Deferred,
    Producer,
    PushConsumer,
    TopicStore,
    new_message,
)
from idem.retry.consumer.listener import CallNext
from idem.retry.consumer.topics import MessageQueue
from idem.retry.message import MessageExt
from idem.retry.status import ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus

TOPIC = "bench"
QUEUES = 8
INSTANCES = 2


class FileSink:
    """One append (one JSON line per message) per consume call."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(
        self, messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        data = "".join(json.dumps({"key": m.keys, "id": m.msg_id}) + "\n" for m in messages)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


class Progress:
    """Outermost middleware: counts messages once everything inside (dedup too) is done —
    a message whose acknowledgement waits for the dedup hook's group commit counts when
    that commit is durable. Counts reach Redis every 5 ms from a thread of their own (a
    round trip per call would slow whichever thread resolves a group commit)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client, self.key = client, key
        self._lock = threading.Lock()
        self._unsent = 0
        threading.Thread(target=self._send, daemon=True, name="progress").start()

    def __call__(
        self, messages: Sequence[MessageExt], scope: ConsumeScope, call_next: CallNext
    ) -> BatchResult:
        result = call_next(messages)
        later: dict[int, tuple[Deferred, int]] = {}
        for deferred in result.pending.values():
            later[id(deferred)] = (deferred, later.get(id(deferred), (deferred, 0))[1] + 1)
        self._count(len(messages) - len(result.pending))
        for deferred, count in later.values():
            deferred.on_resolved(lambda _failure, n=count: self._count(n))
        return result

    def _count(self, n: int) -> None:
        with self._lock:
            self._unsent += n

    def _send(self) -> None:
        while True:
            time.sleep(0.005)
            with self._lock:
                n, self._unsent = self._unsent, 0
            if n:
                self.client.incrby(self.key, n)


def worker(spec: dict[str, Any]) -> None:
    """One consumer instance (a process) until the parent says stop."""
    client = redis.Redis.from_url(spec["redis_url"])
    config = IdemConfig(
        group=spec["group"],
        redis_url=spec["redis_url"],
        data_dir=spec["data_dir"],
        buckets=spec.get("buckets", 16),
    )
    settings = ConsumerSettings(
        pull_threshold_for_queue=spec.get("pull_threshold", 1000),
        consume_from_where=ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET,
        consume_message_batch_max_size=spec["batch"],
        pull_batch_size=max(spec["batch"], 32),
        consume_thread_nums=spec["threads"],
        heartbeat_interval_ms=200,
        rebalance_interval_ms=1000,
        persist_consumer_offset_interval_ms=1000,
    )
    sampler = _Sampler() if os.environ.get("IDEM_BENCH_SAMPLE") else None
    profile_to = os.environ.get("IDEM_BENCH_PROFILE") if spec["name"] == "i0" else None
    profiler = _ThreadProfiler() if profile_to else None
    consumer = PushConsumer(config, settings=settings, client=client, instance_name=spec["name"])
    consumer.subscribe(TOPIC)
    consumer.use(Progress(client, spec["counter"]))
    middleware: DedupMiddleware | None = None
    if spec["dedup"]:
        middleware = DedupMiddleware(
            Dedup(config, client=redis.Redis.from_url(spec["redis_url"])),
            commit_lock=spec.get("commit_lock", True),
            commit_interval_ms=spec.get("commit_interval_ms", 200),
        )
        consumer.use(middleware)
    consumer.register_message_listener_concurrently(FileSink(spec["sink"]))
    consumer.start()
    while not client.exists(spec["stop"]):
        time.sleep(0.1)
    threads = _thread_cpu() if sampler is not None else []  # before the threads end
    consumer.shutdown()
    if sampler is not None:
        times = os.times()
        extra = [f"cpu: user {times.user:.1f}s system {times.system:.1f}s", *threads]
        if middleware is not None:
            extra += [
                f"index: {middleware.dedup.stats}",
                f"dedup: {middleware.stats.commits} commits, "
                f"{middleware.claimer.rounds} claim rounds",
            ]
        sampler.dump(Path(spec["sink"]).with_suffix(".samples"), extra)
    if profiler is not None and profile_to:
        profiler.dump(f"{profile_to}.{'dedup' if spec['dedup'] else 'plain'}-{spec['batch']}")


class _ThreadProfiler:
    """cProfile of every thread of one worker (IDEM_BENCH_PROFILE=<file prefix>): one
    profiler per thread, merged into one pstats file at the end."""

    def __init__(self) -> None:
        import cProfile
        import sys

        self.profiles: list[cProfile.Profile] = []

        def start(*_args: Any) -> None:
            sys.setprofile(None)
            profile = cProfile.Profile()
            self.profiles.append(profile)
            profile.enable()

        threading.setprofile(start)
        start()

    def dump(self, path: str) -> None:
        import pstats

        threading.setprofile(None)  # type: ignore[arg-type]
        for profile in self.profiles:
            profile.disable()
        stats = pstats.Stats(self.profiles[0])
        for profile in self.profiles[1:]:
            stats.add(profile)
        stats.dump_stats(path)


def _thread_cpu() -> list[str]:
    """CPU seconds of this process's threads by name (numbers stripped), from /proc (Linux)."""
    import collections
    import re

    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    used: collections.Counter[str] = collections.Counter()
    system: collections.Counter[str] = collections.Counter()
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        name = re.sub(r"[-_]?[0-9a-f]*\d[0-9a-f]*$", "", names.get(int(task.name), "(native)"))
        used[name] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        system[name] += int(fields[12]) / tick
    return [
        f"thread cpu {seconds:6.2f}s (system {system[name]:5.2f}s) {name}"
        for name, seconds in used.most_common(8)
    ]


class _Sampler:
    """Where the threads of a worker spend their time, and the cyclic GC (IDEM_BENCH_SAMPLE=1)."""

    def __init__(self) -> None:
        import collections
        import gc
        import sys
        import traceback

        self.counts: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self.gc = {generation: [0, 0.0] for generation in range(3)}  # collections, seconds
        started = [0.0]

        def collected(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[0] = time.thread_time()
            else:
                self.gc[info["generation"]][0] += 1
                self.gc[info["generation"]][1] += time.thread_time() - started[0]

        gc.callbacks.append(collected)

        def run() -> None:
            me = threading.get_ident()
            while not self._stop.wait(0.005):
                for tid, frame in sys._current_frames().items():
                    if tid != me:
                        stack = traceback.extract_stack(frame)[-6:]
                        self.counts[
                            " <- ".join(
                                f"{f.name}:{Path(f.filename).name}:{f.lineno}" for f in stack
                            )
                        ] += 1

        threading.Thread(target=run, daemon=True).start()

        import idem.dedup
        import idem.hotstore
        import idem.ledger.deltars
        import idem.retry.consumer.concurrently as cc
        import idem.retry.consumer.group_claim as gc
        import idem.retry.consumer.group_commit as gcm
        import idem.retry.consumer.middleware as mw
        import idem.retry.consumer.pull as pl

        self.times: dict[str, list[tuple[float, float]]] = {}
        for cls, names in (
            (idem.dedup.Dedup, ("begin", "complete", "catch_up")),
            (idem.ledger.deltars.DeltaLedger, ("commit", "keys_added_since")),
            (idem.hotstore.RedisHotStore, ("claim", "complete")),
            (gcm.GroupCommitter, ("_acquire", "_commit")),
            (gc.GroupClaimer, ("_claim",)),
            (mw.DedupMiddleware, ("__call__",)),
            (cc.ConcurrentlyService, ("_consume_request", "_settled")),
            (pl.PullService, ("_pull", "_deliver")),
            (FileSink, ("__call__",)),
        ):
            for name in names:
                self._wrap(cls, name)

    def _wrap(self, cls: Any, name: str) -> None:
        original = getattr(cls, name)
        times = self.times.setdefault(f"{cls.__name__}.{name}", [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            began, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                times.append((time.perf_counter() - began, time.thread_time() - cpu))

        setattr(cls, name, timed)

    def dump(self, path: Path, extra: list[str]) -> None:
        self._stop.set()
        lines = extra + [
            f"{k}: n={len(v)} mean={statistics.mean(w for w, _ in v) * 1000:.1f}ms "
            f"wall={sum(w for w, _ in v):.2f}s thread-cpu={sum(c for _, c in v):.2f}s"
            for k, v in self.times.items()
            if v
        ]
        lines += [
            f"gc generation {g}: {n} collections, {seconds:.2f}s"
            for g, (n, seconds) in self.gc.items()
        ]
        lines += [f"{n} {k}" for k, n in self.counts.most_common(30)]
        path.write_text("\n".join(lines))


class Throughput(NamedTuple):
    """One measured run: messages/second, and CPU microseconds per message."""

    rate: float
    workers_us: float | None
    redis_us: float | None


def throughput(
    server: RedisServer,
    *,
    dedup: bool,
    messages: int,
    warmup: int,
    batch: int,
    threads: int,
    workdir: Path,
    **extra: Any,
) -> Throughput:
    """Messages/second of a 2-instance group after ``warmup`` messages were consumed, and
    the CPU the instances and redis-server spent per message meanwhile."""
    group = f"bench-{'dedup' if dedup else 'plain'}-{batch}-{uuid.uuid4().hex[:6]}"
    client = server.client()
    TopicStore(client).create_topic(TOPIC, QUEUES)
    producer = Producer("bench-producer", client=client)
    total = warmup + messages
    for start in range(0, total, 10_000):
        producer.send_batch(
            [
                new_message(TOPIC, b'{"amount": 1}', keys=f"{group}-{i}")
                for i in range(start, min(start + 10_000, total))
            ]
        )
    counter, stop = f"{group}:consumed", f"{group}:stop"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=worker,
            args=(
                {
                    "redis_url": server.url,
                    "group": group,
                    "data_dir": str(workdir / group),
                    "batch": batch,
                    "threads": threads,
                    "name": f"i{n}",
                    "dedup": dedup,
                    "counter": counter,
                    "stop": stop,
                    "sink": str(workdir / f"{group}-{n}.jsonl"),
                    **extra,
                },
            ),
        )
        for n in range(INSTANCES)
    ]
    for proc in procs:
        proc.start()
    pids = [proc.pid for proc in procs]
    try:
        began = _wait_count(client, counter, warmup, timeout=300)
        cpu_before = cpu_seconds(pids), cpu_seconds([server.pid])
        ended = _wait_count(client, counter, total, timeout=600)
        cpu_after = cpu_seconds(pids), cpu_seconds([server.pid])
    finally:
        client.set(stop, 1)
        for proc in procs:
            proc.join(30)
    # TopicStore keeps the topic; each run reads its own messages from the start
    client.delete(*[TopicStore.queue_key(mq) for mq in TopicStore(client).message_queues(TOPIC)])
    used = [
        None if a is None or b is None else (a - b) * 1e6 / messages
        for a, b in zip(cpu_after, cpu_before, strict=True)
    ]
    return Throughput(messages / (ended - began), used[0], used[1])


def _cpu(run: Throughput) -> str:
    if run.workers_us is None or run.redis_us is None:
        return "n/a"
    return f"{run.workers_us:.0f} + {run.redis_us:.0f} = {run.workers_us + run.redis_us:.0f}"


def _wait_count(client: redis.Redis, key: str, target: int, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while int(client.get(key) or 0) < target:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key} stayed below {target}")
        time.sleep(0.01)
    return time.monotonic()


def timeout_lateness(
    server: RedisServer, *, stuck: int, timeout_ms: int, workdir: Path
) -> tuple[list[int], list[int]]:
    """How late (ms after the deadline) each of ``stuck`` messages arriving at random moments
    was found by the watchdog, and was sent back."""
    group = f"bench-timeout-{uuid.uuid4().hex[:6]}"
    client = server.client()
    topic = "stuck"
    TopicStore(client).create_topic(topic, QUEUES)
    config = IdemConfig(group=group, redis_url=server.url, data_dir=str(workdir / group))
    settings = ConsumerSettings(
        consume_from_where=ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET,
        pull_block_ms=20,
        consume_thread_nums=96,
        consume_timeout_ms=timeout_ms,
        heartbeat_interval_ms=200,
    )
    hold_s = timeout_ms / 1000 + 3.0  # long enough that even a late find is still found

    def listener(
        messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        if messages[0].reconsume_times == 0:
            time.sleep(hold_s)  # stuck past its deadline
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS

    consumer = PushConsumer(config, settings=settings, client=server.client())
    consumer.subscribe(topic)
    consumer.register_message_listener_concurrently(listener)
    consumer.start()
    producer = Producer("p", client=client)
    rng = random.Random(7)
    try:
        for i in range(stuck):
            producer.send(new_message(topic, b"{}", keys=f"stuck-{i}"))
            time.sleep(rng.uniform(0, 0.05))
        service = consumer.concurrently_service
        assert service is not None
        deadline = time.monotonic() + 60
        watchdog = service.watchdog
        while len(watchdog.sent_back_lateness_ms) < stuck and time.monotonic() < deadline:
            time.sleep(0.1)
        return list(watchdog.lateness_ms), list(watchdog.sent_back_lateness_ms)
    finally:
        consumer.shutdown()


class HookCost(NamedTuple):
    """One round of the hook-cost section: microseconds per message of each variant."""

    handler_us: float
    idem_us: float
    powertools_us: float


def _handle(body: bytes) -> int:
    """The handler every variant runs: parse the message's JSON body."""
    return int(json.loads(body)["amount"])


HOOK_WARMUP = 200
"""Messages each variant consumes before it is timed (its tables, scripts, connections)."""


def hook_messages(n: int, prefix: str = "order") -> list[MessageExt]:
    """The messages every variant of the hook-cost section consumes."""
    return [new_message(TOPIC, b'{"amount": 1}', keys=f"{prefix}-{i}") for i in range(n)]


def _handler_alone(messages: Sequence[MessageExt]) -> float:
    began = time.perf_counter()
    total = sum(_handle(m.body) for m in messages)
    elapsed = time.perf_counter() - began
    assert total == len(messages)
    return elapsed * 1e6 / len(messages)


def _idem_hook(
    server: RedisServer,
    messages: Sequence[MessageExt],
    *,
    batch: int,
    commit_interval_ms: int,
    workdir: Path,
) -> float:
    """µs per message through :class:`DedupMiddleware` (fresh group), until every
    message's ledger commit is durable."""
    group = f"hook-idem-{uuid.uuid4().hex[:6]}"
    config = IdemConfig(group=group, redis_url=server.url, data_dir=str(workdir / group))
    middleware = DedupMiddleware(Dedup(config), commit_interval_ms=commit_interval_ms)
    middleware.open()
    scope = ConsumeScope(MessageQueue(TOPIC, 0), "bench-hook", orderly=False, defer_acks=True)
    handled = 0

    def call_next(fresh: Sequence[MessageExt]) -> BatchResult:
        nonlocal handled
        for message in fresh:
            handled += _handle(message.body)
        return BatchResult(len(fresh))

    def consume(batch_of: Sequence[MessageExt]) -> None:
        waiting: dict[int, Deferred] = {}
        for start in range(0, len(batch_of), batch):
            result = middleware(batch_of[start : start + batch], scope, call_next)
            if not result.ok:
                raise RuntimeError(f"the dedup hook failed messages: {result}")
            waiting.update((id(d), d) for d in result.pending.values())
        for deferred in waiting.values():
            if (failure := deferred.wait(120)) is not None:
                raise RuntimeError(f"a ledger commit failed: {failure}")

    try:
        consume(hook_messages(HOOK_WARMUP, "warmup"))  # creates the ledger table
        handled = 0
        began = time.perf_counter()
        consume(messages)
        elapsed = time.perf_counter() - began
    finally:
        middleware.close()
    assert handled == len(messages), f"the handler ran {handled} times for {len(messages)}"
    return elapsed * 1e6 / len(messages)


def _powertools(server: RedisServer, messages: Sequence[MessageExt]) -> float:
    """µs per message through Powertools' ``idempotent_function`` (fresh key prefix)."""
    import warnings

    try:
        from aws_lambda_powertools.utilities.idempotency import (
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.persistence.redis import (
            RedisCachePersistenceLayer,
        )
    except ModuleNotFoundError as exc:
        raise SystemExit(
            f"the hook-cost section needs the bench extra: "
            f"pip install 'idem-exactly-once[bench]' ({exc})"
        ) from exc

    with warnings.catch_warnings():
        # the Redis layer the comparison names; Powertools 3 points to its successor
        warnings.simplefilter("ignore", DeprecationWarning)
        layer = RedisCachePersistenceLayer(client=server.client())
    handled = 0

    @idempotent_function(
        data_keyword_argument="record",
        persistence_store=layer,
        config=IdempotencyConfig(event_key_jmespath="key"),
        key_prefix=f"hook-pt-{uuid.uuid4().hex[:6]}",
    )
    def handle(record: dict[str, Any]) -> dict[str, int]:
        nonlocal handled
        handled += _handle(record["body"].encode())
        return {"amount": 1}

    def records(batch_of: Sequence[MessageExt]) -> list[dict[str, Any]]:
        return [{"key": m.keys, "body": m.body.decode()} for m in batch_of]

    with warnings.catch_warnings():
        # outside Lambda there is no remaining time to read: it warns on every call
        warnings.simplefilter("ignore", UserWarning)
        for record in records(hook_messages(HOOK_WARMUP, "warmup")):
            handle(record=record)
        handled = 0
        began = time.perf_counter()
        for record in records(messages):
            handle(record=record)
        elapsed = time.perf_counter() - began
    assert handled == len(messages), f"the handler ran {handled} times for {len(messages)}"
    return elapsed * 1e6 / len(messages)


def hook_cost(
    server: RedisServer,
    *,
    messages: int,
    batch: int,
    rounds: int,
    commit_interval_ms: int,
    workdir: Path,
) -> list[HookCost]:
    """The hook-cost section: ``rounds`` interleaved rounds over the same messages."""
    batch_of = hook_messages(messages)
    out: list[HookCost] = []
    for round_ in range(rounds):
        handler = _handler_alone(batch_of)

        def idem() -> float:
            return _idem_hook(
                server,
                batch_of,
                batch=batch,
                commit_interval_ms=commit_interval_ms,
                workdir=workdir,
            )

        def powertools() -> float:
            return _powertools(server, batch_of)

        if round_ % 2 == 0:  # alternate who goes first: a slow spell hits both alike
            idem_us, powertools_us = idem(), powertools()
        else:
            powertools_us, idem_us = powertools(), idem()
        out.append(HookCost(handler, idem_us, powertools_us))
    return out


def print_hook_cost(runs: Sequence[HookCost], *, messages: int, batch: int) -> None:
    """The hook-cost table: medians over the rounds, and the ratios."""
    handler = statistics.median(r.handler_us for r in runs)
    idem = statistics.median(r.idem_us for r in runs)
    powertools = statistics.median(r.powertools_us for r in runs)
    print(
        f"\ndedup hook vs AWS Powertools idempotency (RedisCachePersistenceLayer), one thread, "
        f"{messages} messages, hook batch {batch}, same redis-server, median of {len(runs)} "
        f"round(s):"
    )
    print(f"  {'handler alone':<34} {handler:>9.1f} us/msg")
    print(f"  {'idem dedup hook (ledger durable)':<34} {idem:>9.1f} us/msg")
    print(f"  {'Powertools idempotent_function':<34} {powertools:>9.1f} us/msg")
    own_idem, own_pt = idem - handler, powertools - handler
    print(
        f"  ratio idem / Powertools: {own_idem / own_pt:.2f} (layers' own cost), "
        f"{idem / powertools:.2f} (totals)"
    )
    for n, r in enumerate(runs, 1):
        print(
            f"    round {n}: handler {r.handler_us:.1f}, idem {r.idem_us:.1f}, "
            f"Powertools {r.powertools_us:.1f} us/msg"
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--warmup", type=int, default=30_000)
    parser.add_argument(
        "--batch",
        type=int,
        action="append",
        help="consume_message_batch_max_size (repeatable; default 256 and 32)",
    )
    parser.add_argument("--threads", type=int, default=20)
    parser.add_argument("--stuck", type=int, default=200)
    parser.add_argument("--timeout-ms", type=int, default=1000)
    parser.add_argument(
        "--commit-interval-ms",
        type=int,
        default=200,
        help="dedup group commit: how long the oldest key waits for company",
    )
    parser.add_argument(
        "--no-commit-lock",
        action="store_true",
        help="dedup: no Redis lock taking turns on ledger commits",
    )
    parser.add_argument("--skip-timeout", action="store_true", help="no consume-timeout part")
    parser.add_argument(
        "--hook-messages",
        type=int,
        default=20_000,
        help="hook cost: messages per variant and round",
    )
    parser.add_argument(
        "--hook-batch",
        type=int,
        default=1,
        help="hook cost: messages per consume call through the dedup hook (Powertools: 1)",
    )
    parser.add_argument("--hook-rounds", type=int, default=3, help="hook cost: rounds")
    parser.add_argument("--skip-hook", action="store_true", help="no hook-cost part")
    parser.add_argument(
        "--hook-only", action="store_true", help="only the hook-cost part (dedup vs Powertools)"
    )
    args = parser.parse_args()
    dedup_options = {
        "commit_lock": not args.no_commit_lock,
        "commit_interval_ms": args.commit_interval_ms,
    }
    batches = args.batch or [256, 32]
    workdir = Path(tempfile.mkdtemp(prefix="idem-bench-consumer-"))
    server = RedisServer()
    server.start()
    try:
        if args.hook_only:
            _hook_part(server, args, workdir)
            return
        print(
            f"push consumer, {INSTANCES} instances (processes), {QUEUES} queues, "
            f"{args.threads} consume threads each, file sink, {os.cpu_count()} cores; "
            f"dedup group commit every {args.commit_interval_ms} ms, "
            f"commit lock {'off' if args.no_commit_lock else 'on'}"
        )
        print(
            f"{'batch':>6} {'plain msg/s':>12} {'dedup msg/s':>12} {'ratio':>6}   "
            "CPU us/msg, instances + redis-server: plain | dedup"
        )
        for batch in batches:
            n = args.messages if batch >= 16 else max(args.messages // 20, 1000)
            w = args.warmup if batch >= 16 else max(args.warmup // 20, 500)
            run: dict[str, Any] = {
                "messages": n,
                "warmup": w,
                "batch": batch,
                "threads": args.threads,
                "workdir": workdir,
            }
            plain = throughput(server, dedup=False, **run)
            dedup = throughput(server, dedup=True, **run, **dedup_options)
            print(
                f"{batch:>6} {plain.rate:>12,.0f} {dedup.rate:>12,.0f} "
                f"{dedup.rate / plain.rate:>6.2f}   {_cpu(plain)} | {_cpu(dedup)}",
                flush=True,
            )
        if not args.skip_hook:
            _hook_part(server, args, workdir)
        if args.skip_timeout:
            return

        late, sent = timeout_lateness(
            server, stuck=args.stuck, timeout_ms=args.timeout_ms, workdir=workdir
        )
        t = args.timeout_ms
        print(f"\nconsume timeout {t} ms, {len(late)} stuck messages arriving at random:")
        print(
            f"  idem     found   p50 {statistics.median(late):.0f} ms, "
            f"p99 {percentile(late, 99):.0f} ms, max {max(late)} ms after the deadline"
        )
        print(
            f"  idem     sent back (journaled + scheduled) p50 {statistics.median(sent):.0f} ms, "
            f"p99 {percentile(sent, 99):.0f} ms, max {max(sent)} ms after the deadline"
        )
        print(
            f"  RocketMQ scan every timeout: lateness uniform in [0, {t}) ms -> "
            f"p50 {0.5 * t:.0f} ms, p99 {0.99 * t:.0f} ms, max ~{t} ms "
            f"(default 15 min timeout: p99 {0.99 * 15:.2f} min)"
        )
    finally:
        server.stop()


def _hook_part(server: RedisServer, args: argparse.Namespace, workdir: Path) -> None:
    runs = hook_cost(
        server,
        messages=args.hook_messages,
        batch=args.hook_batch,
        rounds=args.hook_rounds,
        commit_interval_ms=args.commit_interval_ms,
        workdir=workdir,
    )
    print_hook_cost(runs, messages=args.hook_messages, batch=args.hook_batch)


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    # the timeout part sends stuck messages back on purpose: one warning each is noise here
    logging.getLogger("idem.retry.consumer.concurrently").setLevel(logging.ERROR)
    main()
