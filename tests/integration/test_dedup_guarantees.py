"""The dedup guarantees (docs/pages/guarantees.md), shown with a real redis-server and Delta tables.

Each test asserts what a user cares about: which keys reached the sink, how
often, and why the others did not.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from idem.claiming import CLAIM_WAVE_ROWS
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.errors import ConfigError, UnsafeRedisConfig
from idem.hotstore import CompleteResult
from idem.outcome import DuplicateCause
from idem.redis_server import RedisServer

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, url: str, **extra: object) -> IdemConfig:
    # delta-rs named, not auto: the workers run in processes without the test run's Spark
    # session, and one ledger table has one writer engine.
    settings: dict[str, object] = {"engine": "delta-rs", "buckets": 8, **extra}
    return IdemConfig(group="orders", redis_url=url, data_dir=str(tmp_path / "data"), **settings)


def _process(dd: Dedup, keys: list[str], owner: str, batch_id: int) -> list[str]:
    """One batch through the protocol; returns the keys the 'sink' received."""
    claim = dd.begin(keys, owner=owner)
    fresh = claim.fresh_keys()
    dd.complete(claim, batch_id=batch_id, app_id=f"test:{owner}")
    return fresh


# -- (a) two processes, same 10k keys, concurrently ---------------------------------------

START_BARRIER = "test:workers-started"
"""Counts the workers ready to claim (the test's FLUSHALL resets it)."""

FIRST_CLAIMS = "test:first-claims"
"""Counts the workers holding their first chunk's claims, not yet completed."""


def _meet(url: str, barrier: str) -> None:
    """Wait until both workers have reached ``barrier`` (at most 120 s)."""
    meeting = redis.Redis.from_url(url)
    meeting.incr(barrier)
    deadline = time.monotonic() + 120
    while int(meeting.get(barrier) or 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    meeting.close()


def _worker(url: str, data_dir: str, name: str, seed: int, out: str) -> None:
    config = IdemConfig(group="orders", redis_url=url, data_dir=data_dir, buckets=8)
    dd = Dedup(config)
    keys = [f"ORDERID_{i}" for i in range(10_000)]
    random.Random(seed).shuffle(keys)
    # both start claiming together, however long each took to start (a loaded machine)
    _meet(url, START_BARRIER)
    todo = keys
    processed: list[str] = []
    batch_id = 0
    while todo:
        retry: list[str] = []
        for start in range(0, len(todo), 1_000):
            chunk = todo[start : start + 1_000]
            claim = dd.begin(chunk, owner=f"{name}:{batch_id}")
            if batch_id == 0:  # both hold a share before either completes: they compete
                _meet(url, FIRST_CLAIMS)
            processed += claim.fresh_keys()  # the sink: every key written here counts
            retry += [chunk[i] for i in claim.busy]
            dd.complete(claim, batch_id=batch_id, app_id=f"worker:{name}")
            batch_id += 1
        todo = retry
    Path(out).write_text("\n".join(processed))


def test_two_processes_claiming_the_same_keys_process_each_exactly_once(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    redis_server.client().flushall()
    ctx = mp.get_context("spawn")
    outs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    procs = [
        ctx.Process(
            target=_worker,
            args=(redis_server.url, str(tmp_path / "data"), name, seed, str(out)),
        )
        for name, seed, out in (("a", 1, outs[0]), ("b", 2, outs[1]))
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
        assert proc.exitcode == 0
    seen = [line for out in outs for line in out.read_text().splitlines() if line]
    assert len(seen) == 10_000
    assert set(seen) == {f"ORDERID_{i}" for i in range(10_000)}
    # both workers really competed: each processed a share of the keys
    assert all(out.read_text() for out in outs)
    ledger_keys = Dedup(_config(tmp_path, redis_server.url)).ledger.audit()
    assert ledger_keys == []  # no key twice in the ledger either


# -- (b) FLUSHALL between batches ----------------------------------------------------------


@pytest.mark.parametrize("buckets", [8, 37])  # 37: the window is read in uneven shares
def test_flushall_between_batches_processes_no_completed_key_again(
    tmp_path: Path, redis_server: RedisServer, buckets: int
) -> None:
    client = redis_server.client()
    dd = _completed_500(tmp_path, redis_server, buckets=buckets)
    client.flushall()
    rebuilt_before = dd.stats.rebuilt_buckets

    _claim_half_completed_half_new(dd, "q:1")
    assert dd.stats.rebuilt_buckets - rebuilt_before == buckets  # every watermark was lost
    assert dd.stats.rebuilt_keys == 500  # from the ledger's window, not from the batch


def _completed_500(tmp_path: Path, redis_server: RedisServer, *, buckets: int = 8) -> Dedup:
    """A Dedup on an empty Redis that has processed ORDERID_0..499."""
    redis_server.client().flushall()
    dd = Dedup(_config(tmp_path, redis_server.url, buckets=buckets))
    first = [f"ORDERID_{i}" for i in range(500)]
    assert _process(dd, first, "q:0", 0) == first
    return dd


def _claim_half_completed_half_new(dd: Dedup, owner: str) -> None:
    """ORDERID_250..749 after ORDERID_0..499 completed: only 500..749 are fresh."""
    claim = dd.begin([f"ORDERID_{i}" for i in range(250, 750)], owner=owner)
    assert claim.fresh_keys() == [f"ORDERID_{i}" for i in range(500, 750)]
    assert claim.counts.duplicates_by_cause == {DuplicateCause.COMPLETED.value: 250}


def test_flushall_while_the_ledger_stands_still_processes_no_completed_key_again(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    dd = _completed_500(tmp_path, redis_server)
    # A claim at the ledger's current version: every bucket is found caught up, so the
    # next claims at that version skip reading the watermarks...
    looked = dd.begin([f"LOOK_{i}" for i in range(100)], owner="q:1")
    dd.release(looked)
    client.flushall()  # ...and Redis then loses them while the ledger does not move

    _claim_half_completed_half_new(dd, "q:2")
    assert dd.stats.rebuilt_keys == 500  # the claim found the buckets stale and rebuilt them


# -- (c) writer commits the ledger and dies before updating Redis --------------------------


def _commit_then_die(url: str, data_dir: str, keys: list[str]) -> None:
    config = IdemConfig(group="orders", redis_url=url, data_dir=data_dir, buckets=8)
    dd = Dedup(config)

    def crash(*_args: object, **_kwargs: object) -> None:
        os._exit(17)  # the process dies between the ledger commit and Redis

    dd.hot.complete_buckets = crash  # type: ignore[method-assign]
    claim = dd.begin(keys, owner="dying:0")
    dd.complete(claim, batch_id=0, app_id="dying")


def test_writer_dying_after_ledger_commit_leaves_keys_duplicate_and_loads_only_missed(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    redis_server.client().flushall()
    dd = Dedup(_config(tmp_path, redis_server.url))
    early = [f"EARLY_{i}" for i in range(300)]
    _process(dd, early, "q:0", 0)

    late = [f"LATE_{i}" for i in range(200)]
    proc = mp.get_context("spawn").Process(
        target=_commit_then_die, args=(redis_server.url, str(tmp_path / "data"), late)
    )
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == 17

    fresh_dd = Dedup(_config(tmp_path, redis_server.url))
    # the dying writer's claims are still IN_PROGRESS in Redis under its owner, but
    # the ledger says they are done: they must come back as duplicates, not busy.
    claim = fresh_dd.begin([*late, "NEW_1"], owner="q:2")
    assert claim.fresh_keys() == ["NEW_1"]
    assert len(claim.duplicates) == 200
    assert fresh_dd.stats.rebuilt_buckets == 0
    assert fresh_dd.stats.caught_up_keys == 200  # only the missed version, not the 300 early keys


def test_a_live_writer_indexes_its_own_commit_and_others_do_not_reload_it(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    redis_server.client().flushall()
    writer = Dedup(_config(tmp_path, redis_server.url))
    keys = [f"ORDERID_{i}" for i in range(300)]
    claim = writer.begin(keys, owner="a:1")
    pending: list[Callable[[], object]] = []
    real_complete = writer.hot.complete_buckets

    def later(*args: Any, **kwargs: Any) -> CompleteResult:
        pending.append(lambda: real_complete(*args, **kwargs))
        return CompleteResult(completed=0, fenced=[], watermark_advanced=False)

    # The writer's ledger commit lands; its Redis update is still on the way.
    writer.hot.complete_buckets = later  # type: ignore[method-assign]
    writer.complete(claim, batch_id=1, app_id="writer-a")
    assert len(pending) == 1

    class _Clock:
        """Real time, except that the first pause lets the writer finish."""

        def now_ms(self) -> int:
            return writer.clock.now_ms()

        def sleep(self, seconds: float) -> None:
            while pending:
                pending.pop()()

    reader = Dedup(_config(tmp_path, redis_server.url), clock=_Clock())
    seen = reader.begin([*keys, "NEW_1"], owner="b:1")
    assert seen.fresh_keys() == ["NEW_1"]
    assert len(seen.duplicates) == 300
    assert reader.stats.writer_waits == 1
    assert reader.stats.caught_up_keys == 0  # the writer indexed them; nothing was reloaded


def test_a_deferred_index_update_lands_before_the_next_claim(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    redis_server.client().flushall()
    dd = Dedup(_config(tmp_path, redis_server.url))
    keys = [f"ORDERID_{i}" for i in range(2_000)]
    outcome = dd.complete(dd.begin(keys, owner="q:1"), batch_id=1, app_id="q", defer_index=True)
    assert outcome.committed == 2_000  # durable in the ledger when complete returns
    claim = dd.begin([*keys, "NEW_1"], owner="q:2")  # waits for the Redis update first
    assert claim.fresh_keys() == ["NEW_1"]
    assert len(claim.duplicates) == 2_000
    assert (dd.stats.caught_up_keys, dd.stats.writer_waits) == (0, 0)
    dd.close()


# -- (d) Redis restarted from an AOF that lacks the last writes ----------------------------


def test_redis_restarted_from_an_older_aof_catches_up_from_the_ledger(tmp_path: Path) -> None:
    server = RedisServer(appendonly=True, appendfsync="always", directory=tmp_path / "redis")
    server.start()
    try:
        dd = Dedup(_config(tmp_path, server.url))
        _process(dd, [f"A_{i}" for i in range(300)], "q:0", 0)
        snapshot = tmp_path / "aof-snapshot"
        shutil.copytree(tmp_path / "redis" / "appendonlydir", snapshot)
        _process(dd, [f"B_{i}" for i in range(300)], "q:1", 1)
        server.kill()
        shutil.rmtree(tmp_path / "redis" / "appendonlydir")
        shutil.copytree(snapshot, tmp_path / "redis" / "appendonlydir")
        server.start()
        assert server.client().exists("idem:{orders:0}:wm")  # the old state is back

        again = Dedup(_config(tmp_path, server.url))
        claim = again.begin([f"B_{i}" for i in range(300)] + ["C_1"], owner="q:2")
        assert claim.fresh_keys() == ["C_1"]
        assert again.stats.rebuilt_buckets == 0
        assert again.stats.caught_up_keys == 300  # the versions the AOF lacked, nothing more
    finally:
        server.stop()


# -- (e) a replayed batch re-takes its own claims ------------------------------------------


def test_replayed_batch_retakes_its_claims_and_adds_nothing_twice(
    tmp_path: Path, real_redis: object, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    keys = [f"ORDERID_{i}" for i in range(100)]
    first = dd.begin(keys, owner="query-1:7")
    assert len(first.fresh) == 100
    # the batch crashes before commit; another query must not steal the keys meanwhile
    other = dd.begin(keys[:10], owner="query-2:1")
    assert len(other.busy) == 10
    assert not other.fresh
    # Spark replays batch 7: same owner re-takes every claim
    replay = dd.begin(keys, owner="query-1:7")
    assert len(replay.fresh) == 100
    assert len(replay.retaken) == 100
    outcome = dd.complete(replay, batch_id=7, app_id="query-1")
    assert outcome.committed == 100
    # and a second replay after the commit: all duplicates, the ledger unchanged
    again = dd.begin(keys, owner="query-1:7")
    assert not again.fresh
    assert len(again.duplicates) == 100
    assert dd.complete(replay, batch_id=7, app_id="query-1").replayed
    assert dd.ledger.audit() == []


def test_a_replay_that_succeeds_for_more_rows_commits_them_too(
    tmp_path: Path, real_redis: object, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    keys = [f"ORDERID_{i}" for i in range(10)]
    first = dd.begin(keys, owner="query-1:3")
    # The sink accepted only the first 4 rows; the batch committed them, then the
    # driver died before releasing the other claims or telling Spark.
    dd.complete(first, succeeded=first.fresh[:4], batch_id=3, app_id="query-1")
    replay = dd.begin(keys, owner="query-1:3")
    assert len(replay.fresh) == 6  # the 4 committed keys are duplicates now
    # This time the sink accepts every row: the 6 are not in the earlier commit of
    # batch 3, so they must reach the ledger under a txn of their own.
    outcome = dd.complete(replay, batch_id=3, app_id="query-1")
    assert outcome.replayed
    assert outcome.committed == 6
    since = dd.clock.now_ms() - 60_000
    assert sorted(dd.ledger.existing(keys, since_ms=since)) == sorted(keys)
    # Redis may lose everything: the ledger alone still makes every key a duplicate.
    real_redis.flushall()  # type: ignore[attr-defined]
    after = dd.begin(keys, owner="query-1:4")
    assert not after.fresh
    assert len(after.duplicates) == 10
    assert dd.ledger.audit() == []


def test_a_key_taken_over_from_an_expired_lease_is_reported_reclaimed(
    tmp_path: Path, real_redis: object, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url, lease_ms=1_000))
    keys = [f"ORDERID_{i}" for i in range(5)]
    dd.begin(keys, owner="worker-a:1")  # worker a stalls past its lease
    dd.clock = _Later(dd.clock, 2_000)
    dd.hot.clock = dd.clock  # type: ignore[attr-defined]
    taken = dd.begin(keys, owner="worker-b:1")
    assert taken.reclaimed == taken.fresh
    assert len(taken.reclaimed) == 5
    assert taken.counts.reclaimed == 5


def test_claims_lost_in_a_failover_still_reach_the_ledger_once(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The failover hole: both sinks run, but the ledger keeps each key once."""
    client = redis_server.client()
    client.flushall()
    a, b = Dedup(_config(tmp_path, redis_server.url)), Dedup(_config(tmp_path, redis_server.url))
    keys = [f"ORDERID_{i}" for i in range(200)]
    first = a.begin(keys, owner="worker-a:1")
    # A failover to a replica that lacks these claims (and nothing else).
    lost = list(client.scan_iter("idem:*:p:*"))  # the buckets' claim hashes
    assert sum(client.hlen(name) for name in lost) == 200
    client.delete(*lost)
    second = b.begin(keys, owner="worker-b:1")
    assert len(first.fresh) == len(second.fresh) == 200  # the hole: both would run the sink

    done_a = a.complete(first, batch_id=1, app_id="test:a")
    done_b = b.complete(second, batch_id=1, app_id="test:b")
    assert done_a.committed == 200
    assert (done_b.committed, sorted(done_b.slipped)) == (0, sorted(keys))
    assert a.ledger.audit() == []
    assert len(a.ledger.existing(keys, since_ms=None)) == 200
    again = a.begin(keys, owner="worker-a:2")
    assert again.fresh == ()
    assert len(again.duplicates) == 200


class _Later:
    """A clock ``ms`` ahead of another."""

    def __init__(self, clock: object, ms: int) -> None:
        self._clock, self._ms = clock, ms

    def now_ms(self) -> int:
        return self._clock.now_ms() + self._ms  # type: ignore[attr-defined,no-any-return]

    def sleep(self, seconds: float) -> None:
        self._clock.sleep(seconds)  # type: ignore[attr-defined]


# -- (f) an evicting Redis is refused ------------------------------------------------------


def test_allkeys_lru_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    with RedisServer(maxmemory_policy="allkeys-lru") as server:
        dd = Dedup(_config(tmp_path, server.url))
        with pytest.raises(UnsafeRedisConfig, match=r"allkeys-lru.*noeviction"):
            dd.check()


# -- (g) bad keys are reported, none dropped -----------------------------------------------


def test_bad_keys_come_back_invalid_with_reasons(
    tmp_path: Path, real_redis: object, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    batch: list[object] = [None, "", "   ", "x" * 600, b"\xff\xfe", 42, "ORDERID_1", "ORDERID_1"]
    claim = dd.begin(batch, owner="q:0", field="order_id")
    reasons = {bad.index: bad.reason for bad in claim.invalid}
    assert reasons == {
        0: "null",
        1: "empty",
        2: "empty",
        3: "too_long",
        4: "undecodable",
        5: "not_text",
    }
    too_long = next(bad for bad in claim.invalid if bad.reason == "too_long")
    assert "order_id" in too_long.message
    assert "512" in too_long.message
    assert claim.fresh == (6,)
    assert claim.duplicates == {7: DuplicateCause.IN_BATCH}
    # every row is accounted for
    c = claim.counts
    assert c.fresh + c.duplicates + c.busy + c.invalid == len(batch)


# -- (h) big batches: claimed in waves while the next slice is validated ------------------


def test_a_batch_bigger_than_a_wave_gets_every_verdict_right_across_wave_boundaries(
    tmp_path: Path, real_redis: object, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    done = [f"DONE_{i}" for i in range(300)]
    _process(dd, done, owner="earlier:0", batch_id=0)
    dd.settle()
    held = [f"HELD_{i}" for i in range(200)]
    dd.begin(held, owner="other:0")  # another owner's live leases: busy
    size = 3 * CLAIM_WAVE_ROWS + 17
    keys: list[object] = [f"NEW_{i}" for i in range(size)]
    # Repeats whose first copy sits in an earlier wave, completed and held keys in
    # every wave, and bad keys: each row must get exactly the verdict it would get in
    # a small batch.
    for i in range(CLAIM_WAVE_ROWS + 10, size, 997):
        keys[i] = keys[i - CLAIM_WAVE_ROWS - 5]
    for n, i in enumerate(range(3, size, size // 300 + 1)):
        keys[i] = done[n]
    for n, i in enumerate(range(7, size, size // 200 + 1)):
        keys[i] = held[n]
    for i, bad in ((11, None), (CLAIM_WAVE_ROWS, ""), (2 * CLAIM_WAVE_ROWS + 1, "x" * 600)):
        keys[i] = bad
    # What a small batch would answer, row by row.
    expected: dict[str, set[int]] = {v: set() for v in ("bad", "in_batch", "done", "busy", "new")}
    seen: set[object] = set()
    for i, key in enumerate(keys):
        if not key or len(str(key)) > 512:
            expected["bad"].add(i)
        elif key in seen:
            expected["in_batch"].add(i)
        else:
            seen.add(key)
            verdict = "done" if key in done else "busy" if key in held else "new"
            expected[verdict].add(i)
    claim = dd.begin(keys, owner="big:1")
    causes = {
        cause: {i for i, c in claim.duplicates.items() if c is cause} for cause in DuplicateCause
    }
    assert {bad.index for bad in claim.invalid} == expected["bad"]
    assert causes[DuplicateCause.IN_BATCH] == expected["in_batch"]
    assert causes[DuplicateCause.COMPLETED] == expected["done"]
    assert set(claim.busy) == expected["busy"]
    assert set(claim.fresh) == expected["new"]
    assert len(expected["in_batch"]) > 10
    assert len(expected["done"]) > 250
    assert len(expected["busy"]) > 150
    assert claim.fresh == tuple(sorted(claim.fresh))
    # the fresh keys are really held for this owner, and commit once
    assert not dd.begin([keys[i] for i in claim.fresh[:50]], owner="other:1").fresh
    assert dd.complete(claim, batch_id=1, app_id="big").committed == len(expected["new"])
    assert dd.ledger.audit() == []


def test_a_claim_whose_scripts_redis_forgot_or_whose_connection_died_still_gets_verdicts(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    keys = [f"ORDERID_{i}" for i in range(2_000)]
    real_redis.script_flush()  # a restarted Redis knows no script: every call is NOSCRIPT
    first = dd.begin(keys[:1_000], owner="q:1")
    assert len(first.fresh) == 1_000
    assert not first.retaken
    # The connection dies after the calls went out: nobody knows which ran, so all
    # are sent again; those that ran come back as this owner's own claims (re-taken).
    pending = dd.start(keys, owner="q:2")
    real_redis.client_kill_filter(_type="normal", skipme=True)
    claim = pending.finish()
    assert len(claim.fresh) == 1_000  # keys[1000:]; the first thousand are q:1's
    assert len(claim.busy) == 1_000
    assert dd.complete(claim, batch_id=2, app_id="q").committed == 1_000


def test_a_complete_whose_scripts_redis_forgot_marks_every_key_and_moves_the_watermarks(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    keys = [f"ORDERID_{i}" for i in range(20_000)]  # > 1 complete call per bucket: parts + end
    claim = dd.begin(keys, owner="q:1")
    real_redis.script_flush()  # Redis restarted between the claim and the complete
    outcome = dd.complete(claim, batch_id=1, app_id="q")
    assert outcome.committed == len(keys)
    assert set(dd.hot.watermarks().values()) == {outcome.version}
    again = dd.begin(keys, owner="q:2")
    assert not again.fresh
    assert len(again.duplicates) == len(keys)


# -- (i) a sink that is the ledger takes no leases ------------------------------------------


def _payload(keys: list[str], writer: str) -> Any:
    import pyarrow as pa

    return pa.table({"amount": pa.array([1.0] * len(keys)), "writer": [writer] * len(keys)})


def test_two_writers_of_a_ledger_sink_without_leases_write_each_key_once(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    a = Dedup(_config(tmp_path, redis_server.url))
    b = Dedup(_config(tmp_path, redis_server.url))
    keys = [f"ORDERID_{i}" for i in range(500)]
    # Both look the keys up before either commits: without leases both see them as new.
    claim_a = a.begin(keys, owner="a:1", hold=False)
    claim_b = b.begin(keys[250:] + [f"B_ONLY_{i}" for i in range(50)], owner="b:1", hold=False)
    assert len(claim_a.fresh) == 500
    assert len(claim_b.fresh) == 300
    assert not list(real_redis.scan_iter("idem:*:p:*"))  # no lease written
    done_a = a.complete(claim_a, batch_id=1, app_id="a", payload=_payload(keys, "a"))
    rows_b = [claim_b.keys[i] or "" for i in claim_b.fresh]
    done_b = b.complete(claim_b, batch_id=1, app_id="b", payload=_payload(rows_b, "b"))
    # The ledger's checked commit is what keeps the second writer out, not a lease.
    assert done_a.committed == 500
    assert done_b.committed == 50
    assert sorted(done_b.slipped) == sorted(keys[250:])
    assert a.ledger.audit() == []
    since = a.clock.now_ms() - 60_000
    assert len(a.ledger.existing(keys, since_ms=since)) == 500
    # and afterwards they are duplicates for everyone
    a.settle()
    b.settle()
    assert len(b.begin(keys, owner="b:2", hold=False).duplicates) == 500


def test_a_lookup_without_lease_still_respects_another_owners_live_lease(
    tmp_path: Path, real_redis: object, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    keys = [f"ORDERID_{i}" for i in range(20)]
    dd.begin(keys[:5], owner="consumer:1")  # a function sink holds these
    looked = dd.begin(keys, owner="delta:1", hold=False)
    assert sorted(looked.busy) == list(range(5))
    assert len(looked.fresh) == 15


def test_a_lease_free_commit_that_must_merge_still_finds_a_copy_committed_long_ago(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    # A backfill (w1) looks K up, a live query (w2) writes K and then many more batches;
    # w1 commits 12 minutes later, too many versions on to check them one by one. Its
    # MERGE must reach back to K's row: no lease kept w2 off K in between.
    w1 = Dedup(_config(tmp_path, redis_server.url))
    w2 = Dedup(_config(tmp_path, redis_server.url))
    _process(w2, ["SEED"], owner="w2:0", batch_id=0)
    w2.settle()
    early = w1.begin(["K"], owner="w1:1", hold=False)
    assert early.fresh == (0,)
    for batch_id, keys in enumerate([["K"], *([f"X{i}"] for i in range(70))], start=1):
        claim = w2.begin(keys, owner=f"w2:{batch_id}", hold=False)
        w2.complete(claim, batch_id=batch_id, app_id="w2", payload=_payload(keys, "w2"))
        w2.settle()
    w1.clock = _Later(w1.clock, 12 * 60_000)  # past twice the lease (5 min)
    done = w1.complete(early, batch_id=1, app_id="w1", payload=_payload(["K"], "w1"))
    assert (done.committed, done.slipped) == (0, ("K",))
    assert w1.ledger.audit() == []


def test_a_claim_given_up_after_its_calls_went_out_leaves_no_key_held(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    keys = [f"ORDERID_{i}" for i in range(3 * CLAIM_WAVE_ROWS)]
    with pytest.raises(ValueError, match="fingerprints: 2 given"):
        dd.begin(keys, owner="q:1", fingerprints=["a", "b"])
    # Sent, then given up (the Spark side failed to hash the rows meanwhile): the leases go.
    dd.start(keys, owner="q:2").abandon()
    pending = dd.start(keys[:10], owner="q:3")
    with pytest.raises(ValueError, match="fingerprints: 1 given for 10 keys"):
        pending.finish(["x"])
    other = dd.begin(keys, owner="other:1")
    assert len(other.fresh) == len(keys)
    assert not other.busy
    assert dd.complete(other, batch_id=1, app_id="other").committed == len(keys)


def test_a_leased_commit_that_must_merge_finds_a_copy_landed_after_its_claim_however_slow(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    # w0 claims K and stalls past its lease; w1 takes K over and is slow too: it commits
    # 16 minutes and 70 versions later. Meanwhile w0 woke up and committed K (its Redis
    # completion is fenced by w1's lease, its ledger row lands). w1's commit must MERGE
    # back to its own claim, not to "now minus two leases", or K lands twice.
    config = _config(tmp_path, redis_server.url)
    w0, w1, w2 = Dedup(config), Dedup(config), Dedup(config)
    stalled = w0.begin(["K"], owner="w0:1")
    assert stalled.fresh == (0,)
    taken_at = config.lease_ms + 60_000
    w1.clock = w1.hot.clock = _Later(w1.clock, taken_at)  # type: ignore[attr-defined]
    taken = w1.begin(["K"], owner="w1:1")
    assert taken.reclaimed == (0,)
    w0.clock = _Later(w0.clock, taken_at + 30_000)
    assert w0.complete(stalled, batch_id=1, app_id="w0").committed == 1
    for batch_id in range(1, 71):
        _process(w2, [f"X{batch_id}"], owner=f"w2:{batch_id}", batch_id=batch_id)
    w1.clock = _Later(w1.clock, 16 * 60_000)
    done = w1.complete(taken, batch_id=1, app_id="w1")
    assert (done.committed, done.slipped) == (0, ("K",))
    assert w1.ledger.audit() == []


def test_a_key_that_is_not_valid_unicode_is_invalid_and_the_rest_of_the_batch_goes_on(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    claim = dd.begin(["A", "ORDER_\ud800", "B", "\u00e9t\u00e9"], owner="q:1")
    assert claim.fresh == (0, 2, 3)
    assert [(bad.index, bad.reason) for bad in claim.invalid] == [(1, "undecodable")]
    assert dd.complete(claim, batch_id=1, app_id="q").committed == 3


def test_a_fingerprint_with_a_bar_or_an_order_missing_rows_is_refused_before_anything_lands(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    with pytest.raises(ValueError, match=r"row 1's fingerprint 'ab\|c' contains '\|'"):
        dd.begin(["A", "B"], owner="q:1", fingerprints=["00", "ab|c"])
    with pytest.raises(ValueError, match="order: must list each of the 3 rows once"):
        dd.begin(["A", "B", "C"], owner="q:1", order=[0, 2])
    with pytest.raises(ValueError, match="order"):
        dd.begin(["A", "B"], owner="q:1", order=[0, 1, 0])
    # Nothing was held or written: another owner takes every key, and the ledger is empty.
    other = Dedup(_config(tmp_path, redis_server.url))
    assert other.begin(["A", "B", "C"], owner="o:1").fresh == (0, 1, 2)
    assert dd.ledger.version() == -1


def test_a_slipped_copy_leaves_the_stored_rows_fingerprint_in_the_index(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    # Two lease-free writers of one ledger sink: q2 looks K up (payload "two"), q1 writes K
    # (payload "one"), q2's copy of K slips. The ledger holds q1's row; a later copy with
    # q1's payload is a plain duplicate and one with q2's payload is the mismatch.
    config = _config(tmp_path, redis_server.url)
    q1, q2 = Dedup(config), Dedup(config)
    late = q2.begin(["K", "L"], owner="q2:1", hold=False, fingerprints=["two", "el"])
    first = q1.begin(["K"], owner="q1:1", hold=False, fingerprints=["one"])
    q1.complete(first, batch_id=1, app_id="q1", payload=_payload(["K"], "q1"))
    done = q2.complete(late, batch_id=1, app_id="q2", payload=_payload(["K", "L"], "q2"))
    assert (done.committed, done.slipped) == (1, ("K",))
    for writer in (q1, q2):
        writer.settle()
    again = Dedup(config).begin(["K", "K"], owner="q3:1", fingerprints=["one", "two"])
    assert again.duplicates == {0: DuplicateCause.COMPLETED, 1: DuplicateCause.IN_BATCH}
    assert again.mismatched == ()
    other = Dedup(config).begin(["K"], owner="q4:1", fingerprints=["two"])
    assert other.mismatched == (0,)
    assert other.stored_fingerprints == {0: "one"}


def test_a_ledger_refuses_another_group_and_another_bucket_count(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    # One IDEM_LEDGER_PATH for two groups would let group b's keys be suppressed by
    # group a's rows; a changed bucket count would put keys in other buckets than their
    # first copies. Both are refused with the field that is wrong, before anything lands.
    shared = str(tmp_path / "one-ledger")
    a = Dedup(_config(tmp_path, redis_server.url, ledger_path=shared))
    _process(a, ["K1"], owner="a:1", batch_id=1)
    b = Dedup(_config(tmp_path, redis_server.url, ledger_path=shared).with_changes(group="refunds"))
    with pytest.raises(
        ConfigError, match=r"ledger_path: .* belongs to group 'orders', not 'refunds'"
    ):
        _process(b, ["K1", "K2"], owner="b:1", batch_id=1)
    fewer = Dedup(_config(tmp_path, redis_server.url, ledger_path=shared).with_changes(buckets=4))
    with pytest.raises(ConfigError, match=r"buckets: .* written with 8 buckets, not 4"):
        _process(fewer, ["K3"], owner="a:2", batch_id=2)
    assert a.ledger.audit() == []
    assert len(a.ledger.existing(["K1", "K2", "K3"], since_ms=None)) == 1


def test_a_ledger_opened_before_another_group_created_it_is_refused_before_any_verdict(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    # refunds points at orders' ledger path before that ledger exists; once orders writes
    # it, refunds' next claim must refuse it, not count orders' keys as its duplicates.
    shared = str(tmp_path / "one-ledger")
    refunds = Dedup(
        _config(tmp_path, redis_server.url, ledger_path=shared).with_changes(group="refunds")
    )
    assert refunds.begin(["X"], owner="r:0", hold=False).fresh == (0,)
    _process(Dedup(_config(tmp_path, redis_server.url, ledger_path=shared)), ["K1"], "o:1", 1)
    with pytest.raises(ConfigError, match="belongs to group 'orders', not 'refunds'"):
        refunds.begin(["K1"], owner="r:1")
