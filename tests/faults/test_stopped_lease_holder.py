"""A lease holder frozen (SIGSTOP) for twice its lease while another instance takes over.

The holder process claimed a batch of keys and renews their leases while it works;
SIGSTOP freezes it, renewer and all. While its leases run, the keys are busy for the
other instance; once they have run out the other instance takes them over
(``reclaimed``). Then SIGCONT: the holder finishes and commits. Whichever commit
comes second finds the keys in the ledger (slipped); when the holder's comes first,
its COMPLETED writes to Redis are refused because the claims are no longer its
own (fenced), and counted. The ledger holds each key once either way.
"""

from __future__ import annotations

import json
import signal
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

from idem.config import IdemConfig, LedgerEngine
from idem.dedup import Dedup
from idem.lease_keeper import LeaseKeeper
from idem.redis_server import RedisServer

pytestmark = pytest.mark.faults

HOLDER = Path(__file__).with_name("lease_holder.py")
LEASE_MS = 2_000


@pytest.mark.parametrize(
    "first", ["holder", "taker"], ids=["holder-commits-first", "taker-commits-first"]
)
def test_a_frozen_lease_holder_loses_its_keys_and_the_ledger_holds_each_once(
    first: str, redis_server: RedisServer, real_redis: redis.Redis, tmp_path: Path, seed: Seed
) -> None:
    config = IdemConfig(
        group=f"g-{uuid.uuid4().hex[:8]}",
        redis_url=redis_server.url,
        data_dir=str(tmp_path / "data"),
        lease_ms=LEASE_MS,
        engine=LedgerEngine.DELTA_RS,
    )
    keys = [f"LEASE-{i:03d}" for i in range(seed.rng.randint(20, 80))]
    claimed, outcome = tmp_path / "claimed", tmp_path / "outcome"
    spec = {
        "group": config.group,
        "redis_url": config.redis_url,
        "data_dir": config.data_dir,
        "lease_ms": LEASE_MS,
        "keys": keys,
        "owner": "holder",
        "work_s": 1.5,
        "claimed": str(claimed),
        "outcome": str(outcome),
    }
    taker = Dedup(config)
    holder = subprocess.Popen([sys.executable, str(HOLDER), json.dumps(spec)])
    try:
        eventually(claimed.exists, timeout=60, what=seed.tag("the holder's claim"))
        holder.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert json.loads(claimed.read_text()) == keys
        early = taker.begin(keys, owner="taker")
        assert len(early.busy) == len(keys), seed.tag("a frozen holder's live lease keeps its keys")
        time.sleep(max(0.0, stopped_at + 2 * LEASE_MS / 1000 - time.monotonic()))
        took = taker.begin(keys, owner="taker")
        assert len(took.fresh) == len(took.reclaimed) == len(keys), seed.tag(
            f"taken over after the lease: {len(took.fresh)} fresh, {len(took.reclaimed)} reclaimed"
        )
        frozen_s = time.monotonic() - stopped_at
        # the taker is a live instance: it renews its leases until it commits
        with LeaseKeeper(taker, keys, "taker"):
            taken = taker.complete(took, batch_id=1) if first == "taker" else None
            holder.send_signal(signal.SIGCONT)
            assert holder.wait(timeout=60) == 0, seed.tag("the holder ends after SIGCONT")
            if taken is None:
                taken = taker.complete(took, batch_id=1)
        held = json.loads(outcome.read_text())
    finally:
        if holder.poll() is None:
            holder.send_signal(signal.SIGCONT)
            holder.kill()
            holder.wait()
    in_ledger = ledger_keys(config)
    assert in_ledger == Counter(keys), seed.tag(f"ledger rows per key: {in_ledger}")
    assert taker.ledger.audit() == []
    owners = set(ledger_owners(config).values())
    if first == "holder":
        assert held["committed"] == len(keys)
        assert sorted(held["fenced"]) == keys, seed.tag("the holder's COMPLETED writes are fenced")
        assert sorted(taken.slipped) == keys
        assert taken.committed == 0
        assert owners == {"holder"}
    else:
        assert taken.committed == len(keys)
        assert not taken.fenced
        assert sorted(held["slipped"]) == keys
        assert held["committed"] == 0
        assert owners == {"taker"}
    print(
        f"{first} first: {len(keys)} keys, holder frozen {frozen_s:.2f}s (lease {LEASE_MS} ms); "
        f"holder fenced {len(held['fenced'])}, slipped {len(held['slipped'])}; "
        f"taker slipped {len(taken.slipped)}, fenced {len(taken.fenced)}; "
        f"ledger rows {in_ledger.total()}"
    )
    taker.close()
