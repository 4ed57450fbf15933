"""idem's Delta sink per micro-batch, on each ledger engine, against what users do without it.

    python bench/spark_batch.py            # 100k- and 1M-row batches; tables of 1M and 10M keys
    python bench/spark_batch.py --quick    # tiny sizes: a smoke run of every variant
    python bench/spark_batch.py --rows 100000 --table-keys 1000000 --masters 'local[2]'

One stream per batch size (parquet files read with ``maxFilesPerTrigger=1``, one
file per micro-batch) is written into a sink table that already holds
``--table-keys`` keys, five ways, each its own streaming query over the same files:

  idem/delta-spark  ``idem.spark.delta_sink`` with ``engine=delta-spark``
  idem/delta-rs     ``idem.spark.delta_sink`` with ``engine=delta-rs``
  append            a plain Delta append with ``txnAppId``/``txnVersion`` (no dedup:
                    redeliveries land twice; the floor a sink can reach)
  merge             the canonical dedup: the batch without its in-batch repeats, then
                    ``MERGE INTO t USING batch s ON t.key = s.key WHEN NOT MATCHED
                    THEN INSERT *`` (delta-spark, in ``foreachBatch``)
  watermark         ``withWatermark("ts", "10 minutes")`` and
                    ``dropDuplicatesWithinWatermark([key])``, then the same append

Every batch holds ``--duplicates`` (default 30 %) redelivered rows, in equal
parts: repeats of a key within the batch, keys of the previous batch, and keys
the table held before the stream started. A redelivered row carries its
original payload and event time. idem's table is its own ledger, so it is
pre-filled as a ledger (its rows' fingerprints are not those of the stream's
payloads: the run uses ``mismatch_policy=accept``); the other variants'
tables hold the same keys as plain rows.

Per variant: each batch's ``triggerExecution`` (read, plan, sink, commit) with
its median over the batches after the first (which pays for the JIT and, for
idem, for loading the table's keys into Redis); the driver's CPU per batch
(this process and its children: the JVM, Spark's Python workers) and
redis-server's; the driver's peak memory (Python RSS + JVM heap used); for
idem, its steps (``BatchOutcome.timings``) and its per-key work: the claim and
verdict steps' time per row. Each ``--masters`` entry is its own driver
process; the masters after the first run the idem variants only, for the
per-key work's scaling.

Ratios, each against the same table and batch size: merge / idem (target >= 3x
at 10M keys, growing with the table), watermark / idem (>= 1x), idem / append
(<= 2x), and idem's per-key work on local[1] / local[2] (>= 1.6x).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import write_deltalake

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _ledger_fixture import _MULTIPLIER, FRESH_START, build_ledger  # noqa: E402
from _spark import MIB, CpuMeter, delta_session, driver_peak  # noqa: E402

from idem.config import IdemConfig, LedgerEngine, MismatchPolicy  # noqa: E402
from idem.redis_server import RedisServer  # noqa: E402

KEY = "order_id"
IDEM_VARIANTS = ("idem/delta-spark", "idem/delta-rs")
VARIANTS = (*IDEM_VARIANTS, "append", "merge", "watermark")
PER_KEY_STEPS = ("claim", "verdict", "verdicts")
"""Steps of ``BatchOutcome.timings`` that are idem's per-key work (those present count)."""
EPOCH = np.datetime64("2024-05-01T10:00:00", "s")
PREFILL_EPOCH = np.datetime64("2024-04-30T10:00:00", "s")


# -- the data ---------------------------------------------------------------------------------


def keys_of(numbers: np.ndarray) -> pa.Array:
    """The business keys of key numbers (the ledger fixture's numbering)."""
    ids = (numbers.astype(np.uint64) * np.uint64(_MULTIPLIER)) % np.uint64(1 << 40)
    return pc.binary_join_element_wise("ORDER_", pa.array(ids).cast(pa.string()), "")


def payload(numbers: np.ndarray, origin: np.ndarray) -> dict[str, pa.Array]:
    """The rows of key numbers, first sent in batch ``origin`` (-1: before the stream):
    a redelivered row has the payload and event time of its first delivery."""
    seconds = np.where(origin < 0, numbers % 3600, origin * 60 + numbers % 59)
    epoch = np.where(origin < 0, PREFILL_EPOCH, EPOCH)
    times = (epoch + seconds.astype("timedelta64[s]")).astype("datetime64[us]")
    customers = pc.binary_join_element_wise("C", pa.array(numbers % 997).cast(pa.string()), "")
    return {
        KEY: keys_of(numbers),
        "amount": pa.array(1 + (numbers % 49_999) / 100.0),
        "customer": customers,
        "ts": pa.array(times, pa.timestamp("us", tz="UTC")),
    }


def prefill_columns(start: int, count: int) -> dict[str, pa.Array]:
    """The user columns of the table's pre-filled keys (numbers ``start`` onwards)."""
    numbers = np.arange(start, start + count, dtype=np.int64)
    return payload(numbers, np.full(count, -1))


def write_stream(
    directory: Path, *, rows: int, batches: int, duplicates: float, old_keys: int, offset: int
) -> int:
    """``batches`` parquet files of ``rows`` rows; return the new keys per batch."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(offset % 1000 + 3)
    redelivered = int(rows * duplicates)
    third = redelivered // 3
    new = rows - redelivered
    first = FRESH_START + offset
    for b in range(batches):
        fresh = np.arange(first + b * new, first + (b + 1) * new, dtype=np.int64)
        repeats = rng.choice(fresh, size=third)
        if b:
            previous = rng.choice(fresh - new, size=third)
        else:
            previous = rng.integers(0, old_keys, size=third)
        old = rng.integers(0, old_keys, size=redelivered - 2 * third)
        numbers = np.concatenate([fresh, repeats, previous, old])
        origin = np.concatenate(
            [
                np.full(new + third, b),
                np.full(third, b - 1 if b else -1),
                np.full(len(old), -1),
            ]
        )
        order = rng.permutation(rows)
        table = pa.table(payload(numbers[order], origin[order]))
        pq.write_table(table, directory / f"batch-{b:03d}.parquet")
    return new


def write_plain_table(path: Path, keys: int) -> None:
    """The baselines' table: the same keys and columns as idem's, no ledger columns."""
    chunk = 1_000_000
    for start in range(0, keys, chunk):
        count = min(chunk, keys - start)
        write_deltalake(str(path), pa.table(prefill_columns(start, count)), mode="append")


def linked_copy(source: Path, target: Path) -> Path:
    """A hard-link copy of a local table: Delta never rewrites a file, so runs stay apart."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, copy_function=os.link)
    return target


# -- the sinks ---------------------------------------------------------------------------------

Sink = Callable[[Any, int], None]


def append_to(path: Path, app_id: str) -> Sink:
    """A Delta append that Spark's replay of a batch does not repeat (txnAppId/txnVersion)."""

    def sink(df: Any, batch_id: int) -> None:
        (
            df.write.format("delta")
            .mode("append")
            .option("txnAppId", app_id)
            .option("txnVersion", batch_id)
            .save(str(path))
        )

    return sink


def merge_into(path: Path) -> Sink:
    """The insert-only MERGE on the key, of the batch without its in-batch repeats."""

    def sink(df: Any, batch_id: int) -> None:
        df.dropDuplicates([KEY]).createOrReplaceTempView("batch")
        df.sparkSession.sql(
            f"MERGE INTO delta.`{path}` t USING batch s ON t.{KEY} = s.{KEY} "
            "WHEN NOT MATCHED THEN INSERT *"
        )

    return sink


class IdemSink:
    """``idem.spark.delta_sink`` on one engine, keeping each batch's outcome."""

    def __init__(self, path: Path, engine: str, server: RedisServer, data_dir: Path) -> None:
        from idem.spark import delta_sink

        config = IdemConfig(
            group="bench",
            redis_url=server.url,
            data_dir=str(data_dir),
            buckets=16,
            engine=LedgerEngine(engine),
            mismatch_policy=MismatchPolicy.ACCEPT,
        )
        self.sink = delta_sink(str(path), key=KEY, config=config, client=server.client())
        self.outcomes: list[Any] = []

    def __call__(self, df: Any, batch_id: int) -> None:
        self.sink(df, batch_id)
        self.outcomes.append(self.sink.last_outcome)


# -- where the time goes: Spark's stages ---------------------------------------------------------

PROFILE_STAGES = 6
"""Stages (by call site) printed per variant, the costliest first."""


def completed_stages(spark: Any) -> list[dict[str, Any]]:
    """The driver's completed stages, from its own status API (the Spark UI on loopback)."""
    url = spark.sparkContext.uiWebUrl
    if not url:
        return []
    port = urllib.parse.urlsplit(url).port
    app = spark.sparkContext.applicationId
    query = f"http://127.0.0.1:{port}/api/v1/applications/{app}/stages?status=complete"
    with urllib.request.urlopen(query) as reply:
        return list(json.load(reply))


def _ms(stamp: str) -> float:
    """A status API time (``2026-01-01T10:00:00.123GMT``) in epoch milliseconds."""
    parsed = dt.datetime.strptime(stamp.removesuffix("GMT"), "%Y-%m-%dT%H:%M:%S.%f")
    return parsed.replace(tzinfo=dt.UTC).timestamp() * 1000


def stage_profile(stages: list[dict[str, Any]], after: int, batches: int) -> list[dict[str, Any]]:
    """The stages after stage id ``after`` summed by idem step (the jobs' description)
    and call site, per batch, costliest first: wall time (submission to completion),
    the tasks' run time and their CPU time."""
    by: dict[str, dict[str, Any]] = {}
    for stage in stages:
        if stage["stageId"] <= after or "completionTime" not in stage:
            continue
        step = " ".join((stage.get("description") or "").split())
        step = re.sub(r"id = \S+ runId = \S+ batch = \d+", "stream batch", step)
        step = re.sub(r"idem \S+ batch \d+: ", "", step)
        step = re.sub(r"version: \d+", "version: N", step)
        site = (f"[{step}] " if step else "") + stage["name"].replace(str(HERE.parent) + "/", "")
        entry = by.setdefault(site, {"site": site, "wall": 0.0, "run": 0.0, "cpu": 0.0})
        entry["wall"] += (_ms(stage["completionTime"]) - _ms(stage["submissionTime"])) / 1000
        entry["run"] += stage["executorRunTime"] / 1000
        entry["cpu"] += stage["executorCpuTime"] / 1e9
    per_batch = [
        {**e, "wall": e["wall"] / batches, "run": e["run"] / batches, "cpu": e["cpu"] / batches}
        for e in by.values()
    ]
    return sorted(per_batch, key=lambda e: -e["wall"])[:PROFILE_STAGES]


# -- one variant -------------------------------------------------------------------------------


def run_query(spark: Any, source: Path, checkpoint: Path, sink: Sink, *, watermark: bool) -> Any:
    """Stream ``source`` through ``sink``, one file per batch, until it is all read."""
    schema = spark.read.parquet(str(source)).schema
    stream = spark.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(str(source))
    if watermark:
        stream = stream.withWatermark("ts", "10 minutes").dropDuplicatesWithinWatermark([KEY])
    query = (
        stream.writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return query


def run_variant(
    spark: Any, spec: Mapping[str, Any], server: RedisServer, *, variant: str, keys: int, rows: int
) -> dict[str, Any]:
    """One variant over the stream of ``rows``-row batches into the ``keys``-key table."""
    root = Path(spec["root"])
    master = spec["master"]
    name = f"{variant.replace('/', '-')}-{keys}-{rows}-{''.join(c for c in master if c.isalnum())}"
    base = root / (f"ledger-{keys}" if variant in IDEM_VARIANTS else f"plain-{keys}")
    table = linked_copy(base, root / "run" / name)
    sink: Sink
    idem: IdemSink | None = None
    if variant in IDEM_VARIANTS:
        # each idem run loads the table's keys afresh; a flush of millions of keys takes
        # longer than redis-py's default 5 s read time-out
        server.client(socket_timeout=None).flushall()
        idem = IdemSink(table, variant.split("/")[1], server, root / "run" / f"{name}-idem")
        sink = idem
    elif variant == "merge":
        sink = merge_into(table)
    else:
        sink = append_to(table, name)

    cpu = CpuMeter(server.pid if idem else None)
    began = [0.0]

    last_stage = [0]

    def counted(df: Any, batch_id: int) -> None:
        if batch_id == 1:  # batch 0 pays for warm-ups: count from the second batch on
            cpu.start()
            began[0] = time.perf_counter()
            last_stage[0] = max((st["stageId"] for st in completed_stages(spark)), default=0)
        sink(df, batch_id)

    with driver_peak(spark) as peak:
        query = run_query(
            spark,
            root / f"in-{rows}",
            root / "run" / f"{name}-ck",
            counted,
            watermark=variant == "watermark",
        )
    cpu.stop()
    if idem is not None:
        idem.sink.close()
    # Only batches that read rows: the watermark query ends with a batch that only moves
    # the watermark on.
    times = [
        p["durationMs"]["triggerExecution"] / 1000
        for p in query.recentProgress
        if p["numInputRows"]
    ]
    counted_batches = max(len(times) - 1, 1)
    result: dict[str, Any] = {
        "master": master,
        "variant": variant,
        "keys": keys,
        "rows": rows,
        "times": times,
        "median": statistics.median(times[1:] or times),
        "cpu": {k: v / counted_batches for k, v in cpu.seconds.items()},
        "peak": peak,
        "stages": stage_profile(completed_stages(spark), last_stage[0], counted_batches),
        "table_rows": spark.read.format("delta").load(str(table)).count(),
        "each_key_once": keys + spec["batches"] * (rows - int(rows * spec["duplicates"])),
    }
    if idem is not None:
        done = [o for o in idem.outcomes[1:] or idem.outcomes if o is not None and o.messages]
        steps: dict[str, list[float]] = {}
        for outcome in done:
            for step, seconds in outcome.timings.items():
                steps.setdefault(step, []).append(seconds)
        result["steps"] = {s: statistics.median(v) for s, v in steps.items()}
        per_key = [
            sum(o.timings.get(s, 0.0) for s in PER_KEY_STEPS) / o.messages * 1e6 for o in done
        ]
        result["per_key_us"] = statistics.median(per_key) if per_key else None
    shutil.rmtree(table, ignore_errors=True)
    return result


def describe(result: Mapping[str, Any]) -> str:
    """The lines printed for one variant's run."""
    peak = result["peak"]
    cpu = ", ".join(f"{k} {v:.2f}" for k, v in result["cpu"].items())
    lines = [
        f"  {result['variant']:<17} {result['median']:7.3f} s/batch "
        f"(all: {', '.join(f'{t:.2f}' for t in result['times'])}); CPU s/batch: {cpu}; "
        f"driver peak {peak['driver'] / MIB:.0f} MiB (Python {peak['python'] / MIB:.0f} + "
        f"JVM heap {peak['jvm_heap'] / MIB:.0f}); table rows {result['table_rows']} "
        f"(each key once: {result['each_key_once']})"
    ]
    if "steps" in result:
        steps = ", ".join(f"{s} {v:.3f}" for s, v in result["steps"].items())
        per_key = result["per_key_us"]
        shown = "n/a" if per_key is None else f"{per_key:.2f} us"
        lines.append(f"{'':20}steps (median s): {steps}; per-key work {shown}/row")
    for stage in result.get("stages", []):
        lines.append(
            f"{'':20}stage {stage['wall']:7.3f} s/batch (tasks: run {stage['run']:.3f} s, "
            f"CPU {stage['cpu']:.3f} s): {stage['site']}"
        )
    return "\n".join(lines)


def worker(spec_path: Path, out: Path) -> int:
    """The driver process of one master: every configuration and variant, results to ``out``."""
    spec = json.loads(spec_path.read_text())
    # The UI's status API (on loopback) gives the stages' times: where a batch's time goes.
    spark = delta_session(spec["master"], {"spark.ui.enabled": "true"})
    server = RedisServer()
    server.start()
    results: list[dict[str, Any]] = []
    try:
        for keys in spec["table_keys"]:
            for rows in spec["rows"]:
                print(f"{spec['master']}: table of {keys} keys, batches of {rows} rows", flush=True)
                for variant in spec["variants"]:
                    try:
                        result = run_variant(
                            spark, spec, server, variant=variant, keys=keys, rows=rows
                        )
                    except Exception as exc:  # one variant's failure is reported, not fatal
                        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                        print(f"  {variant:<17} FAILED: {type(exc).__name__}: {first}", flush=True)
                        frames = traceback.extract_tb(exc.__traceback__)
                        # where it failed: idem's and the benchmark's frames, then the innermost
                        ours = [f for f in frames[:-2] if "site-packages" not in f.filename]
                        for frame in ours + frames[-2:]:
                            print(f"{'':20}at {frame.filename}:{frame.lineno} {frame.name}")
                        continue
                    results.append(result)
                    print(describe(result), flush=True)
                    out.write_text(json.dumps(results))
    finally:
        server.stop()
        spark.stop()
    return 0


# -- the run -----------------------------------------------------------------------------------


def ratio_line(label: str, value: float | None, target: str, met: bool | None) -> str:
    """One ratio with its target and whether it was met."""
    if value is None:
        return f"  {label}: n/a"
    verdict = "" if met is None else (": met" if met else ": NOT met")
    return f"  {label}: {value:.2f}x [target {target}{verdict}]"


def median_of(result: Mapping[str, Any] | None) -> float | None:
    """A run's median seconds per batch (``None``: not run, or failed)."""
    return None if result is None else float(result["median"])


def print_ratios(results: list[dict[str, Any]], masters: list[str]) -> None:
    """The targets' ratios per table size and batch size."""
    by = {(r["master"], r["variant"], r["keys"], r["rows"]): r for r in results}
    first = masters[0]
    sizes = sorted({r["keys"] for r in results})
    batch_sizes = sorted({r["rows"] for r in results})
    print("\nratios (median s/batch of the same table and batch size):")
    for engine in IDEM_VARIANTS:
        print(f"{engine}:")
        for rows in batch_sizes:
            merge_ratios: list[float] = []
            for keys in sizes:
                ours = by.get((first, engine, keys, rows))
                if ours is None:
                    continue
                tag = f"{keys:>10,} keys, {rows:>9,} rows"

                merge, watermark, append = (
                    median_of(by.get((first, variant, keys, rows)))
                    for variant in ("merge", "watermark", "append")
                )
                mine = float(ours["median"])
                if merge is not None:
                    merge_ratios.append(merge / mine)
                big = keys == sizes[-1]
                print(
                    ratio_line(
                        f"{tag}: merge / idem",
                        None if merge is None else merge / mine,
                        f">= 3x at the largest table ({sizes[-1]:,} keys)",
                        None if merge is None or not big else merge / mine >= 3,
                    )
                )
                print(
                    ratio_line(
                        f"{tag}: watermark / idem",
                        None if watermark is None else watermark / mine,
                        ">= 1x",
                        None if watermark is None else watermark / mine >= 1,
                    )
                )
                print(
                    ratio_line(
                        f"{tag}: idem / append",
                        None if append is None else mine / append,
                        "<= 2x",
                        None if append is None else mine / append <= 2,
                    )
                )
                for master in masters[1:]:
                    slow = by.get((master, engine, keys, rows))
                    fast_us, slow_us = ours.get("per_key_us"), (slow or {}).get("per_key_us")
                    value = None if not fast_us or not slow_us else slow_us / fast_us
                    print(
                        ratio_line(
                            f"{tag}: per-key work {master} / {first}",
                            value,
                            ">= 1.6x",
                            None if value is None else value >= 1.6,
                        )
                    )
            if len(merge_ratios) > 1:
                widening = all(b > a for a, b in itertools.pairwise(merge_ratios))
                shown = " -> ".join(f"{r:.2f}x" for r in merge_ratios)
                print(
                    f"  {rows:>9,} rows: merge / idem as the table grows: {shown} "
                    f"[target: widening:{' met' if widening else ' NOT met'}]"
                )


def prepare(root: Path, args: argparse.Namespace) -> None:
    """The streams and the pre-filled tables (no Spark)."""
    started = time.monotonic()
    for index, rows in enumerate(args.rows):
        write_stream(
            root / f"in-{rows}",
            rows=rows,
            batches=args.batches,
            duplicates=args.duplicates,
            old_keys=min(args.table_keys),
            offset=index << 34,
        )
    for keys in args.table_keys:
        build_ledger(str(root / f"ledger-{keys}"), keys, group="bench", extra=prefill_columns)
        write_plain_table(root / f"plain-{keys}", keys)
    print(f"streams and tables written in {time.monotonic() - started:.0f} s", flush=True)


def sizes(text: str) -> list[int]:
    """A comma-separated list of counts."""
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=sizes, default=[100_000, 1_000_000], help="rows per batch")
    parser.add_argument(
        "--table-keys", type=sizes, default=[1_000_000, 10_000_000], help="keys in the table"
    )
    parser.add_argument("--batches", type=int, default=5, help="per stream (first: warm-up)")
    parser.add_argument("--duplicates", type=float, default=0.3, help="redelivered share of rows")
    parser.add_argument("--masters", default="local[2],local[1]", help="one driver process each")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker, args.out)
    if args.quick:
        args.rows, args.table_keys, args.batches = [3_000], [20_000, 60_000], 3
    if args.batches < 2:
        parser.error("--batches: at least 2 (the first is a warm-up)")
    if not 0 <= args.duplicates < 1:
        parser.error("--duplicates: a share from 0 to below 1")
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    masters = [m for m in args.masters.split(",") if m]
    args.table_keys.sort()

    root = Path(tempfile.mkdtemp(prefix="idem-bench-spark-"))
    results: list[dict[str, Any]] = []
    try:
        prepare(root, args)
        print(
            f"{args.batches} batches per stream (the first is a warm-up), "
            f"{args.duplicates:.0%} redelivered rows; cores: {os.cpu_count()}",
            flush=True,
        )
        for index, master in enumerate(masters):
            spec = {
                "root": str(root),
                "master": master,
                "rows": args.rows,
                "table_keys": args.table_keys,
                "batches": args.batches,
                "duplicates": args.duplicates,
                "variants": variants if index == 0 else [v for v in variants if v in IDEM_VARIANTS],
            }
            spec_path, out = root / f"spec-{index}.json", root / f"result-{index}.json"
            spec_path.write_text(json.dumps(spec))
            command = [sys.executable, __file__, "--worker", str(spec_path), "--out", str(out)]
            done = subprocess.run(command, check=False)
            if done.returncode:
                print(f"{master}: the driver process exited with {done.returncode}", flush=True)
            if out.exists():
                results += json.loads(out.read_text())
        if results:
            print_ratios(results, masters)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
