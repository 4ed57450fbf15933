"""Eight ledger writer processes commit overlapping keys at the same moment.

Each writer (``ledger_writer.py``) claims and commits seeded batches drawn from one
shared key space, so most keys are wanted by several writers at once. With leases
a key is claimed by one writer at a time; without (a sink that is its own ledger)
every writer may see a key as new and only the ledger's MERGE decides. Either way
the Delta ledger ends with every key exactly once, every key a writer was told it
inserted is in the ledger under that writer, and no commit is lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis
from checks import ledger_keys, ledger_owners
from seeds import Seed
from waiting import eventually

from idem.config import IdemConfig
from idem.redis_server import RedisServer

pytestmark = pytest.mark.faults

WRITER = Path(__file__).with_name("ledger_writer.py")
WRITERS = 8
KEYS = 120
BATCHES = 2
BATCH = 24


@pytest.mark.parametrize("hold", [True, False], ids=["leases", "no-leases"])
def test_eight_writers_on_overlapping_keys_leave_each_key_once_and_lose_no_commit(
    hold: bool, redis_server: RedisServer, real_redis: redis.Redis, tmp_path: Path, seed: Seed
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    universe = [f"W-{i:04d}" for i in range(KEYS)]
    go = tmp_path / "go"
    procs: list[subprocess.Popen[bytes]] = []
    reports = [tmp_path / f"w{n}.json" for n in range(WRITERS)]
    for n in range(WRITERS):
        spec = {
            "group": group,
            "redis_url": redis_server.url,
            "data_dir": str(tmp_path / "data"),
            "lease_ms": 5_000,
            "owner": f"w{n}",
            "hold": hold,
            "go": str(go),
            "report": str(reports[n]),
            "ready": str(tmp_path / f"w{n}.ready"),
            "batches": [seed.rng.sample(universe, BATCH) for _ in range(BATCHES)],
        }
        procs.append(subprocess.Popen([sys.executable, str(WRITER), json.dumps(spec)]))
    ready = [tmp_path / f"w{n}.ready" for n in range(WRITERS)]
    eventually(lambda: all(r.exists() for r in ready), timeout=120, what="every writer loaded")
    started = time.monotonic()
    go.touch()
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    took = time.monotonic() - started
    assert codes == [0] * WRITERS, seed.tag(f"writer exit codes {codes}")
    results = [json.loads(r.read_text()) for r in reports]
    seen = Counter(k for r in results for k in {*r["inserted"], *r["slipped"], *r["duplicates"]})
    wanted = set(seen)
    config = IdemConfig(group=group, redis_url=redis_server.url, data_dir=str(tmp_path / "data"))
    in_ledger = ledger_keys(config)
    doubled = {k: n for k, n in in_ledger.items() if n > 1}
    assert not doubled, seed.tag(f"keys in the ledger more than once: {doubled}")
    assert set(in_ledger) == wanted, seed.tag(
        f"lost: {sorted(wanted - set(in_ledger))[:10]}, "
        f"extra: {sorted(set(in_ledger) - wanted)[:10]}"
    )
    owners = ledger_owners(config)
    lost = [(r["owner"], k) for r in results for k in r["inserted"] if owners.get(k) != r["owner"]]
    assert not lost, seed.tag(
        f"inserted per its writer, but not in the ledger as theirs: {lost[:10]}"
    )
    inserted = Counter(k for r in results for k in r["inserted"])
    assert all(n == 1 for n in inserted.values()), seed.tag(
        "two writers told they inserted one key"
    )
    contended = sum(1 for n in seen.values() if n > 1)
    print(
        f"{'leases' if hold else 'no leases'}: {WRITERS} writers, "
        f"{sum(r['commits'] for r in results)} commits in {took:.1f}s; "
        f"{len(wanted)} keys ({contended} wanted by several writers); "
        f"slipped {sum(len(r['slipped']) for r in results)}, "
        f"duplicates at claim {sum(len(r['duplicates']) for r in results)}, "
        f"commit errors retried {sum(len(r['errors']) for r in results)}"
    )
