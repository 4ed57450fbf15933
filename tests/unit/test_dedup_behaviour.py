"""The dedup protocol's behaviour, on fakeredis and on a real redis-server.

The ledger is a real Delta table in ``tmp_path``; time is a ManualClock.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest
import redis
from deltalake import DeltaTable, QueryBuilder

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.keys import bucket_of
from idem.outcome import DuplicateCause


def _dedup(tmp_path: Path, client: redis.Redis, clock: ManualClock, **extra: object) -> Dedup:
    config = IdemConfig(group="orders", data_dir=str(tmp_path), buckets=4, **extra)
    return Dedup(config, client=client, clock=clock)


def test_first_occurrence_in_a_batch_wins(
    tmp_path: Path, any_redis: redis.Redis, clock: ManualClock
) -> None:
    dd = _dedup(tmp_path, any_redis, clock)
    claim = dd.begin(["A", "B", "A", "C", "B"], owner="q:0", order=[2, 0, 1, 3, 4])
    assert claim.fresh == (1, 2, 3)  # A's first occurrence by `order` is row 2
    assert claim.duplicates == {0: DuplicateCause.IN_BATCH, 4: DuplicateCause.IN_BATCH}


def test_completed_keys_are_duplicates_in_later_batches(
    tmp_path: Path, any_redis: redis.Redis, clock: ManualClock
) -> None:
    dd = _dedup(tmp_path, any_redis, clock)
    first = dd.begin(["A", "B"], owner="q:0")
    outcome = dd.complete(first, batch_id=0)
    assert outcome.committed == 2
    second = dd.begin(["B", "C"], owner="q:1")
    assert second.fresh_keys() == ["C"]
    assert second.duplicates == {0: DuplicateCause.COMPLETED}
    ledger = dd.ledger.window(0, None).keys
    assert sorted(ledger.column("key").to_pylist()) == ["A", "B"]


def test_only_succeeded_rows_are_committed_and_failed_ones_come_back(
    tmp_path: Path, any_redis: redis.Redis, clock: ManualClock
) -> None:
    dd = _dedup(tmp_path, any_redis, clock)
    claim = dd.begin(["A", "B", "C"], owner="q:0")
    dd.complete(claim, succeeded=[0, 2], batch_id=0)
    assert dd.release(claim, [1]) == 1
    retry = dd.begin(["A", "B", "C"], owner="q:1")
    assert retry.fresh_keys() == ["B"]


def test_busy_keys_wait_for_the_lease_then_can_be_taken_over(
    tmp_path: Path, any_redis: redis.Redis, clock: ManualClock
) -> None:
    dd = _dedup(tmp_path, any_redis, clock)
    dd.begin(["A"], owner="crashed:0")
    blocked = dd.begin(["A"], owner="q:1")
    assert blocked.busy == (0,)
    assert not blocked.fresh
    clock.advance(5 * 60 + 1)  # the lease (5 min) runs out
    taken = dd.begin(["A"], owner="q:1")
    assert taken.fresh == (0,)


def test_a_changed_payload_is_reported(
    tmp_path: Path, any_redis: redis.Redis, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    dd = _dedup(tmp_path, any_redis, clock)
    dd.complete(dd.begin(["A"], owner="q:0", fingerprints=["f1"]), batch_id=0)
    with caplog.at_level(logging.WARNING):
        again = dd.begin(["A", "A"], owner="q:1", fingerprints=["f2", "f2"])
    assert again.mismatched == (0,)
    assert again.conflicting() == ()  # the copy has the kept row's payload
    assert "different payload" in caplog.text


def test_a_copy_with_another_payload_than_the_kept_row_is_conflicting(
    tmp_path: Path, any_redis: redis.Redis, clock: ManualClock
) -> None:
    dd = _dedup(tmp_path, any_redis, clock)
    claim = dd.begin(
        ["A", "B", "A", "A", "B"],
        owner="q:0",
        fingerprints=["f1", "g1", "f2", "f1", "g1"],
        order=[2, 0, 1, 3, 4],  # row 2 is the kept "A" (e.g. a retry)
    )
    assert claim.fresh == (1, 2)
    assert claim.conflicting() == (0, 3)
    unprinted = dd.begin(["C", "C"], owner="q:0", fingerprints=["", "h1"])
    assert unprinted.conflicting() == ()  # no fingerprint to tell them apart


def test_metadata_and_payload_columns_land_in_the_ledger(
    tmp_path: Path, any_redis: redis.Redis, clock: ManualClock
) -> None:
    dd = _dedup(tmp_path, any_redis, clock)
    claim = dd.begin(["A", "B"], owner="q:0")
    meta = pa.table({"msg_id": ["m1", "m2"], "topic": ["orders", "orders"], "queue_offset": [5, 6]})
    dd.complete(claim, batch_id=3, meta=meta)
    query = QueryBuilder().register("ledger", DeltaTable(dd.config.resolved_ledger_path))
    table = query.execute("SELECT * FROM ledger ORDER BY key").read_all()
    assert table.column("msg_id").to_pylist() == ["m1", "m2"]
    assert table.column("queue_offset").to_pylist() == [5, 6]
    assert table.column("batch_id").to_pylist() == [3, 3]
    assert table.column("owner").to_pylist() == ["q:0", "q:0"]
    assert table.column("group").to_pylist() == [dd.config.group] * 2


def test_metadata_follows_its_rows_when_only_some_rows_land_in_the_ledger(
    tmp_path: Path, any_redis: redis.Redis, clock: ManualClock
) -> None:
    dd = _dedup(tmp_path, any_redis, clock)
    meta = pa.table({"msg_id": ["m1", "m2", "m3"]})
    some = dd.begin(["A", "B", "C"], owner="q:0")
    dd.complete(some, succeeded=[2, 0], batch_id=0, meta=meta)  # B failed
    repeated = dd.begin(["D", "D", "E"], owner="q:0")  # the second D is an in-batch duplicate
    dd.complete(repeated, batch_id=1, meta=meta)
    every = dd.begin(["F", "G", "H"], owner="q:0")
    dd.complete(every, succeeded=[1, 2, 0], batch_id=2, meta=meta)  # all, in another order
    query = QueryBuilder().register("ledger", DeltaTable(dd.config.resolved_ledger_path))
    table = pa.table(query.execute("SELECT key, msg_id FROM ledger ORDER BY key").read_all())
    assert table.to_pylist() == [
        {"key": "A", "msg_id": "m1"},
        {"key": "C", "msg_id": "m3"},
        {"key": "D", "msg_id": "m1"},
        {"key": "E", "msg_id": "m3"},
        {"key": "F", "msg_id": "m1"},
        {"key": "G", "msg_id": "m2"},
        {"key": "H", "msg_id": "m3"},
    ]


def test_every_committed_key_lands_in_its_own_bucket(
    tmp_path: Path, any_redis: redis.Redis, clock: ManualClock
) -> None:
    """The claim's buckets travel to the commit: with repeats and bad keys in between,
    each ledger row's bucket is its key's, and Redis knows each key as completed."""
    dd = _dedup(tmp_path, any_redis, clock)
    keys = ["K9", None, "K1", "K9", "", "K2", "K1", "K3", "K4", "K5"]
    claim = dd.begin(keys, owner="q:0", order=list(reversed(range(len(keys)))))
    dd.complete(claim, succeeded=[i for i in claim.fresh if keys[i] != "K4"], batch_id=0)
    rows = dd.ledger.window(0, None).keys.to_pylist()
    assert sorted(r["key"] for r in rows) == ["K1", "K2", "K3", "K5", "K9"]
    assert all(r["bucket"] == bucket_of(r["key"], 4) for r in rows)
    again = dd.begin(["K1", "K2", "K3", "K5", "K9"], owner="q:1")
    assert again.fresh == ()


def test_strict_mode_checks_the_ledger_even_when_redis_forgot(
    tmp_path: Path, any_redis: redis.Redis, clock: ManualClock
) -> None:
    dd = _dedup(tmp_path, any_redis, clock, mode="strict")
    dd.complete(dd.begin(["A"], owner="q:0"), batch_id=0)
    # forget the completed keys, keep the watermark: the index is now silently incomplete
    forgotten = list(any_redis.scan_iter("idem:*:c:*"))
    assert forgotten
    any_redis.delete(*forgotten)
    again = dd.begin(["A", "B"], owner="q:1")
    assert again.fresh_keys() == ["B"]
    assert again.duplicates == {0: DuplicateCause.COMPLETED}
