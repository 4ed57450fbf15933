"""Kill matrix: SIGKILL at every named crash point, N times each, with recovery times.

    python -m tests.faults.kill_matrix --repeats 20                       # consumer + send-back
    python -m tests.faults.kill_matrix --repeats 5 --points spark         # the Spark batch points
    python -m tests.faults.kill_matrix --seed 1234 --points journaled     # replay a seed

The points (``--points``, comma-separated names or the groups ``consumer``,
``send-back``, ``spark``, ``all``; default ``consumer,send-back``):

- the consumer between its listener and its group commit
  (:class:`~idem.retry.crash_points.ConsumePoint`);
- the send-back and its acknowledgement (:class:`~idem.retry.crash_points.SendBackStage`:
  journal append, Redis schedule, the ack's journal entry, the ack in Redis);
- the Spark batch points (:class:`~idem.spark.faults.CrashPoint`, ``spark:<point>``),
  through ``idem run`` and ``IDEM_SPARK_KILL_AT``.

Each run of a point starts the real process (a consumer process, or ``idem run``) on a
real redis-server and Delta tables on disk; the seed picks the message (a consumer) or
the batch (Spark) at which it SIGKILLs itself; it is restarted at once, without the
kill, and runs until the group has settled. A run passes when nothing is lost (every
key in the sink and once in the ledger, nothing acknowledged that is not durable,
nothing dead-lettered, no retry left) and nothing is duplicated: a consumer's file sink
may hold a key twice only where the guarantees allow it (the killed process wrote it
and died before its group commit was durable; the ledger names the restarted one), and
the Delta sink of ``idem run`` holds every key exactly once.

Recovery time: from the kill to the moment the restarted process has everything (every
key in the sink, every queue consumed to its end, no retry pending; for Spark, every
key in the Delta sink), the restart's own start included. Per point the runner prints
the runs, p50 and p99 (nearest rank), duplicates and lost keys. The seed is printed
first and in every failure; ``--seed S`` replays the same choices.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(p) for p in (_HERE, _HERE.parent, _HERE.parent / "scenarios")]

from c10_runs import idem_run, order_files  # noqa: E402
from checks import (  # noqa: E402
    acknowledged_but_not_durable,
    ledger_keys,
    ledger_owners,
)
from deltalake import DeltaTable  # noqa: E402
from harness import FileSink  # noqa: E402

from idem.config import IdemConfig, LedgerEngine  # noqa: E402
from idem.delay_levels import DelayLevels  # noqa: E402
from idem.redis_client import connect  # noqa: E402
from idem.redis_server import RedisServer  # noqa: E402
from idem.retry import RetryEngine  # noqa: E402
from idem.retry.consumer import Producer, TopicStore, consumer_offsets, new_message  # noqa: E402
from idem.retry.crash_points import ConsumePoint, SendBackStage  # noqa: E402
from idem.retry.store import ScheduleStore  # noqa: E402
from idem.spark.faults import CrashPoint  # noqa: E402

CHILD = _HERE / "kill_consumer.py"
CONSUMER_POINTS = tuple(p.value for p in ConsumePoint)
SEND_BACK_POINTS = tuple(
    s.value
    for s in (
        SendBackStage.JOURNALED,
        SendBackStage.APPLIED,
        SendBackStage.ACK_JOURNALED,
        SendBackStage.ACKED,
    )
)
"""The stages every failed delivery passes (dead letters and outage paths are not
reached by a run without faults of the store)."""
SPARK_POINTS = tuple(f"spark:{p.value}" for p in CrashPoint)
GROUPS = {
    "consumer": CONSUMER_POINTS,
    "send-back": SEND_BACK_POINTS,
    "spark": SPARK_POINTS,
    "all": CONSUMER_POINTS + SEND_BACK_POINTS + SPARK_POINTS,
}
DEFAULT_POINTS = CONSUMER_POINTS + SEND_BACK_POINTS

MESSAGES = 16
"""Messages of one consumer run, over four queues."""
FAIL_FIRST = 5
"""Of those, how many fail their first attempt (and go through the send-back)."""
PRODUCE_GAP_S = (0.02, 0.08)
"""Seconds between two messages: a stream, so that offsets are persisted (every 300 ms)
while other keys still wait for their group commit (every 200 ms)."""
LEASE_MS = 1_000
"""The dedup lease: a killed consumer's in-flight keys are free again this long after."""
SPARK_BATCHES = 4
"""Order files of one ``idem run`` (one micro-batch each)."""
START_TIMEOUT_S = 60.0
KILL_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 120.0


@dataclass
class Run:
    """One kill and its recovery."""

    point: str
    repeat: int
    chosen: str
    """The key (consumer) or batch (Spark) the seed picked for the kill."""
    recovery_s: float | None = None
    duplicates: int = 0
    lost: int = 0
    allowed_repeats: int = 0
    """Keys the killed process wrote and could not commit, written again after it: the
    repeat a non-Delta sink may see once per crash."""
    problems: list[str] = field(default_factory=list)


@dataclass
class PointFigures:
    """The figures of one point over its runs."""

    point: str
    runs: int
    p50_s: float
    p99_s: float
    duplicates: int
    lost: int
    allowed_repeats: int
    failed: int


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (``nan`` when empty)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def figures(runs: Sequence[Run]) -> list[PointFigures]:
    """Per point, in the order first run: runs, p50, p99, duplicates, lost."""
    by_point: dict[str, list[Run]] = {}
    for run in runs:
        by_point.setdefault(run.point, []).append(run)
    out = []
    for point, these in by_point.items():
        times = [r.recovery_s for r in these if r.recovery_s is not None]
        out.append(
            PointFigures(
                point,
                len(these),
                nearest_rank(times, 0.50),
                nearest_rank(times, 0.99),
                sum(r.duplicates for r in these),
                sum(r.lost for r in these),
                sum(r.allowed_repeats for r in these),
                sum(1 for r in these if r.problems),
            )
        )
    return out


def table(seed: int, rows: Sequence[PointFigures]) -> str:
    """The figures as a Markdown table, the seed above it."""
    lines = [
        f"seed={seed}",
        "| point | runs | recovery p50 | recovery p99 | duplicates | lost "
        "| repeats allowed | failed runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| `{f.point}` | {f.runs} | {f.p50_s:.2f} s | {f.p99_s:.2f} s | {f.duplicates} "
        f"| {f.lost} | {f.allowed_repeats} | {f.failed} |"
        for f in rows
    ]
    return "\n".join(lines)


class Matrix:
    """Runs kills on one redis-server under ``base`` with one seed."""

    def __init__(
        self,
        seed: int,
        server: RedisServer,
        base: Path,
        *,
        say: Callable[[str], None] = print,
        spark_engine: str = "delta-rs",
    ) -> None:
        self.seed = seed
        self.server = server
        self.base = base
        self.say = say
        self.spark_engine = spark_engine

    def tag(self, message: str) -> str:
        """``message`` with the seed that replays it."""
        return (
            f"[seed={self.seed}, replay: python -m tests.faults.kill_matrix "
            f"--seed {self.seed}] {message}"
        )

    def run(self, points: Sequence[str], repeats: int, *, parallel: int = 1) -> list[Run]:
        """Every point ``repeats`` times, ``parallel`` runs at once (each its own group);
        each run is said as it ends, the runs come back in the order asked."""
        cells = [(point, repeat) for point in points for repeat in range(repeats)]
        if parallel <= 1:
            return [self.one(*cell) for cell in cells]
        pool = ThreadPoolExecutor(parallel)
        try:
            return list(pool.map(lambda cell: self.one(*cell), cells))
        finally:  # an interrupt stops the runs not started yet
            pool.shutdown(wait=True, cancel_futures=True)

    def one(self, point: str, repeat: int) -> Run:
        """Run ``point`` once (its ``repeat``-th run: the seed's choice for it)."""
        rng = random.Random(f"{self.seed}/{point}/{repeat}")
        if point.startswith("spark:"):
            run = self.spark_run(point, repeat, rng)
        else:
            run = self.consumer_run(point, repeat, rng)
        recovery = "-" if run.recovery_s is None else f"{run.recovery_s:.2f}s"
        self.say(
            f"seed={self.seed} {point} #{repeat} at {run.chosen}: recovery {recovery}, "
            f"duplicates {run.duplicates}, lost {run.lost}, "
            f"repeats allowed {run.allowed_repeats}"
            + "".join(f"\n  {self.tag(p)}" for p in run.problems)
        )
        return run

    # -- a consumer process -----------------------------------------------------------

    def consumer_run(self, point: str, repeat: int, rng: random.Random) -> Run:
        """Kill a consumer process at ``point`` on the key the seed picks, restart it."""
        keys = [f"K{repeat}-{i:03d}" for i in range(MESSAGES)]
        # the kill comes in the stream's second half: the tables exist by then, and group
        # commits, offset persists and send-backs run at their pace around it
        half = MESSAGES // 2
        late = sorted(rng.sample(keys[half:], FAIL_FIRST - FAIL_FIRST // 2))
        fail_first = sorted(rng.sample(keys[:half], FAIL_FIRST // 2)) + late
        chosen = rng.choice(late if point in SEND_BACK_POINTS else keys[half:])
        gaps = [rng.uniform(*PRODUCE_GAP_S) for _ in keys]
        run = Run(point, repeat, chosen)
        work = self.base / f"{point}-{repeat}"
        (work / "logs").mkdir(parents=True)
        group = f"km-{uuid.uuid4().hex[:8]}"
        topic = f"orders-{group}"  # a topic of its own: runs share the redis-server
        config = IdemConfig(
            group=group,
            redis_url=self.server.url,
            data_dir=str(work / "data"),
            delay_levels=DelayLevels.parse("1s 1s 1s"),
            lease_ms=LEASE_MS,
            engine=LedgerEngine.DELTA_RS,
        )
        sink = FileSink(work / "sink.jsonl")
        spec = {
            "group": group,
            "redis_url": self.server.url,
            "data_dir": config.data_dir,
            "lease_ms": LEASE_MS,
            "fail_first": fail_first,
            "sink": str(sink.path),
            "topic": topic,
        }
        client = connect(self.server.url)
        topics = TopicStore(client)
        topics.create_topic(topic, 4)
        producer = Producer(f"{group}-producer", client=client)

        def produce() -> None:
            for key, gap in zip(keys, gaps, strict=True):
                time.sleep(gap)
                producer.send(new_message(topic, key.encode(), keys=key))

        killed = _start(work, {**spec, "name": "c1", "kill": {"point": point, "key": chosen}})
        producing = threading.Thread(target=produce, daemon=True, name="kill-matrix-producer")
        producing.start()
        survivor: subprocess.Popen[bytes] | None = None
        try:
            try:
                killed.wait(KILL_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                run.problems.append(f"{point} was not reached by {chosen} in {KILL_TIMEOUT_S}s")
                return run
            killed_at = time.monotonic()
            if killed.returncode != -signal.SIGKILL:
                run.problems.append(f"the first process exited {killed.returncode}, not SIGKILL")
                return run
            survivor = _start(work, {**spec, "name": "c2"})
            store = ScheduleStore(client, group)
            deadline = killed_at + SETTLE_TIMEOUT_S
            while not _settled(keys, sink, topics, topic, store, group):
                if time.monotonic() > deadline or survivor.poll() is not None:
                    run.problems.append(f"not settled {SETTLE_TIMEOUT_S:.0f}s after the kill")
                    break
                time.sleep(0.02)
            else:
                run.recovery_s = time.monotonic() - killed_at
            _judge_consumer(run, keys, sink, config, topics, topic)
        finally:
            producing.join()
            producer.shutdown()
            for proc in (killed, survivor):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            client.close()
        return run

    # -- idem run (Spark) -------------------------------------------------------------

    def spark_run(self, point: str, repeat: int, rng: random.Random) -> Run:
        """Kill ``idem run`` at ``point`` of the batch the seed picks, restart it."""
        batch = rng.randrange(SPARK_BATCHES)
        name = point.removeprefix("spark:")
        run = Run(point, repeat, f"batch {batch}")
        work = self.base / f"{name}-{repeat}"
        keys = order_files(work / "in", batches=SPARK_BATCHES)
        group = f"km-{uuid.uuid4().hex[:8]}"
        sink = work / "sink"
        args = ["--sink-delta", str(sink), "--engine", self.spark_engine]
        code, out = idem_run(work, self.server.url, group, args, kill_at=f"{name}@{batch}")
        killed_at = time.monotonic()
        if code != -signal.SIGKILL or "crash point" not in out:
            run.problems.append(f"idem run was not killed at {name}@{batch} (exit {code})")
            return run
        second: list[tuple[int, str]] = []
        restart = threading.Thread(
            target=lambda: second.append(idem_run(work, self.server.url, group, args))
        )
        restart.start()
        while restart.is_alive() and run.recovery_s is None:
            if keys <= set(_delta_keys(sink)):
                run.recovery_s = time.monotonic() - killed_at
            time.sleep(0.1)
        restart.join()
        if run.recovery_s is None and keys <= set(_delta_keys(sink)):
            run.recovery_s = time.monotonic() - killed_at
        code, out = second[0] if second else (-1, "")
        if code != 0:
            run.problems.append(f"the restarted idem run exited {code}: {out[-2000:]}")
        # idem's Delta sink is the ledger: rows and done-records are one commit
        counts = Counter(_delta_keys(sink))
        run.lost = len(keys - set(counts))
        run.duplicates = sum(n - 1 for n in counts.values() if n > 1)
        report = json.loads((work / "report.json").read_text()) if code == 0 else {}
        if code == 0 and report.get("pending_retries") != 0:
            run.problems.append(f"retries left: {report.get('pending_retries')}")
        if code == 0 and report.get("sink", {}).get("exactly_once") is not True:
            run.problems.append(f"idem run's report: {report.get('sink')}")
        if run.lost:
            run.problems.append(f"{run.lost} key(s) lost: {sorted(keys - set(counts))[:5]}")
        if run.duplicates:
            twice = sorted(k for k, n in counts.items() if n > 1)
            run.problems.append(f"{run.duplicates} duplicate(s) in the sink or ledger: {twice[:5]}")
        return run


def _start(work: Path, spec: dict[str, object]) -> subprocess.Popen[bytes]:
    """A consumer process, returned once it consumes."""
    ready = work / f"{spec['name']}.ready"
    with (work / "logs" / f"{spec['name']}.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), json.dumps({**spec, "ready": str(ready)})],
            stdout=log,
            stderr=log,
        )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        # a process killed at its point before it said it was ready is still a kill
        if proc.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return proc


def _settled(  # noqa: PLR0917 -- one check, every piece it reads
    keys: Sequence[str],
    sink: FileSink,
    topics: TopicStore,
    topic: str,
    store: ScheduleStore,
    group: str,
) -> bool:
    """Every key in the sink, every queue consumed to its end, no retry pending."""
    if not sink.has_all(keys):
        return False
    stored = consumer_offsets(topics.client, group)
    if any(stored.get(mq, -1) < topics.max_offset(mq) for mq in topics.message_queues(topic)):
        return False
    return store.pending() == 0


def _judge_consumer(  # noqa: PLR0917 -- one judgement, every piece it reads
    run: Run,
    keys: Sequence[str],
    sink: FileSink,
    config: IdemConfig,
    topics: TopicStore,
    topic: str,
) -> None:
    """Lost and duplicated keys, from the sink, the ledger, the offsets and the retry side."""
    rows = sink.rows()
    counts = Counter(row["key"] for row in rows)
    wanted = set(keys)
    in_ledger = ledger_keys(config)
    lost = sorted(k for k in wanted if counts[k] == 0 or in_ledger[k] == 0)
    messages = [m for mq in topics.message_queues(topic) for m in topics.messages(mq)]
    unacked = acknowledged_but_not_durable(topics.client, config, messages)
    run.lost = len(set(lost) | {u.split(" ", 1)[0] for u in unacked})
    if lost:
        run.problems.append(f"{len(lost)} key(s) lost (sink or ledger): {lost[:5]}")
    if unacked:
        run.problems.append(f"acknowledged but not durable: {unacked[:5]}")
    owners = ledger_owners(config)
    duplicates: list[str] = []
    for key, n in counts.items():
        if n < 2 and in_ledger[key] < 2:
            continue
        writers = [row["by"] for row in rows if row["key"] == key]
        # the one repeat a non-Delta sink may see: the killed process wrote the key and died
        # before its group commit was durable, so the restarted one wrote and committed it
        if writers == ["c1", "c2"] and owners.get(key) == "c2" and in_ledger[key] == 1:
            run.allowed_repeats += 1
        else:
            duplicates.append(f"{key}: sink {writers}, ledger {in_ledger[key]} ({owners.get(key)})")
    run.duplicates = len(duplicates)
    if duplicates:
        run.problems.append(f"{len(duplicates)} duplicate(s): {duplicates[:5]}")
    extra = sorted(set(counts) - wanted)
    if extra:
        run.problems.append(f"unexpected keys in the sink: {extra[:5]}")
    engine = RetryEngine(config, client=connect(config.redis_url))
    try:
        dead = engine.dlq.count() if engine.dlq.exists() else 0
        live = engine.journal.live()
    finally:
        engine.close()
    if dead:
        run.problems.append(f"{dead} dead letter(s)")
    if live:
        run.problems.append(f"{len(live)} message(s) still live in the retry journal")


def _delta_keys(path: Path) -> list[str]:
    """The ``key`` column of the Delta table at ``path`` (empty until it exists)."""
    if not (path / "_delta_log").is_dir():
        return []
    try:
        keys: list[str] = DeltaTable(str(path)).to_pyarrow_table(columns=["key"])["key"].to_pylist()
    except Exception:  # caught mid-commit: read again next time
        return []
    return keys


def run_matrix(
    seed: int,
    points: Sequence[str],
    repeats: int,
    *,
    base: Path,
    say: Callable[[str], None] = print,
    spark_engine: str = "delta-rs",
    parallel: int = 1,
) -> list[Run]:
    """Start a redis-server under ``base`` and run the matrix on it."""
    say(f"seed={seed}: kill matrix, {repeats} run(s) of {', '.join(points)}")
    server = RedisServer(directory=base / "redis").start()
    try:
        return Matrix(seed, server, base, say=say, spark_engine=spark_engine).run(
            points, repeats, parallel=parallel
        )
    finally:
        server.stop()


def parse_points(spec: str) -> list[str]:
    """``--points``: names and groups, in order, each once; an unknown name is an error."""
    known = GROUPS["all"]
    out: list[str] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        names = GROUPS.get(part) or ((part,) if part in known else None)
        if names is None:
            raise ValueError(f"--points: {part!r} is not one of {', '.join([*GROUPS, *known])}")
        out += [n for n in names if n not in out]
    return out


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module)."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults.kill_matrix", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=20, help="runs of each point")
    parser.add_argument(
        "--points", default="consumer,send-back", help="names or groups: " + ", ".join(GROUPS)
    )
    parser.add_argument("--seed", type=int, help="replay this seed")
    parser.add_argument("--spark-engine", default="delta-rs", help="ledger engine of idem run")
    parser.add_argument(
        "--parallel", type=int, default=1, help="runs at once (recovery times then compete)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    try:
        points = parse_points(args.points)
    except ValueError as exc:
        parser.error(str(exc))
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"seed={seed} (replay: python -m tests.faults.kill_matrix --seed {seed})", flush=True)
    base = Path(tempfile.mkdtemp(prefix=f"idem-kill-matrix-{seed}-"))

    def say(line: str) -> None:
        print(line, flush=True)

    runs = run_matrix(
        seed,
        points,
        args.repeats,
        base=base,
        say=say,
        spark_engine=args.spark_engine,
        parallel=args.parallel,
    )
    rows = figures(runs)
    print(table(seed, rows), flush=True)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "seed": seed,
                    "points": [asdict(r) for r in rows],
                    "runs": [asdict(r) for r in runs],
                },
                indent=1,
            )
        )
    failed = [r for r in runs if r.problems]
    if failed:
        print(f"seed={seed}: {len(failed)} failed run(s); processes' logs kept in {base}")
        return 1
    shutil.rmtree(base, ignore_errors=True)
    print(f"seed={seed}: all {len(runs)} run(s) passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
