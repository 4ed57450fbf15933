"""Chaos soak of ``idem run --sink-delta``: the driver and the store faulted from a seed.

    python -m tests.faults.spark_soak --seeds 5 --messages 2000    # five fresh seeds
    python -m tests.faults.spark_soak --seed 1234 --messages 2000  # replay one

The Spark half of :mod:`soak` (its plan of faults, its store faults, its audit and
its seed loop are shared). JSON-lines files land in a directory in seeded bursts
while ``idem run`` streams them into a Delta sink table (the group's ledger), with
``--sink-fn`` standing for a downstream that validates each row first
(:mod:`spark_soak_sink`). Keys are redelivered three ways: repeated inside a file,
repeated in a later file, and refused on their first delivery so they come back
through the retry topic; a few rows are refused on every delivery and must end in
the DLQ. The store's redis-server (claims, index, retry engine) is reached through a
:class:`~proxy.FaultProxy`.

The clock starts at the sink's first commit. The seed draws each fault, its moment
(a fault waits for a driver that has committed since it started, and the later
ones slide with it, so faults hit a working driver rather than one starting) and
its pause: SIGKILL of the driver (its whole process group, the JVM with it;
restarted on the same checkpoint after the pause), SIGKILL of the store's
redis-server (restarted on its AOF), FLUSHALL of the store, proxy cuts (every
connection reset, or silenced for the pause). A driver that exits on its own is
started again, as a supervisor would. After the last file and fault the driver is
SIGKILLed once more while it commits (in the short mode: it kills itself right after a
batch's commit, before Redis hears of it, through ``IDEM_SPARK_KILL_AT``), and
``idem run --available-now`` on the same checkpoint drains what is left.

A run passes when every key is in the Delta sink exactly once (no repeat is
allowed: the table is its own ledger) and nothing is lost; the resend path's
conservation audit, with *done* read from the sink's ledger columns, puts every
message in exactly one state; ``idem ledger audit`` finds no key twice; and the DLQ
holds exactly the rows meant to die.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(p) for p in (_HERE, _HERE.parent, _HERE.parent / "scenarios")]

from c10_runs import delta_versions, kill_run, run_args, run_command, start_run  # noqa: E402
from deltalake import DeltaTable  # noqa: E402
from proxy import FaultProxy  # noqa: E402
from soak import (  # noqa: E402
    FAIL_SHARE,
    STORE_FAULTS,
    Injected,
    Kind,
    Planned,
    Report,
    chosen_seeds,
    draw_faults,
    ledger_audit,
    run_seeds,
    seed_arguments,
    store_fault,
)

from idem.config import IdemConfig, LedgerEngine  # noqa: E402
from idem.delay_levels import DelayLevels  # noqa: E402
from idem.ledger import read_table  # noqa: E402
from idem.redis_server import RedisServer  # noqa: E402
from idem.retry import RetryEngine, audit_states  # noqa: E402

SINK_FN = f"{_HERE / 'spark_soak_sink.py'}:refuse"
SCHEMA = "order_id string, mid string, amount double, refuse string"
KINDS = (Kind.KILL_DRIVER, *sorted(STORE_FAULTS))
"""The faults of the schedule (the final driver kill comes on top)."""
POISON_SHARE = 0.005
"""Keys refused on every delivery (at least one a run): the DLQ must hold exactly these."""
REPEAT_IN_FILE = 0.08
"""Share of a file's keys written twice in it."""
REPEAT_LATER = 0.08
"""Share of the keys written again in a later file."""
RATE = 40.0
"""Messages landing per second, on average."""
FILE_GAP_S = (0.5, 2.5)
"""Seconds between two files."""
FAULT_GAP_S = (3.0, 8.0)
"""Seconds between two faults."""
PAUSE_S = (0.5, 3.0)
"""How long a killed driver or redis-server stays down, or a cut stays silent."""
LEASE_MS = 10_000
"""The drivers' claim lease (``IDEM_LEASE_MS``)."""
SOCKET_TIMEOUT_S = 2.0
"""The drivers' socket time-out to the store (a silenced connection costs this long)."""
FIRST_COMMIT_TIMEOUT_S = 240.0
DRAIN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class SparkPlan:
    """Everything a seed decides."""

    seed: int
    keys: list[str]
    refuse_first: frozenset[str]
    poison: frozenset[str]
    files: list[tuple[float, list[str]]]
    """(when, the keys of the file in their order, repeats included); the first lands
    before the driver starts."""
    faults: list[Planned]
    final_kill_delay_s: float
    """How long after a commit seen at the end the driver is killed."""
    crash_at: str | None = None
    """``IDEM_SPARK_KILL_AT`` of the drivers (the short mode's final kill): the driver
    SIGKILLs itself when that batch reaches that point."""

    def deliveries(self) -> Counter[str]:
        """How many times each key is written into the files."""
        return Counter(k for _, keys in self.files for k in keys)

    def redelivered(self) -> set[str]:
        """Keys delivered more than once: repeated in the files, or refused at first."""
        copies = self.deliveries()
        return {k for k, n in copies.items() if n > 1} | self.refuse_first | self.poison

    def mid(self, key: str) -> str:
        """The message id of ``key`` (its copies share it)."""
        return f"M-{key}"


def spark_plan(seed: int, messages: int, *, short: bool = False) -> SparkPlan:
    """The run of ``seed``: keys, refusals, files, faults. ``short``: one store fault and
    the final driver kill at a crash point right after a batch's commit (each driver start
    costs a JVM and a Spark session)."""
    rng = random.Random(seed)
    keys = [f"S{seed}-{i:06d}" for i in range(messages)]
    refuse_first = set(rng.sample(keys, math.ceil(messages * FAIL_SHARE)))
    rest = [k for k in keys if k not in refuse_first]
    poison = set(rng.sample(rest, max(1, round(messages * POISON_SHARE))))
    duration = max(10.0, messages / RATE)
    files: list[tuple[float, list[str]]] = []
    at, sent = 0.0, 0
    mean_gap = sum(FILE_GAP_S) / 2
    per_file = max(1, round(messages / max(2, duration / mean_gap)))
    while sent < messages:
        n = min(messages - sent, rng.randint(max(1, per_file // 2), per_file * 3 // 2 + 1))
        fresh = keys[sent : sent + n]
        rows = fresh + rng.sample(fresh, round(n * REPEAT_IN_FILE))
        if sent:
            rows += rng.sample(keys[:sent], min(sent, math.ceil(n * REPEAT_LATER)))
        rng.shuffle(rows)
        files.append((at, rows))
        sent += n
        at += rng.uniform(*FILE_GAP_S)
    crash_at = None
    if short:
        kind = rng.choice(sorted(STORE_FAULTS))
        faults = [Planned(rng.uniform(1.0, max(2.0, at)), kind, 0, rng.uniform(*PAUSE_S))]
        # after the commit, before Redis hears of it: only the ledger knows the batch is done
        crash_at = f"after_commit@{rng.randint(1, 3)}"
    else:
        faults = draw_faults(
            rng, KINDS, duration=at, first=(1.0, 3.0), gap=FAULT_GAP_S, pause=PAUSE_S
        )
    return SparkPlan(
        seed,
        keys,
        frozenset(refuse_first),
        frozenset(poison),
        files,
        faults,
        final_kill_delay_s=rng.uniform(0.0, 0.8),
        crash_at=crash_at,
    )


@dataclass
class SparkReport(Report):
    """What one seed's run of ``idem run`` showed."""

    deliveries: int = 0
    dead: int = 0
    driver_starts: int = 0
    exits: list[str] = field(default_factory=list)
    """Driver runs that ended on their own (not killed by the soak): exit code, last line."""
    first_commit_s: float = 0.0
    drain_s: float = 0.0

    def summary(self) -> str:
        """The figures of the run, one paragraph."""
        kinds = Counter(f.kind.value for f in self.faults)
        by_kind = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        recov = sorted(self.recoveries)
        median = recov[len(recov) // 2] if recov else float("nan")
        worst = recov[-1] if recov else float("nan")
        share = self.redelivered / max(1, self.messages)
        return (
            f"seed={self.seed}: {self.messages} keys in {self.deliveries} rows, "
            f"{self.redelivered} keys redelivered ({share:.0%}); "
            f"{len(self.faults)} faults ({by_kind}); "
            f"{self.driver_starts} driver runs, {len(self.exits)} ended on their own; "
            f"sink {self.sink_rows} rows, {self.dead} dead letters; "
            f"recovery to the next sink commit: median {median:.1f}s, worst {worst:.1f}s; "
            f"first commit {self.first_commit_s:.0f}s, run {self.duration_s:.0f}s, "
            f"drain {self.drain_s:.0f}s; "
            + ("OK" if self.ok else f"FAILED: {'; '.join(self.problems)}")
        )


class _Driver:
    """``idem run`` streaming the files: started, killed, started again on its checkpoint."""

    def __init__(self, command: list[str], base: Path, env: dict[str, str], sink: Path) -> None:
        self.command = command
        self.base = base
        self.env = env
        self.sink = sink
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.exits: list[str] = []
        self.log = base / "logs" / "driver-0.log"
        self.commits_at_start = 0
        self.crashed_at: float | None = None
        """When the driver killed itself at its crash point (``IDEM_SPARK_KILL_AT``)."""

    def start(self) -> None:
        self.starts += 1
        self.commits_at_start = delta_versions(self.sink)
        self.log = self.base / "logs" / f"driver-{self.starts}.log"
        self.proc = start_run(self.command, self.log, self.env)

    def kill(self) -> None:
        if self.proc is not None:
            kill_run(self.proc)
            self.proc.wait(30)

    def watch(self) -> None:
        """Start a driver that ended on its own again (noting how it ended)."""
        if self.proc is not None and self.proc.poll() is not None and self.crashed_at is None:
            lines = self.log.read_text(errors="replace").strip().splitlines()
            # the crash point's own line: Spark's stack traces may follow it
            if self.proc.returncode == -signal.SIGKILL and any(
                line.startswith("idem: crash point") for line in lines
            ):
                self.crashed_at = time.monotonic()  # the planned kill: the drain restarts it
                return
            self.exits.append(f"exit {self.proc.returncode}: {lines[-1] if lines else ''}")
            kill_run(self.proc)  # its JVM too, if it outlived the driver
            self.start()

    def sleep_until(self, moment: float) -> None:
        """Sleep until ``moment`` (``time.monotonic()``), watching the driver."""
        while (left := moment - time.monotonic()) > 0:
            self.watch()
            time.sleep(min(0.2, left))

    def wait_working(self, timeout_s: float) -> float:
        """Wait (at most ``timeout_s``) until the running driver has committed to the sink
        since it started; how long that took."""
        began = time.monotonic()
        while delta_versions(self.sink) <= self.commits_at_start:
            if time.monotonic() - began > timeout_s or self.crashed_at is not None:
                break
            self.sleep_until(time.monotonic() + 0.2)
        return time.monotonic() - began


def run_seed(
    seed: int,
    messages: int,
    *,
    base: Path,
    short: bool = False,
    say: Callable[[str], None] = print,
) -> SparkReport:
    """Run the Spark soak of ``seed`` with ``messages`` keys and return what it showed."""
    say(f"seed={seed}: Spark soak of {messages} keys through idem run --sink-delta")
    the_plan = spark_plan(seed, messages, short=short)
    report = SparkReport(seed, messages, replay="python -m tests.faults.spark_soak")
    report.deliveries = sum(the_plan.deliveries().values()) + len(the_plan.refuse_first)
    report.redelivered = len(the_plan.redelivered())
    (base / "logs").mkdir(parents=True, exist_ok=True)
    source, sink = base / "in", base / "sink"
    source.mkdir()
    group = f"sparksoak-{seed}-{uuid.uuid4().hex[:6]}"
    store = RedisServer(directory=base / "store", appendonly=True).start()
    proxy = FaultProxy(store.port).start()
    config = IdemConfig(
        group=group,
        redis_url=store.url,
        data_dir=str(base / "data"),
        ledger_path=str(sink),
        delay_levels=DelayLevels.parse("1s 1s 1s"),
        engine=LedgerEngine.DELTA_RS,
    )

    def command(extra: list[str]) -> list[str]:
        return run_command(
            run_args(
                source=source,
                key="order_id",
                group=group,
                url=proxy.url(socket_timeout=SOCKET_TIMEOUT_S),
                data_dir=base / "data",
                checkpoint=base / "checkpoint",
                schema=SCHEMA,
                extra=[
                    "--msg-id-field", "mid", "--sink-delta", str(sink), "--sink-fn", SINK_FN,
                    "--engine", "delta-rs", *extra,
                ],
            )
        )  # fmt: skip

    env = {**os.environ, "IDEM_LEASE_MS": str(LEASE_MS)}
    env.pop("IDEM_SPARK_KILL_AT", None)
    drain_env = dict(env)
    if the_plan.crash_at is not None:
        env["IDEM_SPARK_KILL_AT"] = the_plan.crash_at
    driver = _Driver(command(["--trigger-seconds", "0.5"]), base, env, sink)
    started = time.monotonic()
    try:
        _land(source, 0, the_plan.files[0][1], the_plan)
        driver.start()
        if driver.wait_working(FIRST_COMMIT_TIMEOUT_S) >= FIRST_COMMIT_TIMEOUT_S:
            raise _Abort(f"no commit to the sink {FIRST_COMMIT_TIMEOUT_S:.0f}s after start")
        start = time.monotonic()
        report.first_commit_s = start - started

        def land_files() -> None:
            for i, (at, keys) in enumerate(the_plan.files[1:], start=1):
                time.sleep(max(0.0, start + at - time.monotonic()))
                _land(source, i, keys, the_plan)

        landing = threading.Thread(target=land_files, daemon=True, name="soak-files")
        landing.start()
        slid = 0.0  # a fault waits for a driver that commits; the later ones slide with it
        for planned in the_plan.faults:
            driver.sleep_until(start + planned.at_s + slid)
            slid += driver.wait_working(FIRST_COMMIT_TIMEOUT_S)
            report.faults.append(_inject(planned, driver, store, proxy))
        landing.join()
        report.faults.append(_final_kill(the_plan, driver))
        drain_began = time.monotonic()
        code = _drain(command, base, drain_env)
        report.drain_s = time.monotonic() - drain_began
        if code != 0:
            report.problems.append(f"the draining run exited {code} (see logs/drain.log)")
        report.driver_starts = driver.starts + 1
        report.exits = driver.exits
        _judge(report, the_plan, config=config, store=store, base=base)
    except _Abort as abort:
        report.problems.append(str(abort))
    finally:
        driver.kill()
        proxy.stop()
        store.stop()
    report.duration_s = time.monotonic() - started
    say(report.summary())
    for problem in report.problems:
        say(report.tag(problem))
    for ended in report.exits:
        say(f"seed={seed}: a driver ended on its own ({ended}); it was started again")
    return report


class _Abort(Exception):
    """The run cannot go on (what it says is the run's problem)."""


def _land(source: Path, index: int, keys: list[str], the_plan: SparkPlan) -> None:
    """Write one file of rows where the stream sees it only once it is whole."""
    lines = []
    for key in keys:
        refuse = (
            "always" if key in the_plan.poison else "first" if key in the_plan.refuse_first else ""
        )
        row = {"order_id": key, "mid": the_plan.mid(key), "amount": 1.0, "refuse": refuse}
        lines.append(json.dumps(row) + "\n")
    hidden = source / f".part-{index:05d}.json.tmp"  # the file source skips dot files
    hidden.write_text("".join(lines), encoding="utf-8")
    hidden.rename(source / f"part-{index:05d}.json")


def _final_kill(the_plan: SparkPlan, driver: _Driver) -> Injected:
    """The driver's end before the drain: at its crash point when it has one (waited for),
    else a SIGKILL while it commits, after the last file and fault."""
    deadline = time.monotonic() + 120
    if the_plan.crash_at is not None:
        while driver.crashed_at is None and time.monotonic() < deadline:
            driver.sleep_until(time.monotonic() + 0.1)
        if driver.crashed_at is not None:
            at = driver.crashed_at
            return Injected(Kind.KILL_DRIVER, at, at, f"crash point {the_plan.crash_at}")
    seen = delta_versions(driver.sink)
    while delta_versions(driver.sink) <= seen and time.monotonic() < deadline:
        driver.sleep_until(time.monotonic() + 0.1)
    time.sleep(the_plan.final_kill_delay_s)
    began = time.monotonic()
    driver.kill()
    return Injected(Kind.KILL_DRIVER, began, time.monotonic(), "final")


def _inject(planned: Planned, driver: _Driver, store: RedisServer, proxy: FaultProxy) -> Injected:
    began = time.monotonic()
    target = ""
    if planned.kind is Kind.KILL_DRIVER:
        target = f"driver run {driver.starts}"
        driver.kill()
        time.sleep(planned.pause_s)
        driver.start()
    else:
        store_fault(planned, store, proxy)
    return Injected(planned.kind, began, time.monotonic(), target)


def _drain(command: Callable[[list[str]], list[str]], base: Path, env: dict[str, str]) -> int:
    """``idem run --available-now`` on the same checkpoint, to the end; its exit code."""
    proc = start_run(
        command(["--available-now", "--report-json", str(base / "report.json")]),
        base / "logs" / "drain.log",
        env,
    )
    try:
        code: int = proc.wait(DRAIN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        code = -signal.SIGKILL
    finally:
        kill_run(proc)
    return code


def _judge(
    report: SparkReport, the_plan: SparkPlan, *, config: IdemConfig, store: RedisServer, base: Path
) -> None:
    """The sink, the conservation audit, the ledger audit, the DLQ, the run's own check."""
    path = config.resolved_ledger_path
    if not DeltaTable.is_deltatable(path):
        report.problems.append("no sink table")
        return
    table = read_table(DeltaTable(path), ["key", "msg_id", "origin_msg_id", "completed_at"])
    _judge_sink(report, the_plan, table.column("key").to_pylist())
    done = {
        origin or msg
        for msg, origin in zip(
            table.column("msg_id").to_pylist(),
            table.column("origin_msg_id").to_pylist(),
            strict=True,
        )
    }
    _judge_states(report, the_plan, config=config, store=store, done=done)
    found = ledger_audit(config)
    if found:
        report.problems.append(f"idem ledger audit: {found}")
    run_report = base / "report.json"
    if run_report.exists():
        sink_check = json.loads(run_report.read_text())["sink"] or {}
        if not sink_check.get("exactly_once"):
            report.problems.append(f"idem run's own check: {sink_check}")
    times = sorted(t.timestamp() for t in table.column("completed_at").to_pylist())
    for fault in report.faults:
        end = fault.ended + _WALL_OFFSET
        later = next((t for t in times if t > end), None)
        if later is not None:
            report.recoveries.append(later - end)


def _judge_sink(report: SparkReport, the_plan: SparkPlan, keys: list[str]) -> None:
    """Every key that may live in the sink exactly once, and nothing else."""
    report.sink_rows = len(keys)
    counts = Counter(keys)
    wanted = set(the_plan.keys) - the_plan.poison
    lost = sorted(wanted - set(counts))
    if lost:
        report.problems.append(f"{len(lost)} key(s) lost (not in the sink), e.g. {lost[:5]}")
    twice = sorted(k for k, n in counts.items() if n > 1)
    if twice:
        report.problems.append(
            f"{len(twice)} key(s) more than once in the sink, e.g. "
            f"{[(k, counts[k]) for k in twice[:5]]}"
        )
    extra = sorted(set(counts) - wanted)
    if extra:
        report.problems.append(f"key(s) in the sink that must not be there: {extra[:5]}")


def _judge_states(
    report: SparkReport,
    the_plan: SparkPlan,
    *,
    config: IdemConfig,
    store: RedisServer,
    done: set[str],
) -> None:
    """Each message done (in the ledger), retrying or dead, exactly one of them; nothing
    left retrying; the dead ones exactly those meant to die."""
    client = store.client()
    engine = RetryEngine(config, client=client)
    try:
        audit = audit_states(engine, {the_plan.mid(k) for k in the_plan.keys}, done)
        dead_keys = {letter.key for letter in engine.dlq.list()}
    finally:
        engine.close()
        client.close()
    if not audit.ok:
        report.problems.append(f"conservation audit: {audit.describe()}")
    if audit.retrying:
        report.problems.append(f"{len(audit.retrying)} message(s) still retrying")
    report.dead = len(audit.dead)
    if dead_keys != set(the_plan.poison):
        report.problems.append(
            f"the DLQ holds {sorted(k or '' for k in dead_keys)[:5]}, "
            f"not the rows meant to die {sorted(the_plan.poison)[:5]}"
        )


_WALL_OFFSET = time.time() - time.monotonic()


def _say(line: str) -> None:
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    """The command line: ``--seeds N --messages M`` (or ``--seed S`` to replay one)."""
    parser = argparse.ArgumentParser(
        prog="python -m tests.faults.spark_soak", description=__doc__.split("\n")[0]
    )
    seed_arguments(parser, messages=2000)
    parser.add_argument(
        "--short", action="store_true", help="one store fault and the final driver kill"
    )
    args = parser.parse_args(argv)
    # SIGTERM ends the run through its clean-ups: no driver, JVM or redis-server outlives it
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return run_seeds(
        chosen_seeds(args),
        lambda seed, base: run_seed(seed, args.messages, base=base, short=args.short, say=_say),
        prefix="idem-spark-soak",
    )


if __name__ == "__main__":
    sys.exit(main())
