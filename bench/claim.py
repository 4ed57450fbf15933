"""Throughput of the dedup hot path, measured against baselines in the same run.

Part 1 — Redis (a private, real redis-server on a loopback port):
  * raw redis-py pipelined ``SET NX PX`` of 100k new keys (the baseline),
  * ``RedisHotStore.claim`` of 100k new keys (one Lua call per bucket chunk),
  * claim + complete of 100k new keys,
  printed as keys/second and as ratios to the baseline.
  Targets: claim >= 2x the baseline, claim+complete >= 1x.

Part 2 — ledger (real Delta tables under a temporary directory):
  per-batch dedup time of a 100k-key batch (catch-up check + claim + ledger
  commit + Redis complete) against ledgers of 100k, 1M and 10M keys, as a
  ratio to the 100k case, beside a plain insert-only delta-rs MERGE of the same
  batch into the same ledger.
  Targets: 10M <= 1.2x the 100k case; >= 5x faster than the plain MERGE at 10M.

    python bench/claim.py [--sizes 100000,1000000,10000000] [--keys 100000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from idem.clock import SYSTEM_CLOCK
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.hotstore import RedisHotStore
from idem.keys import group_by_bucket
from idem.redis_server import RedisServer


def _best(runs: list[float]) -> float:
    return min(runs)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_redis(server: RedisServer, n_keys: int, repeat: int) -> None:
    client = server.client()
    store = RedisHotStore(
        client,
        group="bench",
        buckets=16,
        lease_ms=300_000,
        completed_ttl_ms=7 * 86_400_000,
        clock=SYSTEM_CLOCK,
    )
    set_runs: list[float] = []
    claim_runs: list[float] = []
    both_runs: list[float] = []
    for round_ in range(repeat):
        client.flushall()
        keys = [f"ORDERID_{round_}_{i}" for i in range(n_keys)]

        def set_nx(keys: list[str] = keys) -> None:
            pipe = client.pipeline(transaction=False)
            for start in range(0, n_keys, 10_000):
                for key in keys[start : start + 10_000]:
                    pipe.set(f"raw:{key}", b"P", nx=True, px=300_000)
                pipe.execute()

        set_runs.append(_timed(set_nx))
        for bucket in range(16):
            store.index_completed(bucket, [], [], [], to_version=0, from_version=None)

        def claim(keys: list[str] = keys) -> None:
            grouped = group_by_bucket(keys, 16)
            store.claim(grouped, "bench:0", min_version=0)

        claim_runs.append(_timed(claim))
        client.flushall()
        for bucket in range(16):
            store.index_completed(bucket, [], [], [], to_version=0, from_version=None)

        def claim_complete(keys: list[str] = keys) -> None:
            grouped = group_by_bucket(keys, 16)
            result = store.claim(grouped, "bench:1", min_version=0)
            prints = dict.fromkeys(result.claimed, "")
            store.complete(grouped, "bench:1", prints, version=1)

        both_runs.append(_timed(claim_complete))

    base = n_keys / _best(set_runs)
    claim_rate = n_keys / _best(claim_runs)
    both_rate = n_keys / _best(both_runs)
    print(f"\n== Redis hot path, {n_keys:,} new keys, best of {repeat}")
    print(f"  pipelined SET NX PX (baseline)  {base:>10,.0f} keys/s   1.00x")
    print(
        f"  claim (Lua, per bucket)         {claim_rate:>10,.0f} keys/s   "
        f"{claim_rate / base:.2f}x   target >= 2x"
    )
    print(
        f"  claim + complete                {both_rate:>10,.0f} keys/s   "
        f"{both_rate / base:.2f}x   target >= 1x"
    )
    client.close()


def _used_memory(server: RedisServer) -> int:
    """Redis's ``used_memory`` in bytes (what its keys and structures take)."""
    return int(server.client().info("memory")["used_memory"])


def bench_ledger(server: RedisServer, sizes: list[int], n_keys: int, repeat: int) -> None:
    from _ledger_fixture import build_ledger, fresh_keys, plain_merge_seconds

    print(f"\n== Per-batch dedup of {n_keys:,} new keys against a ledger of N keys")
    print(
        "   (catch-up check + claim + ledger commit + Redis complete; best of "
        f"{repeat}; the plain MERGE is delta-rs 'WHEN NOT MATCHED INSERT' on (bucket, key))"
    )
    results: dict[int, tuple[float, float]] = {}
    for size in sizes:
        root = Path(tempfile.mkdtemp(prefix=f"idem-bench-{size}-"))
        try:
            config = IdemConfig(group="bench", redis_url=server.url, data_dir=str(root), buckets=16)
            started = time.perf_counter()
            build_ledger(config.resolved_ledger_path, size, buckets=config.buckets)
            built = time.perf_counter() - started
            server.client().flushall()
            empty = _used_memory(server)
            dd = Dedup(config)
            started = time.perf_counter()
            dd.catch_up()  # the honest way: Redis indexes the whole window of N keys
            indexed = time.perf_counter() - started
            per_million = (_used_memory(server) - empty) / size * 1e6 / 2**20
            runs = []
            for round_ in range(repeat):
                # interleaved with the ledger's keys, so no file is skipped by key statistics
                keys = fresh_keys(n_keys, round_=round_)

                def batch(keys: list[str] = keys, round_: int = round_, dd: Dedup = dd) -> None:
                    claim = dd.begin(keys, owner=f"bench:{round_}")
                    dd.complete(claim, batch_id=round_, app_id="bench")

                runs.append(_timed(batch))
            merge = plain_merge_seconds(config.resolved_ledger_path, n_keys, buckets=config.buckets)
            results[size] = (_best(runs), merge)
            print(
                f"  N={size:>11,}  ledger built {built:6.1f}s  Redis indexed {indexed:6.1f}s "
                f"({per_million:.0f} MiB per 1M keys)  "
                f"batch {_best(runs):6.3f}s (median {statistics.median(runs):.3f}s)  "
                f"plain MERGE {merge:6.3f}s"
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    first = results[sizes[0]][0]
    print()
    for size, (batch_s, merge_s) in results.items():
        print(
            f"  N={size:>11,}  batch / batch(N={sizes[0]:,}) = {batch_s / first:.2f}x"
            f"   plain MERGE / batch = {merge_s / batch_s:.1f}x"
        )
    last = sizes[-1]
    print(f"  targets: N={last:,} <= 1.2x the N={sizes[0]:,} case; plain MERGE >= 5x slower")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--sizes", default="100000,1000000,10000000")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-ledger", action="store_true")
    args = parser.parse_args()
    with RedisServer() as server:
        bench_redis(server, args.keys, args.repeat)
        if not args.skip_ledger:
            sizes = [int(s) for s in args.sizes.split(",")]
            bench_ledger(server, sizes, args.keys, args.repeat)


if __name__ == "__main__":
    main()
