"""Chaos soak: consumer processes with the dedup hook under a seeded schedule of faults.

    python -m tests.faults.soak --seeds 5 --messages 2000      # five fresh seeds
    python -m tests.faults.soak --seed 1234 --messages 2000    # replay one

Two redis-servers: the *broker* holds the topic (it is not faulted: a broker that
loses messages loses them for everyone), the *store* holds idem's claims and index,
the retry engine and the consume offsets, and is reached through a
:class:`~proxy.FaultProxy`. Consumer processes (``soak_consumer.py``) consume while
messages are produced in seeded bursts; a third of the keys fail their first
attempt and come back through the retry topic. The seed draws every fault, its
moment, its target and its pause: SIGKILL of a consumer process (restarted after the
pause), SIGKILL of the store's redis-server (restarted on its AOF), FLUSHALL of the
store, and proxy cuts (every connection reset, or silenced for the pause).

When everything is consumed, a run passes when:

- no key is lost: every key is in the sink and exactly once in the ledger;
- ``idem ledger audit`` finds no key held twice, and nothing is dead-lettered;
- every repeat in the sink (a key written twice) is one the guarantees allow: its
  earlier writer was SIGKILLed before its group commit was durable, or the store
  lost or could not renew the claim (a store kill, FLUSHALL or cut) between the two
  writes. Any other repeat is a duplicate and fails the run.

Every random choice comes from ``random.Random(seed)``: a failing seed replays the
same fault schedule (the processes' own timing still varies). The seed is printed
first and named in every failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(p) for p in (_HERE, _HERE.parent, _HERE.parent / "scenarios")]

from checks import ledger_keys, ledger_owners  # noqa: E402
from harness import TOPIC, FileSink  # noqa: E402
from proxy import Fault, FaultProxy  # noqa: E402

from idem.config import IdemConfig, LedgerEngine  # noqa: E402
from idem.delay_levels import DelayLevels  # noqa: E402
from idem.redis_server import RedisServer  # noqa: E402
from idem.retry import RetryEngine  # noqa: E402
from idem.retry.consumer import (  # noqa: E402
    Producer,
    TopicStore,
    consumer_offsets,
    new_message,
)

CHILD = _HERE / "soak_consumer.py"
FAIL_SHARE = 0.34
"""Keys whose first attempt fails (so at least this share is redelivered)."""
LEASE_MS = 3_000
"""The dedup lease: a killed consumer's keys are free again this long after its last renewal."""
SOCKET_TIMEOUT_S = 1.0
"""The consumers' socket time-out to the store (a silenced connection costs this long)."""
RATE = 60.0
"""Messages produced per second, on average."""
MAX_FAULTS = 40
"""About how many faults a seed injects at most: a longer run spaces them further apart
rather than adding more. Each FLUSHALL makes the consumers rebuild the Redis index from
the ledger, whose size grows with the run, so a fault every second or two for a whole
long run would measure little but rebuilds."""


class Kind(StrEnum):
    """A fault of the soak."""

    KILL_CONSUMER = "kill-consumer"
    KILL_DRIVER = "kill-driver"
    KILL_REDIS = "kill-redis"
    FLUSHALL = "flushall"
    CUT_RESET = "cut-reset"
    CUT_SILENT = "cut-half-open"


STORE_FAULTS = frozenset({Kind.KILL_REDIS, Kind.FLUSHALL, Kind.CUT_RESET, Kind.CUT_SILENT})
"""Faults after which the store may have lost, or could not renew, a claim."""

CONSUMER_KINDS = (
    Kind.KILL_CONSUMER,
    Kind.KILL_REDIS,
    Kind.FLUSHALL,
    Kind.CUT_RESET,
    Kind.CUT_SILENT,
)
"""The faults of the consumers' soak."""


@dataclass(frozen=True)
class Planned:
    """One fault of the schedule: at ``at_s`` after the start, on consumer ``target``."""

    at_s: float
    kind: Kind
    target: int
    pause_s: float


@dataclass(frozen=True)
class Plan:
    """Everything a seed decides."""

    seed: int
    keys: list[str]
    fail_first: list[str]
    bursts: list[tuple[float, int]]
    """(when, how many of the next keys) to produce."""
    faults: list[Planned]


def plan(seed: int, messages: int, consumers: int) -> Plan:
    """The run of ``seed``: the keys, those failing first, the bursts and the faults."""
    rng = random.Random(seed)
    keys = [f"S{seed}-{i:06d}" for i in range(messages)]
    fail_first = sorted(rng.sample(keys, math.ceil(messages * FAIL_SHARE)))
    duration = max(6.0, messages / RATE)
    bursts: list[tuple[float, int]] = []
    at, left = 0.0, messages
    while left > 0:
        n = min(left, rng.randint(1, max(2, int(RATE / 2))))
        bursts.append((at, n))
        left -= n
        at += rng.uniform(0.1, 0.9) * n / RATE * 2
    low, high = DEFAULT_GAP_S
    spread = max(1.0, duration / (MAX_FAULTS * (low + high) / 2))
    faults = draw_faults(
        rng,
        CONSUMER_KINDS,
        duration=duration,
        targets=consumers,
        gap=(low * spread, high * spread),
    )
    return Plan(seed, keys, fail_first, bursts, faults)


DEFAULT_GAP_S = (0.8, 2.2)
"""Seconds between two faults of a short run (uniform)."""


def draw_faults(
    rng: random.Random,
    kinds: tuple[Kind, ...],
    *,
    duration: float,
    targets: int = 1,
    first: tuple[float, float] = (0.5, 1.5),
    gap: tuple[float, float] = DEFAULT_GAP_S,
    pause: tuple[float, float] = (0.2, 1.2),
) -> list[Planned]:
    """Every kind once (in a seeded order), then any kind, ``gap`` seconds apart, until
    ``duration``: each with its target (of ``targets``) and its pause."""
    left = list(kinds)
    rng.shuffle(left)
    faults: list[Planned] = []
    at = rng.uniform(*first)
    while at < duration or left:
        kind = left.pop() if left else rng.choice(list(kinds))
        faults.append(Planned(at, kind, rng.randrange(targets), rng.uniform(*pause)))
        at += rng.uniform(*gap)
    return faults


@dataclass
class Injected:
    """A fault as it happened."""

    kind: Kind
    started: float
    ended: float
    target: str = ""
    sink_rows_at_end: int = 0


@dataclass
class Report:
    """What one seed's run showed."""

    seed: int
    messages: int
    faults: list[Injected] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    repeats: Counter[str] = field(default_factory=Counter)
    redelivered: int = 0
    sink_rows: int = 0
    duration_s: float = 0.0
    settle_s: float = 0.0
    recoveries: list[float] = field(default_factory=list)
    replay: str = "python -m tests.faults.soak"
    """The command that runs a seed again."""

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems

    def tag(self, message: str) -> str:
        """``message`` with the seed that reproduces it."""
        return f"[seed={self.seed}, replay: {self.replay} --seed {self.seed}] {message}"

    def summary(self) -> str:
        """The figures of the run, one paragraph."""
        kinds = Counter(f.kind.value for f in self.faults)
        recov = sorted(self.recoveries)
        median = recov[len(recov) // 2] if recov else float("nan")
        worst = recov[-1] if recov else float("nan")
        share = self.redelivered / max(1, self.messages)
        by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        return (
            f"seed={self.seed}: {self.messages} messages, {self.sink_rows} sink writes, "
            f"{self.redelivered} keys redelivered ({share:.0%}); "
            f"{len(self.faults)} faults ({by_kind}); "
            f"recovery to the next sink write: median {median:.2f}s, worst {worst:.2f}s; "
            f"repeats allowed by the guarantees: {dict(self.repeats) or 0}; "
            f"run {self.duration_s:.1f}s, settled {self.settle_s:.1f}s after the last fault; "
            + ("OK" if self.ok else f"FAILED: {'; '.join(self.problems)}")
        )


class _Consumer:
    """One consumer slot: a process, restarted as a new incarnation after each kill."""

    def __init__(self, slot: int, spec: dict[str, object], base: Path) -> None:
        self.slot = slot
        self.spec = spec
        self.base = base
        self.incarnation = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed: set[str] = set()
        self.name = ""

    def start(self) -> None:
        self.incarnation += 1
        self.name = f"c{self.slot}.{self.incarnation}-{uuid.uuid4().hex[:6]}"
        ready = self.base / f"{self.name}.ready"
        spec = {**self.spec, "name": self.name, "ready": str(ready)}
        log = (self.base / "logs" / f"{self.name}.log").open("wb")
        with log:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), json.dumps(spec)], stdout=log, stderr=log
            )
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"consumer {self.name} did not start (see its log)")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.killed.add(self.name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _parse_by(by: str) -> tuple[str, float]:
    owner, _, at = by.partition(" ")
    return owner, float(at or 0)


def run_seed(
    seed: int,
    messages: int,
    *,
    consumers: int = 2,
    base: Path | None = None,
    say: Callable[[str], None] = print,
    settle_timeout_s: float = 180.0,
) -> Report:
    """Run the soak of ``seed`` with ``messages`` messages and return what it showed."""
    say(f"seed={seed}: soak of {messages} messages, {consumers} consumer processes")
    the_plan = plan(seed, messages, consumers)
    report = Report(seed, messages)
    base = Path(tempfile.mkdtemp(prefix=f"idem-soak-{seed}-")) if base is None else base
    (base / "logs").mkdir(parents=True, exist_ok=True)
    group = f"soak-{seed}-{uuid.uuid4().hex[:6]}"
    fail_file = base / "fail-first.json"
    fail_file.write_text(json.dumps(the_plan.fail_first), encoding="utf-8")
    broker = RedisServer(directory=base / "broker").start()
    store = RedisServer(directory=base / "store", appendonly=True).start()
    proxy = FaultProxy(store.port).start()
    config = IdemConfig(
        group=group,
        redis_url=store.url,
        data_dir=str(base / "data"),
        delay_levels=DelayLevels.parse("1s 1s 1s"),
        lease_ms=LEASE_MS,
        engine=LedgerEngine.DELTA_RS,
    )
    sink = FileSink(base / "sink.jsonl")
    spec: dict[str, object] = {
        "group": group,
        "broker_url": broker.url,
        "store_url": proxy.url(socket_timeout=SOCKET_TIMEOUT_S),
        "data_dir": config.data_dir,
        "lease_ms": LEASE_MS,
        "fail_file": str(fail_file),
        "sink": str(sink.path),
    }
    slots = [_Consumer(i, spec, base) for i in range(consumers)]
    broker_client = broker.client()
    topics = TopicStore(broker_client)
    topics.create_topic(TOPIC, 4)
    producer = Producer(f"{group}-producer", client=broker_client)
    started = time.monotonic()
    try:
        for slot in slots:
            slot.start()
        start = time.monotonic()

        def produce() -> None:
            sent = 0
            for at, n in the_plan.bursts:
                time.sleep(max(0.0, start + at - time.monotonic()))
                batch = the_plan.keys[sent : sent + n]
                producer.send_batch([new_message(TOPIC, k.encode(), keys=k) for k in batch])
                sent += n

        producing = threading.Thread(target=produce, daemon=True, name="soak-producer")
        producing.start()
        for planned in the_plan.faults:
            time.sleep(max(0.0, start + planned.at_s - time.monotonic()))
            report.faults.append(_inject(planned, slots, store, proxy))
            report.faults[-1].sink_rows_at_end = len(sink.rows())
        producing.join()
        last_fault = time.monotonic()
        for slot in slots:  # every slot running at the end
            if slot.proc is None or slot.proc.poll() is not None:
                slot.start()
        store_client = store.client()
        engine = RetryEngine(config, client=store_client)
        deadline = time.monotonic() + settle_timeout_s
        while not _settled(
            the_plan.keys,
            sink=sink,
            topics=topics,
            store_client=store_client,
            engine=engine,
            group=group,
        ):
            if time.monotonic() > deadline:
                report.problems.append(f"not settled {settle_timeout_s:.0f}s after the last fault")
                report.problems.append(_whereabouts(the_plan.keys, sink, engine))
                break
            time.sleep(0.2)
        report.settle_s = time.monotonic() - last_fault
        dead = engine.dlq.count()
        engine.close()
        store_client.close()
    finally:
        for slot in slots:
            slot.stop()
        proxy.stop()
        producer.shutdown()
        broker_client.close()
        broker.stop()
        store.stop()
    report.duration_s = time.monotonic() - started
    killed = {name for slot in slots for name in slot.killed}
    _judge(report, the_plan, sink=sink, config=config, killed=killed, dead=dead)
    _recoveries(report, sink)
    say(report.summary())
    for problem in report.problems:
        say(report.tag(problem))
    return report


def _inject(
    planned: Planned, slots: list[_Consumer], store: RedisServer, proxy: FaultProxy
) -> Injected:
    began = time.monotonic()
    target = ""
    if planned.kind is Kind.KILL_CONSUMER:
        slot = slots[planned.target]
        target = slot.name
        slot.kill()
        time.sleep(planned.pause_s)
        slot.start()
    else:
        store_fault(planned, store, proxy)
    return Injected(planned.kind, began, time.monotonic(), target)


def store_fault(planned: Planned, store: RedisServer, proxy: FaultProxy) -> None:
    """Inject a fault of :data:`STORE_FAULTS` into the store (or the proxy before it)."""
    if planned.kind is Kind.KILL_REDIS:
        store.kill()
        time.sleep(planned.pause_s)
        store.start()
    elif planned.kind is Kind.FLUSHALL:
        client = store.client()
        try:
            client.flushall()
        finally:
            client.close()
    elif planned.kind is Kind.CUT_RESET:
        proxy.cut(Fault.RESET)
    elif planned.kind is Kind.CUT_SILENT:
        proxy.cut(Fault.HALF_OPEN, duration_s=planned.pause_s)
        time.sleep(planned.pause_s)
    else:
        raise ValueError(f"not a store fault: {planned.kind}")


def _settled(
    keys: list[str],
    *,
    sink: FileSink,
    topics: TopicStore,
    store_client: object,
    engine: RetryEngine,
    group: str,
) -> bool:
    try:
        if not sink.has_all(keys):
            return False
        stored = consumer_offsets(store_client, group)  # type: ignore[arg-type]
        if any(stored.get(mq, -1) < topics.max_offset(mq) for mq in topics.message_queues(TOPIC)):
            return False
        return engine.pending() == 0
    except Exception:  # the store restarting, say: ask again
        return False


def _whereabouts(keys: list[str], sink: FileSink, engine: RetryEngine) -> str:
    """Where the keys not in the sink are when the settle time ran out: still retrying
    (live in the retry journal: slow, not lost) or not (never consumed, or gone)."""
    written = {row["key"] for row in sink.rows()}
    missing = [k for k in keys if k not in written]
    try:
        retrying = {event.key for event in engine.journal.live().values()}
    except Exception as exc:  # the journal unreadable: say so rather than guess
        return f"{len(missing)} key(s) not in the sink; the retry journal unreadable: {exc!r}"
    other = [k for k in missing if k not in retrying]
    return (
        f"of the {len(missing)} key(s) not in the sink, {len(missing) - len(other)} are still "
        f"retrying (live in the retry journal) and {len(other)} are not (never consumed from "
        f"the topic, or gone), e.g. {other[:5]}"
    )


def _judge(
    report: Report,
    the_plan: Plan,
    *,
    sink: FileSink,
    config: IdemConfig,
    killed: set[str],
    dead: int,
) -> None:
    """Lost keys, the ledger, the audit, dead letters, then every repeat in the sink."""
    rows = sink.rows()
    report.sink_rows = len(rows)
    wanted = set(the_plan.keys)
    counts = Counter(row["key"] for row in rows)
    lost = sorted(wanted - set(counts))
    if lost:
        report.problems.append(f"{len(lost)} key(s) lost (never in the sink), e.g. {lost[:5]}")
    extra = sorted(set(counts) - wanted)
    if extra:
        report.problems.append(f"unexpected keys in the sink: {extra[:5]}")
    in_ledger = ledger_keys(config)
    not_once = sorted(k for k in wanted if in_ledger[k] != 1)
    if not_once:
        report.problems.append(
            f"{len(not_once)} key(s) not exactly once in the ledger, e.g. "
            f"{[(k, in_ledger[k]) for k in not_once[:5]]}"
        )
    audit = ledger_audit(config)
    if audit:
        report.problems.append(f"idem ledger audit: {audit}")
    if dead:
        report.problems.append(f"{dead} dead letter(s)")
    redelivered = {row["key"] for row in rows if row["reconsume"] > 0}
    report.redelivered = len(redelivered | {k for k, n in counts.items() if n > 1})
    unexplained = _repeats(report, rows, owners=ledger_owners(config), killed=killed, config=config)
    if unexplained:
        report.problems.append(f"{len(unexplained)} duplicate(s) in the sink: {unexplained[:5]}")


def _repeats(
    report: Report,
    rows: list[dict[str, Any]],
    *,
    owners: dict[str, str],
    killed: set[str],
    config: IdemConfig,
) -> list[str]:
    """Count the repeats the guarantees allow into ``report``; return the others."""
    lease_s = config.lease_ms / 1000
    store_faults = [_wall(f.started) for f in report.faults if f.kind in STORE_FAULTS]
    by_key: dict[str, list[tuple[str, float]]] = {}
    for row in rows:
        by_key.setdefault(row["key"], []).append(_parse_by(row["by"]))
    unexplained: list[str] = []
    for key, writes in by_key.items():
        if len(writes) < 2:
            continue
        owner = owners.get(key)
        # the first write of the owner whose commit the ledger holds counts; the rest repeat
        kept = next((i for i, (writer, _) in enumerate(writes) if writer == owner), None)
        since = writes[0][1] - lease_s - 1.0
        for i, (writer, at) in enumerate(writes):
            if i == kept:
                continue
            if writer in killed and writer != owner:
                report.repeats["writer killed before its commit"] += 1
            elif any(since <= started <= at for started in store_faults):
                report.repeats["store lost or could not renew the claim"] += 1
            else:
                unexplained.append(f"{key} written by {[w for w, _ in writes]} (ledger: {owner})")
    return unexplained


_WALL_OFFSET = time.time() - time.monotonic()


def _wall(monotonic: float) -> float:
    return monotonic + _WALL_OFFSET


def ledger_audit(config: IdemConfig) -> str:
    """``idem ledger audit`` as a user runs it: empty when it exits 0 with nothing repeated."""
    command = [
        sys.executable, "-m", "idem.cli", "ledger", "audit",
        "--group", config.group, "--data-dir", config.data_dir,
        "--ledger-path", config.resolved_ledger_path, "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    with contextlib.suppress(ValueError):
        answer = json.loads(done.stdout)
        if done.returncode == 0 and answer.get("exists") and answer.get("repeated") == []:
            return ""
    return f"exit {done.returncode}: {done.stdout.strip()[:500]} {done.stderr.strip()[-500:]}"


def _recoveries(report: Report, sink: FileSink) -> None:
    """Per fault, how long after it ended the sink was written again (when it was)."""
    times = sorted(_parse_by(row["by"])[1] for row in sink.rows())
    for fault in report.faults:
        end = _wall(fault.ended)
        later = next((t for t in times if t > end), None)
        if later is not None:
            report.recoveries.append(later - end)


def _say(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    """The command line: ``--seeds N --messages M`` (or ``--seed S`` to replay one)."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults.soak", description=__doc__.split("\n")[0]
    )
    seed_arguments(parser, messages=500)
    parser.add_argument("--consumers", type=int, default=2, help="consumer processes")
    args = parser.parse_args(argv)
    return run_seeds(
        chosen_seeds(args),
        lambda seed, base: run_seed(
            seed, args.messages, consumers=args.consumers, base=base, say=_say
        ),
        prefix="idem-soak",
    )


def seed_arguments(parser: argparse.ArgumentParser, *, messages: int) -> None:
    """``--seeds N``, ``--seed S`` (repeatable) and ``--messages M``."""
    parser.add_argument("--seeds", type=int, default=3, help="how many fresh seeds to run")
    parser.add_argument("--seed", type=int, action="append", help="run this seed (repeatable)")
    parser.add_argument("--messages", type=int, default=messages, help="messages per seed")


def chosen_seeds(args: argparse.Namespace) -> list[int]:
    """The seeds asked for, or ``--seeds`` fresh ones."""
    seeds: list[int] = args.seed or [
        random.SystemRandom().randrange(2**32) for _ in range(args.seeds)
    ]
    return seeds


def run_seeds(seeds: list[int], run: Callable[[int, Path], Report], *, prefix: str) -> int:
    """Print the seeds, run each in a directory of its own (kept when it fails); exit code."""
    print(f"seeds: {' '.join(map(str, seeds))}", flush=True)
    failed = []
    for seed in seeds:
        base = Path(tempfile.mkdtemp(prefix=f"{prefix}-{seed}-"))
        report = run(seed, base)
        if report.ok:
            shutil.rmtree(base, ignore_errors=True)
        else:
            failed.append(seed)
            print(f"seed={seed}: logs, sink and tables kept in {base}", flush=True)
    if failed:
        print(f"FAILED seeds: {' '.join(map(str, failed))}")
        return 1
    print(f"all {len(seeds)} seed(s) passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
