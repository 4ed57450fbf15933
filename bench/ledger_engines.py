"""What one batch commit costs on each ledger engine, against ledgers of 1M and 10M keys.

    python bench/ledger_engines.py                    # 1M and 10M keys, 100k-key batches
    python bench/ledger_engines.py --sizes 1000000 --trials 3

Each ledger is built once by ``_ledger_fixture.build_ledger`` (past days
compacted to one file per partition, today's batches in their own files, none
of them inside the match horizon) and every timed commit goes into a fresh
hard-link copy of it, so each commit meets the same table. Measured, per
commit of a batch of new keys:

- delta-rs, index mode: the checked append (``match_after_version`` = the
  table's version, as a claim whose Redis index is current passes it);
- delta-rs, MERGE: the insert-only MERGE restricted to the match horizon
  (``match_since_ms`` without ``match_after_version``);
- delta-spark, index mode: its checked append (Delta's transaction API, the
  rows written by Spark), and its insert-only MERGE restricted to the match
  horizon, in a local Spark session (``--master``, default ``local[2]``) with
  Delta's jars.

Delta's jars are looked up as the tests do (``tests/jvm/fetch.sh`` fills the
cache). One untimed delta-spark commit warms the JVM up first. Median seconds
per commit and ratios are printed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from _ledger_fixture import batch_rows, build_ledger, fresh_keys  # noqa: E402
from jvm_jars import delta_spark_conf, spark_jars  # noqa: E402

from idem.ledger import DeltaLedger, Ledger  # noqa: E402
from idem.spark.session import local_session  # noqa: E402

MATCH_HORIZON_MS = 10 * 60_000  # 2 x the default 5-minute lease, as idem.dedup passes
WINDOW_MS = 7 * 86_400_000
ENGINES = ("delta-rs append", "delta-rs merge", "delta-spark append", "delta-spark merge")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def linked_copy(source: str, target: str) -> str:
    """A hard-link copy of a local table: Delta never rewrites a file, so trials stay apart."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, copy_function=os.link)
    return target


def commit_seconds(ledger: Ledger, engine: str, n_keys: int, round_: int) -> float:
    """One commit of ``n_keys`` new keys, timed from the call to its return."""
    rows = batch_rows(fresh_keys(n_keys, round_=round_))
    after = ledger.version() if engine.endswith(" append") else None
    started = time.perf_counter()
    result = ledger.commit(
        rows,
        app_id="bench",
        txn_version=round_,
        match_since_ms=_now_ms() - MATCH_HORIZON_MS,
        match_after_version=after,
    )
    seconds = time.perf_counter() - started
    assert result.inserted == n_keys, result
    assert not result.already_present, result
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,10000000", help="ledger sizes, comma-separated")
    parser.add_argument("--keys", type=int, default=100_000, help="keys per batch")
    parser.add_argument("--trials", type=int, default=2, help="timed commits per engine and size")
    parser.add_argument("--master", default=None, help="Spark master (default local[2])")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    jars = spark_jars()
    if jars is None:
        print("no Delta jars in the cache: run bash tests/jvm/fetch.sh", file=sys.stderr)
        return 2
    started = time.perf_counter()
    spark = local_session("idem-bench", master=args.master, conf=delta_spark_conf(jars))
    print(f"Spark session with Delta: {time.perf_counter() - started:.1f}s")
    from idem.ledger.spark_engine import SparkDeltaLedger

    makers: dict[str, Callable[[str], Ledger]] = {
        "delta-rs append": lambda p: DeltaLedger(p, dedup_window_ms=WINDOW_MS),
        "delta-rs merge": lambda p: DeltaLedger(p, dedup_window_ms=WINDOW_MS),
        "delta-spark append": lambda p: SparkDeltaLedger(spark, p, dedup_window_ms=WINDOW_MS),
        "delta-spark merge": lambda p: SparkDeltaLedger(spark, p, dedup_window_ms=WINDOW_MS),
    }
    medians: dict[tuple[str, int], float] = {}
    root = Path(tempfile.mkdtemp(prefix="idem-engines-"))
    try:
        for size in sizes:
            source = str(root / f"ledger-{size}")
            started = time.perf_counter()
            info = build_ledger(source, size)
            os.sync()
            print(
                f"\n== {size:,} keys: built in {time.perf_counter() - started:.1f}s "
                f"({info.files} files, version {info.version})"
            )
            trial = str(root / "trial")
            if size == sizes[0]:  # the JVM's first MERGE compiles most of what it runs
                warm = makers["delta-spark merge"](linked_copy(source, trial))
                took = commit_seconds(warm, "delta-spark merge", args.keys, 999)
                print(f"  delta-spark warm-up commit (not counted): {took:.2f}s")
            for engine in ENGINES:
                seconds = [
                    commit_seconds(makers[engine](linked_copy(source, trial)), engine, args.keys, t)
                    for t in range(args.trials)
                ]
                medians[engine, size] = statistics.median(seconds)
                shown = ", ".join(f"{s:.2f}" for s in seconds)
                print(f"  {engine:<18} {medians[engine, size]:7.2f}s per commit ({shown})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
        spark.stop()

    print(f"\nSeconds per commit of {args.keys:,} new keys (median of {args.trials}):")
    print(f"  {'ledger keys':>12} " + " ".join(f"{e:>18}" for e in ENGINES))
    for size in sizes:
        print(f"  {size:>12,} " + " ".join(f"{medians[e, size]:>18.2f}" for e in ENGINES))
    print("Ratios:")
    for size in sizes:
        spark_s = medians["delta-spark merge", size]
        print(
            f"  {size:>12,}: delta-spark / delta-rs append "
            f"{spark_s / medians['delta-rs append', size]:.1f}x, "
            f"delta-spark / delta-rs merge {spark_s / medians['delta-rs merge', size]:.1f}x, "
            f"delta-spark merge / append "
            f"{spark_s / medians['delta-spark append', size]:.1f}x"
        )
    if len(sizes) > 1:
        big, small = sizes[-1], sizes[0]
        growth = ", ".join(f"{e} {medians[e, big] / medians[e, small]:.2f}x" for e in ENGINES)
        print(f"  {big:,} vs {small:,} keys: {growth}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
