"""Per-batch time of the decorated Delta sink against what users would do without idem.

One local Spark session (local[2]), one stream of 100k-row batches (parquet
files read with ``maxFilesPerTrigger=1``), a sink table / ledger that already
holds 1M keys, and five ways to write each batch, each its own streaming query
over the same files:

  plain      foreachBatch -> delta-rs append (no dedup at all: the baseline)
  decorated  foreachBatch = ``ExactlyOnce(sink_table=...)`` (claims in a real
             redis-server, the sink table is the ledger, one Delta commit)
  merge      foreachBatch -> delta-rs insert-only MERGE on the key into a
             1M-key table (dedup against the table, no Redis)
  dropdup    foreachBatch -> ``dropDuplicates([key])`` inside the batch, then
             append (in-batch dedup only; forgets everything between batches)
  watermark  Spark's stateful ``dropDuplicatesWithinWatermark`` on the stream,
             then append (state in the checkpoint; forgets on a lost checkpoint
             and knows nothing of retries)

Every batch has 1 % in-batch duplicates and 1 % keys the 1M table already
holds. The time per batch is Spark's ``triggerExecution`` of the batch (read,
plan, sink, commit), the median over the batches after a warm-up batch.

The variants run in interleaved rounds (``--rounds``, default 3): each round
streams new files (new keys) through every variant in turn, so a slow spell of a
shared machine falls on every variant alike instead of on whichever ran then.
A ratio to ``plain`` is taken within each round; the verdicts use the median of
the rounds and say in how many rounds each target held. Targets: decorated <=
2x plain, and faster than ``watermark``.

    python bench/spark_batch.py [--rows 100000] [--batches 6] [--ledger-keys 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import DeltaTable, write_deltalake

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cpu import cpu_seconds, stat_fields
from _ledger_fixture import build_ledger, fresh_keys, key_strings

from idem.config import IdemConfig
from idem.ledger import read_table
from idem.redis_server import RedisServer
from idem.spark.decorator import ExactlyOnce
from idem.spark.session import local_session

KEY = "order_id"


def write_batches(
    directory: Path, *, rows: int, batches: int, ledger_keys: int, first: int = 0
) -> None:
    """``batches`` parquet files of ``rows`` orders: new keys, 1 % repeats, 1 % old keys.
    ``first``: the number of batches written before (by earlier rounds), whose keys
    these must not repeat."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(3 + first)
    base = np.datetime64("2024-05-01T10:00:00", "us")
    for b in range(batches):
        new = fresh_keys(rows, round_=first + b)
        dup = max(1, rows // 100)
        old = (
            key_strings(0, ledger_keys)
            .take(pa.array(rng.integers(0, ledger_keys, size=dup)))
            .to_pylist()
        )
        keys = new[: rows - 2 * dup] + new[:dup] + old  # in-batch repeats and old keys
        times = (
            base
            + np.timedelta64((first + b) * 60, "s")
            + rng.integers(0, 59_000_000, size=rows).astype("timedelta64[us]")
        )
        table = pa.table(
            {
                KEY: pa.array(keys, pa.string()),
                "amount": pa.array(rng.uniform(1, 500, size=rows)),
                "customer": pa.array([f"C{i % 997}" for i in range(rows)], pa.string()),
                "ts": pa.array(times, pa.timestamp("us", tz="UTC")),
            }
        )
        pq.write_table(table, directory / f"batch-{b:03d}.parquet")


def run_query(
    spark: Any,
    source: Path,
    checkpoint: Path,
    sink: Callable[[Any, int], None],
    *,
    watermark: bool = False,
    cpu: CpuMeter | None = None,
) -> list[float]:
    """Stream ``source`` through ``sink``; return each batch's triggerExecution in seconds.
    ``cpu`` starts counting when the second batch begins (the first pays for warm-ups)."""
    schema = spark.read.parquet(str(source)).schema
    stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(source))
    if watermark:
        stream = stream.withWatermark("ts", "10 minutes").dropDuplicatesWithinWatermark([KEY])

    def counted(df: Any, batch_id: int) -> None:
        if cpu is not None and batch_id == 1:
            cpu.start()
        sink(df, batch_id)

    query = (
        stream.writeStream.foreachBatch(counted)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    if cpu is not None:
        cpu.stop(batches=len(query.recentProgress) - 1)
    return [p["durationMs"]["triggerExecution"] / 1000 for p in query.recentProgress]


class CpuMeter:
    """CPU seconds per batch of this process, its Spark JVM and redis-server (Linux /proc)."""

    def __init__(self, redis_pid: int | None) -> None:
        me = os.getpid()
        self.pids = {"python": me}
        if redis_pid is not None:
            self.pids["redis"] = redis_pid
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and entry.name != str(me):
                with contextlib.suppress(OSError, IndexError):
                    cmd = (entry / "cmdline").read_bytes()
                    if b"java" in cmd and stat_fields(int(entry.name))[1] == str(me):
                        self.pids["jvm"] = int(entry.name)
        self._began: dict[str, float] = {}
        self.per_batch: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        used = {name: cpu_seconds([pid]) for name, pid in self.pids.items()}
        return {name: seconds for name, seconds in used.items() if seconds is not None}

    def start(self) -> None:
        """Count from now."""
        self._began = self._now()

    def stop(self, *, batches: int) -> None:
        """Stop counting; ``per_batch`` holds each process's CPU seconds per batch."""
        now = self._now()
        self.per_batch = {
            name: (now[name] - self._began[name]) / max(batches, 1)
            for name in now
            if name in self._began
        }

    def describe(self) -> str:
        """One line: CPU seconds per batch by process, and the floor they set on 2 cores."""
        if not self.per_batch:
            return "CPU per batch: n/a"
        total = sum(self.per_batch.values())
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.per_batch.items())
        cores = os.cpu_count() or 1
        return (
            f"CPU s/batch: {parts} = {total:.2f} (at least {total / cores:.2f} s/batch "
            f"on {cores} cores, however well they overlap)"
        )


def append_to(path: Path) -> Callable[[Any, int], None]:
    def sink(df: Any, batch_id: int) -> None:
        write_deltalake(str(path), df.toArrow(), mode="append")

    return sink


def dropdup_to(path: Path) -> Callable[[Any, int], None]:
    def sink(df: Any, batch_id: int) -> None:
        write_deltalake(str(path), df.dropDuplicates([KEY]).toArrow(), mode="append")

    return sink


def merge_into(path: Path) -> Callable[[Any, int], None]:
    def sink(df: Any, batch_id: int) -> None:
        source = df.dropDuplicates([KEY]).toArrow()
        (
            DeltaTable(str(path))
            .merge(source, predicate=f"t.{KEY} = s.{KEY}", source_alias="s", target_alias="t")
            .when_not_matched_insert_all()
            .execute()
        )

    return sink


def seed_table(path: Path, ledger_keys: int) -> None:
    """A plain 1M-row orders table for the MERGE baseline (same keys as the ledger)."""
    chunk = 500_000
    rng = np.random.default_rng(5)
    for start in range(0, ledger_keys, chunk):
        n = min(chunk, ledger_keys - start)
        write_deltalake(
            str(path),
            pa.table(
                {
                    KEY: key_strings(start, n),
                    "amount": pa.array(rng.uniform(1, 500, size=n)),
                    "customer": pa.array([f"C{i % 997}" for i in range(n)], pa.string()),
                    "ts": pa.array(
                        np.full(n, np.datetime64("2024-04-30T10:00:00", "us")),
                        pa.timestamp("us", tz="UTC"),
                    ),
                }
            ),
            mode="append",
        )


class DecoratedSink:
    """The decorated Delta sink, timing its steps and, inside the commit, the ledger MERGE."""

    def __init__(self, sink: ExactlyOnce) -> None:
        self.sink = sink
        self.steps: dict[str, list[float]] = {}
        self.merges: list[float] = []
        ledger = sink.dedup.ledger
        self._ledger_commit = ledger.commit
        ledger.commit = self._timed_ledger_commit  # type: ignore[method-assign]

    def _timed_ledger_commit(self, *args: Any, **kwargs: Any) -> Any:
        # The rows and their done-record in one MERGE; the rest of the commit step
        # updates the Redis index.
        started = time.perf_counter()
        try:
            return self._ledger_commit(*args, **kwargs)
        finally:
            self.merges.append(time.perf_counter() - started)

    def __call__(self, df: Any, batch_id: int) -> None:
        outcome = self.sink.process(df, batch_id)
        for step, seconds in outcome.timings.items():
            self.steps.setdefault(step, []).append(seconds)

    def print_steps(self) -> None:
        """Median seconds per step, after the first batch."""
        if not self.steps:
            return
        steps = ", ".join(f"{s} {statistics.median(v[1:] or v):.3f}" for s, v in self.steps.items())
        merge = statistics.median(self.merges[1:] or self.merges) if self.merges else 0.0
        print(
            f"             inside the decorator (median s): {steps} "
            f"(of the commit: ledger MERGE {merge:.3f})",
            flush=True,
        )


def print_ratios(rounds: list[dict[str, float]]) -> None:
    """The ratios to the plain append (per round, then their median), and the two targets."""
    names = list(rounds[0])
    print(
        f"\nper-batch time (median of {len(rounds)} round(s)), ratio to the plain delta-rs "
        "append of the same round:"
    )
    for name in names:
        seconds = [r[name] for r in rounds]
        ratios = [r[name] / r["plain"] for r in rounds]
        spread = ", ".join(f"{x:.2f}x" for x in ratios)
        print(
            f"  {name:<10} {statistics.median(seconds):7.3f} s   "
            f"{statistics.median(ratios):5.2f}x   (rounds: {spread})"
        )
    if "decorated" not in names or "watermark" not in names:
        return
    ratio = statistics.median(r["decorated"] / r["plain"] for r in rounds)
    within = sum(r["decorated"] <= 2 * r["plain"] for r in rounds)
    faster = sum(r["decorated"] < r["watermark"] for r in rounds)
    decorated_t = statistics.median(r["decorated"] for r in rounds)
    watermark_t = statistics.median(r["watermark"] for r in rounds)
    print(
        f"\ntargets: decorated <= 2x plain: {ratio:.2f}x "
        f"[{'met' if ratio <= 2 else 'NOT met'}; held in {within} of {len(rounds)} rounds]; "
        f"decorated faster than dropDuplicatesWithinWatermark: {decorated_t:.3f} s vs "
        f"{watermark_t:.3f} s [{'met' if decorated_t < watermark_t else 'NOT met'}; "
        f"held in {faster} of {len(rounds)} rounds]"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--ledger-keys", type=int, default=1_000_000)
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of every variant (>= 1)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument(
        "--only", help="comma-separated variants to run (plain is always run, as the baseline)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: must be at least 1")

    root = Path(tempfile.mkdtemp(prefix="idem-bench-spark-"))
    server = RedisServer()
    server.start()
    try:
        started = time.monotonic()
        for r in range(args.rounds):
            write_batches(
                root / f"in-{r}",
                rows=args.rows,
                batches=args.batches,
                ledger_keys=args.ledger_keys,
                first=r * args.batches,
            )
        sink_table = root / "decorated"
        info = build_ledger(str(sink_table), args.ledger_keys, group="bench", buckets=16)
        seed_table(root / "merge", args.ledger_keys)
        print(
            f"{args.rounds} round(s) of {args.batches} batches of {args.rows} rows; ledger/sink "
            f"table with {info.keys} keys ({info.files} files); set up in "
            f"{time.monotonic() - started:.0f} s",
            flush=True,
        )
        spark = local_session("idem-bench")
        config = IdemConfig(
            group="bench", redis_url=server.url, data_dir=str(root / "idem"), buckets=16
        )
        decorated = DecoratedSink(
            ExactlyOnce(
                None, config=config, key=KEY, client=server.client(), sink_table=str(sink_table)
            )
        )

        variants: list[tuple[str, Callable[[Any, int], None], bool]] = [
            ("plain", append_to(root / "plain"), False),
            ("decorated", decorated, False),
            ("merge", merge_into(root / "merge"), False),
            ("dropdup", dropdup_to(root / "dropdup"), False),
            ("watermark", append_to(root / "watermark"), True),
        ]
        if args.only:
            wanted = {"plain", *args.only.split(",")}
            variants = [v for v in variants if v[0] in wanted]
        rounds: list[dict[str, float]] = []
        for r in range(args.rounds):
            print(f"round {r + 1} of {args.rounds}", flush=True)
            results: dict[str, float] = {}
            for name, sink, watermark in variants:
                cpu = CpuMeter(server.pid)
                times = run_query(
                    spark,
                    root / f"in-{r}",
                    root / f"ck-{name}-{r}",
                    sink,
                    watermark=watermark,
                    cpu=cpu,
                )
                steady = times[1:] or times  # batch 0 pays for the JIT, the Redis index, caches
                results[name] = statistics.median(steady)
                print(
                    f"  {name:<10} median {results[name]:.3f} s/batch "
                    f"(first {times[0]:.2f} s; all: {', '.join(f'{t:.2f}' for t in times)})\n"
                    f"             {cpu.describe()}",
                    flush=True,
                )
                if name == "decorated":
                    decorated.print_steps()
            rounds.append(results)
        if "decorated" in rounds[0]:
            counts = read_table(DeltaTable(str(sink_table)), ["key"]).num_rows
            per_round = args.batches * (args.rows - 2 * max(1, args.rows // 100))
            expected = info.keys + args.rounds * per_round
            print(f"decorated sink table: {counts} rows (expected {expected}: each key once)")
        print_ratios(rounds)
    finally:
        server.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
