"""Rows completed from Arrow columns (``Dedup.complete_rows``, the Spark driver's path) end
exactly as the same rows completed from a :class:`BatchClaim` (``Dedup.complete``): the
same ledger rows and transactions, the same Redis state, the same outcome — with a key
that slipped in meanwhile and a replayed batch that brings one more key.

Each run has a real redis-server (emptied first) and a Delta ledger of its own, on the
same manual clock, so their stamps and leases agree to the millisecond.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import redis
from deltalake import DeltaTable

from idem.clock import ManualClock
from idem.commit_rows import ledger_rows
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.keys import bucket_of
from idem.outcome import BatchClaim, ClaimedRows, CommitOutcome
from idem.redis_server import RedisServer

pytestmark = pytest.mark.integration

KEYS = [f"ORDER_{n}" for n in range(40)]
SLIPPED = KEYS[3]
LATE = "ORDER_LATE"
APP = "test:columnar"
OTHER_APP = "test:other"
BUCKETS = 4
BATCH = 7

Complete = Callable[[Dedup, pa.Table, BatchClaim], CommitOutcome]
"""Completes every row of a claim, given its ledger columns."""


def _config(data_dir: Path, url: str) -> IdemConfig:
    return IdemConfig(
        group="orders", redis_url=url, data_dir=str(data_dir), buckets=BUCKETS, engine="delta-rs"
    )


def _columns(claim: BatchClaim) -> pa.Table:
    """The ledger columns of every row of ``claim``, as the Spark driver gathers them."""
    keys = [k or "" for k in claim.keys]
    return pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "fingerprint": pa.array(claim.fingerprints, pa.string()),
            "bucket": pa.array([bucket_of(k, BUCKETS) for k in keys], pa.int32()),
            "msg_id": pa.array([f"m-{k}" for k in keys], pa.string()),
            "origin_msg_id": pa.array([None] * len(keys), pa.string()),
            "topic": pa.array(["orders"] * len(keys), pa.string()),
        }
    )


def _with_claim(dd: Dedup, columns: pa.Table, claim: BatchClaim) -> CommitOutcome:
    """``Dedup.complete`` of a claim of every row (what the Spark driver called before)."""
    every = BatchClaim(
        owner=claim.owner,
        keys=tuple(columns.column("key").to_pylist()),
        fingerprints=tuple(columns.column("fingerprint").to_pylist()),
        fresh=tuple(range(columns.num_rows)),
        duplicates={},
        busy=(),
        invalid=(),
        ledger_version=claim.ledger_version,
        buckets=tuple(columns.column("bucket").to_pylist()),
        held=claim.held,
        claimed_at_ms=claim.claimed_at_ms,
    )
    meta = columns.select(["msg_id", "origin_msg_id", "topic"])
    return dd.complete(every, batch_id=BATCH, app_id=APP, meta=meta, defer_index=True)


def _from_columns(dd: Dedup, columns: pa.Table, claim: BatchClaim) -> CommitOutcome:
    rows = ClaimedRows(
        owner=claim.owner,
        columns=columns,
        ledger_version=claim.ledger_version,
        held=claim.held,
        claimed_at_ms=claim.claimed_at_ms,
    )
    return dd.complete_rows(rows, batch_id=BATCH, app_id=APP, defer_index=True)


def _slip_in(dd: Dedup, key: str, now_ms: int) -> None:
    """Another writer commits ``key`` to the ledger behind Redis's back."""
    columns = {
        "key": pa.array([key], pa.string()),
        "bucket": pa.array([bucket_of(key, BUCKETS)], pa.int32()),
        "fingerprint": pa.array(["fp-other"], pa.string()),
    }
    other = ClaimedRows(owner="other:0", columns=pa.table(columns))
    rows = ledger_rows(other, group=dd.config.group, batch_id=0, now_ms=now_ms)
    dd.ledger.commit(rows, app_id=OTHER_APP, txn_version=0, match_since_ms=None)


def _replay(claim: BatchClaim, late: BatchClaim) -> BatchClaim:
    """``claim`` again, with ``late``'s key, which failed the first time, succeeding now."""
    return BatchClaim(
        owner=claim.owner,
        keys=(*claim.keys, *late.keys),
        fingerprints=(*claim.fingerprints, *late.fingerprints),
        fresh=tuple(range(len(claim.keys) + len(late.keys))),
        duplicates={},
        busy=(),
        invalid=(),
        ledger_version=late.ledger_version,
        claimed_at_ms=late.claimed_at_ms,
    )


def _run(complete: Complete, data_dir: Path, server: RedisServer, start_ms: int) -> dict[str, Any]:
    """One batch with a slipped key, then its replay with one more key; what it left."""
    shutil.rmtree(data_dir, ignore_errors=True)
    client = server.client()
    client.flushall()
    clock = ManualClock(start_ms)
    dd = Dedup(_config(data_dir, server.url), clock=clock)
    try:
        claim = dd.begin(KEYS, owner="q:7", fingerprints=[f"fp-{k}" for k in KEYS])
        assert len(claim.fresh) == len(KEYS)
        clock.advance(1)
        _slip_in(dd, SLIPPED, clock.now_ms())
        clock.advance(1)
        first = complete(dd, _columns(claim), claim)
        dd.settle()
        after_first = _redis_state(client)
        clock.advance(1)
        late = dd.begin([LATE], owner="q:7", fingerprints=["fp-late"])
        clock.advance(1)
        late_app = f"{APP}:late:{clock.now_ms()}"
        again = complete(dd, _columns(_replay(claim, late)), _replay(claim, late))
        dd.catch_up()  # the slipped key's bucket, too, indexes the other writer's version
        table = DeltaTable(dd.ledger.path)
        return {
            "outcomes": (first, again),
            "ledger": table.to_pyarrow_table().sort_by([("key", "ascending")]),
            "txns": {app: table.transaction_version(app) for app in (APP, OTHER_APP, late_app)},
            "redis": _redis_state(client),
            "redis_first": after_first,
        }
    finally:
        dd.close()


def _fields(state: dict[bytes, Any], kind: bytes) -> dict[bytes, bytes]:
    """Every field of the hashes whose name holds ``kind`` (``:c:`` completed, ``:p:`` claims)."""
    return {f: v for name, fields in state.items() if kind in name for f, v in fields.items()}


def _redis_state(client: redis.Redis) -> dict[bytes, Any]:
    """Every key's value (hashes whole), without TTLs."""
    state: dict[bytes, Any] = {}
    for name in client.scan_iter("*"):
        kind = client.type(name)
        state[name] = client.hgetall(name) if kind == b"hash" else client.get(name)
    return state


def test_columns_complete_as_a_batch_claim_does(tmp_path: Path, redis_server: RedisServer) -> None:
    start = int(time.time() * 1000)
    claimed = _run(_with_claim, tmp_path / "data", redis_server, start)
    columnar = _run(_from_columns, tmp_path / "data", redis_server, start)

    first, again = columnar["outcomes"]
    assert first.slipped == (SLIPPED,)
    assert first.committed == len(KEYS) - 1
    assert again.replayed
    assert again.committed == 1  # the key that failed the first time, under a txn of its own
    assert columnar["outcomes"] == claimed["outcomes"]
    ledger = columnar["ledger"]
    assert ledger.equals(claimed["ledger"])
    keys = ledger.column("key").to_pylist()
    assert sorted(keys) == sorted([*KEYS, LATE])
    owners = dict(zip(keys, ledger.column("owner").to_pylist(), strict=True))
    assert owners[SLIPPED] == "other:0"  # the other writer's row stands alone
    assert columnar["txns"] == claimed["txns"]
    assert list(columnar["txns"].values()) == [BATCH, 0, BATCH]
    assert columnar["redis"] == claimed["redis"]
    assert columnar["redis_first"] == claimed["redis_first"]
    ours = ledger.filter(pc.equal(ledger.column("owner"), "q:7"))
    assert ours.column("msg_id").to_pylist() == [f"m-{k}" for k in ours.column("key").to_pylist()]
    assert set(ours.column("batch_id").to_pylist()) == {BATCH}

    first_done = _fields(columnar["redis_first"], b":c:")
    assert sorted(first_done) == sorted(k.encode() for k in KEYS if k != SLIPPED)
    assert all(first_done[k.encode()].startswith(f"fp-{k}|".encode()) for k in KEYS[:3])
    claims = _fields(columnar["redis_first"], b":p:")
    assert SLIPPED.encode() not in claims  # its lease was given back
    assert not claims  # and every other claim was completed
    completed = _fields(columnar["redis"], b":c:")
    assert sorted(completed) == sorted(k.encode() for k in [*KEYS, LATE])
    assert completed[b"ORDER_0"].startswith(b"fp-ORDER_0|")
    assert completed[LATE.encode()].startswith(b"fp-late|")
