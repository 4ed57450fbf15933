"""What the Delta ledger costs per batch, against ledgers of 100k / 1M / 10M keys.

    python bench/ledger_probe.py                      # 100k,1M,10M; ~3 minutes on 2 cores
    python bench/ledger_probe.py --sizes 100000,1000000 --rounds 5

Each ledger is built by ``_ledger_fixture.build_ledger`` (past days compacted to
one file per partition, today's rows in their own batch files). Measured:

- ``commit()`` of a batch of new keys (index mode: match since now - 10 min)
  into a fresh hard-link copy of the ledger, several trials (median); then
  several rounds into one copy, each round adding its batch to the horizon;
- ``version()`` (the per-batch check) against reloading / updating a DeltaTable;
- ``keys_added_since()`` of the last 1 and 3 versions;
- strict-mode lookups: ``existing()`` of a batch against the whole window;
- the baseline, a plain insert-only MERGE on (bucket, key), at the largest size.

Ratios are printed against the smallest ledger measured in the same run.
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

from deltalake import DeltaTable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _ledger_fixture import batch_rows, build_ledger, existing_keys, fresh_keys, plain_merge

from idem.ledger import DeltaLedger

MATCH_HORIZON_MS = 10 * 60_000  # 2 x the default 5-minute lease, as idem.dedup passes
WINDOW_MS = 7 * 86_400_000


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _timed(fn: Callable[[], object], repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def linked_copy(source: str, target: str) -> str:
    """A hard-link copy of a local table: Delta never rewrites a file, so trials stay apart."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target, copy_function=os.link)
    return target


def commit_once(path: str, n_keys: int, round_: int) -> tuple[float, int | None]:
    """One batch commit of fresh keys into the ledger at ``path``: (seconds, delta-rs scan ms)."""
    ledger = DeltaLedger(path, dedup_window_ms=WINDOW_MS)
    ledger.version()
    rows = batch_rows(fresh_keys(n_keys, round_=round_))
    started = time.perf_counter()
    result = ledger.commit(
        rows, app_id="probe", txn_version=round_, match_since_ms=_now_ms() - MATCH_HORIZON_MS
    )
    seconds = time.perf_counter() - started
    assert result.inserted == n_keys, result
    return seconds, result.scan_time_ms


def probe(root: Path, size: int, n_keys: int, trials: int, rounds: int) -> dict[str, float]:
    """Measure one ledger; returns the numbers the summary compares."""
    out: dict[str, float] = {}
    path = str(root / f"ledger-{size}")
    started = time.perf_counter()
    info = build_ledger(path, size)
    os.sync()  # let the kernel write the new files back before anything is timed
    print(
        f"\n== N={size:,}: built in {time.perf_counter() - started:.1f}s "
        f"({info.files} files, version {info.version}, {info.recent_keys:,} keys today)"
    )
    trial_path = str(root / "trial")
    commit_once(linked_copy(path, trial_path), n_keys, 999)  # warm-up, not timed
    timings = [commit_once(linked_copy(path, trial_path), n_keys, t) for t in range(trials)]
    seconds = [t for t, _ in timings]
    out["commit"] = statistics.median(seconds)
    print(
        f"  commit {n_keys:,} new keys (nothing in the horizon yet), {trials} trials: "
        f"median {out['commit']:.3f}s, best {min(seconds):.3f}s, "
        f"delta-rs scan {sorted(s for _, s in timings if s is not None)} ms"
    )

    linked_copy(path, trial_path)
    for round_ in range(rounds):
        took, scan = commit_once(trial_path, n_keys, 100 + round_)
        print(
            f"  round {round_}: {round_ * n_keys:>9,} keys already in the horizon: "
            f"{took:.3f}s (scan {scan} ms)"
        )
    ledger = DeltaLedger(trial_path, dedup_window_ms=WINDOW_MS)
    slipped = fresh_keys(n_keys, round_=100)[: n_keys // 100]
    mixed = batch_rows(slipped + fresh_keys(n_keys - len(slipped), round_=150))
    started = time.perf_counter()
    result = ledger.commit(
        mixed, app_id="probe", txn_version=150, match_since_ms=_now_ms() - MATCH_HORIZON_MS
    )
    took = time.perf_counter() - started
    assert len(result.already_present) == len(slipped), result
    print(f"  commit with {len(slipped):,} keys already present (slipped): {took:.3f}s")
    replay = batch_rows(fresh_keys(n_keys, round_=100))
    took = _timed(lambda: ledger.commit(replay, app_id="probe", txn_version=100, match_since_ms=0))
    print(f"  replayed batch (txn already committed): {took * 1000:.1f} ms")

    out.update(reads(ledger, trial_path, info.keys, n_keys))
    return out


def reads(ledger: DeltaLedger, path: str, size: int, n_keys: int) -> dict[str, float]:
    """The read side: version checks, catch-up, strict lookups, window rebuild."""
    out: dict[str, float] = {}
    calls = 2000
    per_call = _timed(lambda: [ledger.version() for _ in range(calls)]) / calls
    reload = _timed(lambda: DeltaTable(path).version(), repeat=3)
    table = DeltaTable(path)
    update = _timed(table.update_incremental, repeat=20)
    out["version_us"] = per_call * 1e6
    print(
        f"  version(): {per_call * 1e6:.1f} us/call   (DeltaTable() load "
        f"{reload * 1000:.1f} ms, update_incremental with nothing new {update * 1000:.2f} ms)"
    )

    current = ledger.version()
    for back in (1, 3):
        since = current - back
        found: list[int] = []

        def added(since: int = since, found: list[int] = found) -> None:
            changed = ledger.keys_added_since(since)
            assert changed is not None
            found.append(changed.keys.num_rows)

        took = _timed(added, repeat=3)
        out[f"added_since_{back}"] = took
        print(f"  keys_added_since(last {back} versions): {took:.3f}s for {found[-1]:,} keys")

    probe_keys = existing_keys(n_keys // 2, total=size) + fresh_keys(n_keys // 2, round_=50)
    hits: list[int] = []
    took = _timed(
        lambda: hits.append(len(ledger.existing(probe_keys, since_ms=_now_ms() - WINDOW_MS)))
    )
    print(
        f"  existing() of {len(probe_keys):,} keys over the 7-day window (strict mode): "
        f"{took:.3f}s ({hits[-1]:,} found)"
    )
    took = _timed(lambda: ledger.window(_now_ms() - WINDOW_MS))
    print(f"  window(7 days), all buckets (Redis rebuild read): {took:.3f}s")
    out["window"] = took
    return out


def baselines(root: Path, size: int, n_keys: int) -> dict[str, float]:
    """Plain insert-only MERGEs (no recency restriction) of fresh keys, each on a fresh copy."""
    out: dict[str, float] = {}
    for streamed in (False, True):
        path = linked_copy(str(root / f"ledger-{size}"), str(root / "trial"))
        rows = batch_rows(fresh_keys(n_keys, round_=200 + int(streamed)))
        took, metrics = plain_merge(path, rows, streamed_exec=streamed)
        label = "streamed" if streamed else "materialized"
        out[label] = took
        print(
            f"  plain MERGE ({label} source): {took:.3f}s "
            f"(delta-rs scan {metrics['scan_time_ms']} ms)"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="100000,1000000,10000000")
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="idem-ledger-probe-"))
    results: dict[int, dict[str, float]] = {}
    try:
        for size in sizes:
            results[size] = probe(root, size, args.keys, args.trials, args.rounds)
            if size == sizes[-1]:
                print(f"\n== Baseline at N={size:,}")
                results[size].update(baselines(root, size, args.keys))
            shutil.rmtree(root / f"ledger-{size}", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    base = results[sizes[0]]
    print(f"\n== Summary (ratios against N={sizes[0]:,}, same run)")
    for size, r in results.items():
        print(
            f"  N={size:>11,}  commit {r['commit']:.3f}s ({r['commit'] / base['commit']:.2f}x)"
            f"  version() {r['version_us']:.0f} us"
            f"  keys_added_since(1) {r['added_since_1']:.3f}s"
        )
    last = results[sizes[-1]]
    for label in ("materialized", "streamed"):
        print(
            f"  plain MERGE ({label}) at N={sizes[-1]:,} / commit = "
            f"{last[label] / last['commit']:.1f}x"
        )
    print("  targets: commit(10M) <= 1.2x commit(100k); plain MERGE >= 5x slower than commit")


if __name__ == "__main__":
    main()
