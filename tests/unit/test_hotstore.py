"""The Redis hot store's behaviour, on fakeredis and on a real redis-server.

Every test in the suite runs against both backends through ``any_redis``; time
is a ManualClock, so lease expiry never sleeps.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from idem import claim_calls, hotstore
from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.errors import StoreUnavailable
from idem.hotstore import KeyStatus, RedisHotStore
from idem.keys import bucket_of, group_by_bucket
from idem.redis_server import free_port

BUCKETS = 4
LEASE_MS = 30_000
WINDOW_MS = 86_400_000
FP = "9f86d081884c7d659a2feaa0c55ad015"


def by_bucket(keys: Sequence[str]) -> dict[int, list[str]]:
    return group_by_bucket(keys, BUCKETS)


def make_store(
    client: redis.Redis, clock: ManualClock, *, indexed: int | None = -1
) -> RedisHotStore:
    store = RedisHotStore(
        client,
        group="orders",
        buckets=BUCKETS,
        lease_ms=LEASE_MS,
        completed_ttl_ms=WINDOW_MS,
        clock=clock,
    )
    if indexed is not None:  # an empty ledger (version -1) is fully indexed
        for bucket in range(BUCKETS):
            assert store.index_completed(bucket, [], [], [], to_version=indexed, from_version=None)
    return store


@pytest.fixture
def store(any_redis: redis.Redis, clock: ManualClock) -> RedisHotStore:
    return make_store(any_redis, clock)


KEYS = [f"ORDERID_{n}" for n in range(40)]


# -- claims ----------------------------------------------------------------------------


def test_a_fresh_claim_takes_every_new_key(store: RedisHotStore, clock: ManualClock) -> None:
    result = store.claim(by_bucket(KEYS), "batch-1", min_version=-1)
    assert sorted(result.claimed) == sorted(KEYS)
    assert (result.retaken, result.duplicates, result.busy, result.stale) == ([], {}, [], [])
    assert result.stale_buckets == frozenset()
    state = store.lookup(by_bucket(KEYS[:1]))[KEYS[0]]
    assert state.status is KeyStatus.IN_PROGRESS
    assert (state.owner, state.attempt) == ("batch-1", 1)
    assert state.lease_until_ms == clock.now_ms() + LEASE_MS


@pytest.mark.parametrize("named", [True, False], ids=["keys-named", "tracked"])
def test_renew_extends_only_the_claims_the_owner_still_holds(
    store: RedisHotStore, clock: ManualClock, named: bool
) -> None:
    """Named: the holder names its keys. Tracked: the claim recorded them under the owner
    (``track``), and the holder renews without naming any (a Spark driver)."""
    held, released, done, theirs, absent = KEYS[:5], KEYS[5:8], KEYS[8:10], KEYS[10:12], KEYS[12:14]
    calls = store.start_claim("a", min_version=-1, track=not named)
    calls.add(by_bucket(held + released + done))
    calls.result()
    store.claim(by_bucket(theirs), "b", min_version=-1)
    store.release(by_bucket(released), "a")
    store.complete(by_bucket(done), "a", dict.fromkeys(done, FP), version=0)
    clock.advance(20)  # of the 30 s lease
    if named:
        renewed = store.renew(by_bucket(held + released + done + theirs + absent), "a")
        assert sorted(renewed) == sorted(held)
    else:
        assert store.renew_tracked("a") == len(held)
        assert store.renew_tracked("a") == len(held)  # what is no longer held is forgotten
        tracked = [store.owned_name(b, "a") for b in range(BUCKETS)]
        assert sorted(k for name in tracked for k in store.client.hkeys(name)) == sorted(
            k.encode() for k in held
        )
        assert store.renew_tracked("b") == 0  # b claimed without tracking
    states = store.lookup(by_bucket(held + released + done + theirs + absent))
    assert {states[k].lease_until_ms for k in held} == {clock.now_ms() + LEASE_MS}
    assert {states[k].attempt for k in held} == {1}
    assert {states[k].status for k in released + absent} == {KeyStatus.ABSENT}
    assert {states[k].status for k in done} == {KeyStatus.COMPLETED}
    assert {(states[k].owner, states[k].lease_until_ms) for k in theirs} == {
        ("b", clock.now_ms() - 20_000 + LEASE_MS)
    }
    clock.advance(20)  # a's first lease is over, the renewed one is not
    assert not store.claim(by_bucket(held), "b", min_version=-1).claimed


def test_a_tracked_renewal_goes_through_many_keys_in_short_calls_and_ends_with_the_record(
    store: RedisHotStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hotstore, "RENEW_SCAN", 50)  # keys one renew.lua call looks at
    many = [f"K{n}" for n in range(2_000)]
    calls = store.start_claim("q:7", min_version=-1, track=True)
    calls.add(by_bucket(many))
    assert len(calls.result().claimed) == len(many)
    clock.advance(LEASE_MS / 1000 - 1)
    assert store.renew_tracked("q:7") == len(many)
    clock.advance(LEASE_MS / 1000 - 1)  # past the claim's lease, within the renewed one
    assert store.claim(by_bucket(many), "other", min_version=-1).busy
    assert not store.claim(by_bucket(many), "other", min_version=-1).claimed
    store.untrack("q:7")
    assert store.renew_tracked("q:7") == 0  # the claims stay; only the record is gone
    assert store.lookup(by_bucket(many[:1]))[many[0]].owner == "q:7"


def test_a_completed_key_is_a_duplicate_carrying_its_fingerprint(store: RedisHotStore) -> None:
    grouped = by_bucket(KEYS)
    store.claim(grouped, "batch-1", min_version=-1)
    prints = {key: f"fp-{key}" for key in KEYS}
    done = store.complete(grouped, "batch-1", prints, version=0)
    assert (done.completed, done.fenced, done.watermark_advanced) == (len(KEYS), [], True)

    again = store.claim(by_bucket(["ORDERID_3", "NEW"]), "batch-2", min_version=0)
    assert again.duplicates == {"ORDERID_3": "fp-ORDERID_3"}
    assert again.claimed == ["NEW"]


def test_another_owner_is_busy_while_the_lease_lives(
    store: RedisHotStore, clock: ManualClock
) -> None:
    store.claim(by_bucket(KEYS), "batch-1", min_version=-1)
    clock.advance(LEASE_MS / 1000 - 1)
    result = store.claim(by_bucket(KEYS), "batch-2", min_version=-1)
    assert sorted(result.busy) == sorted(KEYS)
    assert result.claimed == []
    assert store.lookup(by_bucket(KEYS[:1]))[KEYS[0]].owner == "batch-1"


def test_an_expired_lease_is_claimed_again_with_the_next_attempt(
    store: RedisHotStore, clock: ManualClock
) -> None:
    store.claim(by_bucket(["K"]), "batch-1", min_version=-1)
    clock.advance(LEASE_MS / 1000)
    taken = store.claim(by_bucket(["K"]), "batch-2", min_version=-1)
    assert taken.claimed == taken.reclaimed == ["K"]
    assert taken.retaken == []
    state = store.lookup(by_bucket(["K"]))["K"]
    assert (state.owner, state.attempt) == ("batch-2", 2)
    assert state.lease_until_ms == clock.now_ms() + LEASE_MS
    # The first owner has lost it to a live lease now.
    assert store.claim(by_bucket(["K"]), "batch-1", min_version=-1).busy == ["K"]


def test_the_same_owner_retakes_its_claims_on_replay(
    store: RedisHotStore, clock: ManualClock
) -> None:
    store.claim(by_bucket(KEYS), "query-7:batch-3", min_version=-1)
    clock.advance(LEASE_MS / 1000 + 5)  # even after its lease ran out
    replay = store.claim(by_bucket(KEYS), "query-7:batch-3", min_version=-1)
    assert sorted(replay.claimed) == sorted(replay.retaken) == sorted(KEYS)
    state = store.lookup(by_bucket(KEYS[:1]))[KEYS[0]]
    assert state.attempt == 1  # a replay is the same attempt
    assert state.lease_until_ms == clock.now_ms() + LEASE_MS  # with a renewed lease


def test_every_key_lands_in_exactly_one_outcome(store: RedisHotStore, clock: ManualClock) -> None:
    store.claim(by_bucket(["done", "mine"]), "a", min_version=-1)
    store.complete(by_bucket(["done"]), "a", {"done": FP}, version=0)
    store.claim(by_bucket(["theirs"]), "b", min_version=0)
    result = store.claim(by_bucket(["done", "mine", "theirs", "new"]), "a", min_version=0)
    assert sorted(result.claimed) == ["mine", "new"]
    assert result.retaken == ["mine"]
    assert result.duplicates == {"done": FP}
    assert result.busy == ["theirs"]


def test_keys_of_one_bucket_are_claimed_in_several_calls(
    store: RedisHotStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(claim_calls, "CLAIM_CHUNK", 3)  # claims
    monkeypatch.setattr(hotstore, "CLAIM_CHUNK", 3)  # release
    store.claim(by_bucket(KEYS[:5]), "a", min_version=-1)
    store.complete(by_bucket(KEYS[:2]), "a", dict.fromkeys(KEYS[:2], FP), version=0)
    result = store.claim(by_bucket(KEYS), "a", min_version=0)
    assert sorted(result.claimed) == sorted(KEYS[2:])
    assert sorted(result.retaken) == sorted(KEYS[2:5])
    assert result.duplicates == dict.fromkeys(KEYS[:2], FP)
    assert store.release(by_bucket(KEYS), "a") == len(KEYS) - 2


def test_an_empty_claim_costs_nothing(store: RedisHotStore) -> None:
    result = store.claim({}, "a", min_version=-1)
    assert (result.claimed, result.stale_buckets) == ([], frozenset())


def test_any_text_is_a_key_and_an_empty_fingerprint_is_kept(store: RedisHotStore) -> None:
    odd = ["a|b", "{other-tag}", "ключ-1", " padded ", "x:y:z", "订单_100"]
    store.claim(by_bucket(odd), "a", min_version=-1)
    store.complete(by_bucket(odd), "a", dict.fromkeys(odd, ""), version=0)
    assert store.claim(by_bucket(odd), "b", min_version=0).duplicates == dict.fromkeys(odd, "")
    assert store.claim_hash("{other-tag}").startswith("idem:{orders:")


# -- completion and fencing ------------------------------------------------------------


def test_complete_fences_a_key_another_owner_holds(
    store: RedisHotStore, clock: ManualClock
) -> None:
    store.claim(by_bucket(["slow", "fast"]), "a", min_version=-1)
    clock.advance(LEASE_MS / 1000 + 1)
    store.claim(by_bucket(["slow"]), "b", min_version=-1)  # a's lease ran out; b took over
    done = store.complete(by_bucket(["slow", "fast"]), "a", {"slow": FP, "fast": FP}, version=0)
    assert done.fenced == ["slow"]
    assert done.completed == 1
    states = store.lookup(by_bucket(["slow", "fast"]))
    assert (states["slow"].status, states["slow"].owner) == (KeyStatus.IN_PROGRESS, "b")
    assert states["fast"].status is KeyStatus.COMPLETED
    # The fenced bucket did not index version 0; every other bucket did.
    assert not done.watermark_advanced
    slow_bucket = bucket_of("slow", BUCKETS)
    assert done.lagging_buckets == {slow_bucket}
    marks = store.watermarks()
    assert marks[slow_bucket] == -1
    assert all(mark == 0 for bucket, mark in marks.items() if bucket != slow_bucket)


def test_complete_covers_absent_and_expired_claims(
    store: RedisHotStore, clock: ManualClock
) -> None:
    store.claim(by_bucket(["expired"]), "b", min_version=-1)
    clock.advance(LEASE_MS / 1000 + 1)
    keys = ["expired", "never-claimed"]
    done = store.complete(by_bucket(keys), "a", dict.fromkeys(keys, FP), version=0)
    assert (done.completed, done.fenced) == (2, [])
    assert {s.status for s in store.lookup(by_bucket(keys)).values()} == {KeyStatus.COMPLETED}


def test_complete_needs_a_fingerprint_for_every_key(store: RedisHotStore) -> None:
    with pytest.raises(ValueError, match="fingerprints: no fingerprint for key 'B'"):
        store.complete(by_bucket(["A", "B"]), "a", {"A": FP}, version=0)


def test_completed_keys_live_for_the_dedup_window(store: RedisHotStore, clock: ManualClock) -> None:
    hour = 3_600_000
    store.complete(by_bucket(["now"]), "a", {"now": FP}, version=0)
    store.complete(
        by_bucket(["earlier"]),
        "a",
        {"earlier": FP},
        version=1,
        completed_at_ms=clock.now_ms() - hour,
    )
    state = store.lookup(by_bucket(["earlier"]))["earlier"]
    assert state.completed_at_ms == clock.now_ms() - hour
    clock.advance((WINDOW_MS - hour - 1) / 1000)  # the last moment of "earlier"'s window
    result = store.claim(by_bucket(["now", "earlier"]), "b", min_version=1)
    assert sorted(result.duplicates) == ["earlier", "now"], result
    clock.advance(0.001)  # "earlier" has left the window, "now" has not
    result = store.claim(by_bucket(["now", "earlier"]), "b", min_version=1)
    assert (result.claimed, sorted(result.duplicates)) == (["earlier"], ["now"])
    clock.advance(hour / 1000)
    assert store.claim(by_bucket(["now"]), "b", min_version=1).claimed == ["now"]


def test_completed_keys_do_not_outlive_two_windows_in_redis(
    any_redis: redis.Redis, store: RedisHotStore, clock: ManualClock
) -> None:
    store.complete(by_bucket(KEYS), "a", dict.fromkeys(KEYS, FP), version=0)
    hashes = list(any_redis.scan_iter("idem:*:c:*"))
    assert hashes  # the keys are held in generation hashes, each with a TTL ...
    for name in hashes:
        assert 0 < any_redis.pttl(name) <= 2 * WINDOW_MS  # ... of at most two windows
    assert not list(any_redis.scan_iter("idem:*:p:*"))  # and no claim is left behind


def test_an_abandoned_claim_is_remembered_for_an_hour_and_then_forgotten(
    any_redis: redis.Redis, store: RedisHotStore, clock: ManualClock
) -> None:
    store.claim(by_bucket(["abandoned"]), "a", min_version=-1)
    ttl = any_redis.pttl(store.claim_hash("abandoned"))
    assert LEASE_MS < ttl <= 2 * hotstore.CLAIM_GEN_MS  # its hash outlives the lease, not more
    clock.advance(2 * LEASE_MS / 1000)  # the lease has expired: another owner takes it over
    assert store.claim(by_bucket(["abandoned"]), "b", min_version=-1).reclaimed == ["abandoned"]
    clock.advance(3 * hotstore.CLAIM_GEN_MS / 1000)  # b abandons it too, hours pass
    again = store.claim(by_bucket(["abandoned"]), "c", min_version=-1)
    assert (again.claimed, again.reclaimed) == (["abandoned"], [])  # a plain new claim now


def test_big_completions_are_chunked_and_fenced_as_a_whole(
    store: RedisHotStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hotstore, "COMPLETE_CHUNK", 2)
    keys = [f"K{n}" for n in range(30)]
    store.claim(by_bucket(keys), "a", min_version=-1)
    clock.advance(LEASE_MS / 1000 + 1)
    store.claim(by_bucket([keys[0]]), "b", min_version=-1)  # one key of one bucket fenced
    done = store.complete(by_bucket(keys), "a", dict.fromkeys(keys, FP), version=0)
    assert (done.completed, done.fenced) == (29, [keys[0]])
    assert done.lagging_buckets == {bucket_of(keys[0], BUCKETS)}
    assert sum(mark == 0 for mark in store.watermarks().values()) == BUCKETS - 1


# -- release ---------------------------------------------------------------------------


def test_only_the_owner_releases_its_claims(store: RedisHotStore) -> None:
    store.claim(by_bucket(KEYS), "a", min_version=-1)
    store.complete(by_bucket(KEYS[:5]), "a", dict.fromkeys(KEYS[:5], FP), version=0)
    assert store.release(by_bucket(KEYS), "b") == 0
    assert store.release(by_bucket(KEYS), "a") == len(KEYS) - 5
    states = store.lookup(by_bucket(KEYS))
    assert {k for k, s in states.items() if s.status is KeyStatus.COMPLETED} == set(KEYS[:5])
    assert {k for k, s in states.items() if s.status is KeyStatus.ABSENT} == set(KEYS[5:])
    # A released key is new again for anyone.
    assert store.claim(by_bucket(KEYS[5:6]), "b", min_version=0).claimed == KEYS[5:6]


# -- watermarks: when "absent" can be trusted ----------------------------------------------


def test_a_bucket_without_watermark_claims_nothing(
    any_redis: redis.Redis, clock: ManualClock
) -> None:
    store = make_store(any_redis, clock, indexed=None)
    assert store.watermarks() == dict.fromkeys(range(BUCKETS))
    result = store.claim(by_bucket(KEYS), "a", min_version=-1)
    assert result.claimed == []
    assert sorted(result.stale) == sorted(KEYS)
    assert result.stale_buckets == set(by_bucket(KEYS))
    assert all(s.status is KeyStatus.ABSENT for s in store.lookup(by_bucket(KEYS)).values())


def test_a_bucket_behind_the_ledger_is_stale(store: RedisHotStore) -> None:
    store.complete({}, "a", {}, version=0)  # every bucket indexes version 0
    result = store.claim(by_bucket(KEYS), "a", min_version=1)
    assert result.claimed == []
    assert result.stale_buckets == set(by_bucket(KEYS))


def test_only_stale_buckets_are_held_back(store: RedisHotStore) -> None:
    store.complete({}, "a", {}, version=0)
    behind = bucket_of(KEYS[0], BUCKETS)
    store.drop_watermark(behind)
    result = store.claim(by_bucket(KEYS), "a", min_version=0)
    assert result.stale_buckets == {behind}
    assert sorted(result.stale) == sorted(by_bucket(KEYS)[behind])
    assert sorted(result.claimed + result.stale) == sorted(KEYS)


def test_a_rebuild_indexes_the_window_and_sets_the_watermark(
    any_redis: redis.Redis, clock: ManualClock
) -> None:
    store = make_store(any_redis, clock, indexed=None)
    grouped = by_bucket(KEYS)
    now = clock.now_ms()
    for bucket in range(BUCKETS):
        keys = grouped.get(bucket, [])
        assert store.index_completed(
            bucket,
            keys,
            [f"fp-{k}" for k in keys],
            [now - 1000] * len(keys),
            to_version=7,
            from_version=None,
        )
    assert store.watermarks() == dict.fromkeys(range(BUCKETS), 7)
    result = store.claim(by_bucket([*KEYS, "NEW"]), "a", min_version=7)
    assert result.duplicates == {k: f"fp-{k}" for k in KEYS}
    assert result.claimed == ["NEW"]


def test_a_catch_up_advances_only_from_where_the_index_stands(store: RedisHotStore) -> None:
    bucket = bucket_of("X", BUCKETS)
    store.complete({}, "a", {}, version=3)
    assert store.watermarks([bucket]) == {bucket: -1}  # -1 -> 3 skips versions 0..2
    assert store.index_completed(bucket, [], [], [], to_version=3, from_version=-1)
    # A load of versions 6..9 cannot advance an index that stands at 3.
    assert not store.index_completed(bucket, ["X"], [FP], [0], to_version=9, from_version=5)
    assert store.watermarks([bucket]) == {bucket: 3}
    # A load of 4..9 can.
    assert store.index_completed(bucket, [], [], [], to_version=9, from_version=3)
    # A late, lower load never moves it back.
    assert store.index_completed(bucket, [], [], [], to_version=5, from_version=2)
    assert store.watermarks([bucket]) == {bucket: 9}


def test_a_catch_up_never_creates_a_missing_watermark(
    any_redis: redis.Redis, clock: ManualClock
) -> None:
    store = make_store(any_redis, clock, indexed=None)
    assert not store.index_completed(0, [], [], [], to_version=4, from_version=3)
    assert store.watermarks([0]) == {0: None}


def test_complete_advances_the_watermark_one_version_at_a_time(store: RedisHotStore) -> None:
    assert store.complete({}, "a", {}, version=0).watermark_advanced  # -1 -> 0
    skipped = store.complete({}, "a", {}, version=2)  # version 1 was never indexed
    assert not skipped.watermark_advanced
    assert skipped.lagging_buckets == set(range(BUCKETS))
    assert set(store.watermarks().values()) == {0}
    assert store.complete({}, "a", {}, version=1).watermark_advanced
    late = store.complete({}, "a", {}, version=1)  # a replay: already covered
    assert late.watermark_advanced
    assert set(store.watermarks().values()) == {1}


def test_complete_never_creates_a_missing_watermark(
    any_redis: redis.Redis, clock: ManualClock
) -> None:
    store = make_store(any_redis, clock, indexed=None)
    done = store.complete(by_bucket(["A"]), "a", {"A": FP}, version=0)
    assert done.completed == 1
    assert not done.watermark_advanced
    assert store.watermarks() == dict.fromkeys(range(BUCKETS))


# -- loading from the ledger ---------------------------------------------------------------


def test_the_ledger_overrides_a_claim_and_the_latest_completion_wins(
    store: RedisHotStore, clock: ManualClock
) -> None:
    now = clock.now_ms()
    store.claim(by_bucket(["claimed"]), "a", min_version=-1)
    bucket = bucket_of("claimed", BUCKETS)
    store.index_completed(bucket, ["claimed"], ["fp-1"], [now - 10], to_version=0, from_version=-1)
    store.index_completed(bucket, ["claimed"], ["fp-0"], [now - 20], to_version=0, from_version=-1)
    state = store.lookup({bucket: ["claimed"]})["claimed"]
    assert (state.status, state.fingerprint, state.completed_at_ms) == (
        KeyStatus.COMPLETED,
        "fp-1",
        now - 10,
    )


def test_keys_past_the_window_are_not_loaded(
    any_redis: redis.Redis, store: RedisHotStore, clock: ManualClock
) -> None:
    now = clock.now_ms()
    old, young = by_bucket(KEYS)[1][:2]
    store.index_completed(
        1, [old, young], [FP, FP], [now - WINDOW_MS, now - 1000], to_version=0, from_version=-1
    )
    states = store.lookup({1: [old, young]})
    assert states[old].status is KeyStatus.ABSENT
    assert states[young].status is KeyStatus.COMPLETED
    clock.advance((WINDOW_MS - 1000 - 1) / 1000)  # young's last moment in the window
    assert store.claim({1: [old, young]}, "b", min_version=0).claimed == [old]
    clock.advance(0.001)
    assert store.claim({1: [young]}, "b", min_version=0).claimed == [young]


def test_big_loads_are_chunked(
    store: RedisHotStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hotstore, "INDEX_CHUNK", 3)
    monkeypatch.setattr(hotstore, "INDEX_CHUNKS_PER_PIPELINE", 2)
    keys = by_bucket([f"K{n}" for n in range(200)])[1]
    now = clock.now_ms()
    assert store.index_completed(
        1, keys, [f"fp-{k}" for k in keys], [now] * len(keys), to_version=0, from_version=-1
    )
    result = store.claim({1: keys}, "a", min_version=0)
    assert result.duplicates == {k: f"fp-{k}" for k in keys}


def test_a_load_that_loses_redis_halfway_does_not_set_the_watermark(
    any_redis: redis.Redis,
    store: RedisHotStore,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hotstore, "INDEX_CHUNK", 3)
    monkeypatch.setattr(hotstore, "INDEX_CHUNKS_PER_PIPELINE", 2)
    keys = by_bucket([f"K{n}" for n in range(200)])[1]
    real_run = store._run
    calls = 0

    def lose_everything_after_the_first_round_trip(pipe: object, operation: str) -> list[object]:
        nonlocal calls
        replies = real_run(pipe, operation)
        calls += 1
        if calls == 1:
            any_redis.flushall()  # Redis restarted empty between two round trips
        return replies

    monkeypatch.setattr(store, "_run", lose_everything_after_the_first_round_trip)
    loaded = store.index_completed(
        1, keys, [FP] * len(keys), [clock.now_ms()] * len(keys), to_version=0, from_version=None
    )
    assert not loaded
    assert store.watermarks([1]) == {1: None}  # still unknown: the next claim rebuilds


# -- layout, clients, input ----------------------------------------------------------------


def test_keys_of_a_bucket_share_one_cluster_slot(
    any_redis: redis.Redis, store: RedisHotStore
) -> None:
    store.claim(by_bucket(KEYS), "a", min_version=-1)
    store.complete(by_bucket(KEYS[:10]), "a", dict.fromkeys(KEYS[:10], FP), version=0)
    names = [_text(n) for n in any_redis.scan_iter(match="idem:*", count=1000)]
    completed = {bucket_of(key, BUCKETS) for key in KEYS[:10]}
    claiming = {bucket_of(key, BUCKETS) for key in KEYS[10:]}
    # per bucket: a claim hash of the open claims, a completed generation, a watermark
    assert len(names) == len(claiming) + len(completed) + BUCKETS
    for name in names:
        layout = re.fullmatch(r"idem:\{orders:(\d+)\}:(p:\d+:\d+|c:\d+:\d+|wm)", name)
        assert layout is not None, name
        bucket = int(layout.group(1))
        assert key_slot(name.encode()) == key_slot(store.watermark_name(bucket).encode())
    assert store.claim_hash("ORDERID_1").startswith(
        f"idem:{{orders:{bucket_of('ORDERID_1', 4)}}}:p:"
    )
    slots = {key_slot(store.watermark_name(b).encode()) for b in range(BUCKETS)}
    assert len(slots) == BUCKETS  # buckets spread over the cluster


def _text(name: bytes | str) -> str:
    return name.decode() if isinstance(name, bytes) else name


@pytest.fixture
def decoding_redis() -> Iterator[redis.Redis]:
    client = fakeredis.FakeRedis(decode_responses=True)
    yield client
    client.close()


@pytest.mark.unit
def test_a_client_that_decodes_responses_works_the_same(
    decoding_redis: redis.Redis, clock: ManualClock
) -> None:
    store = make_store(decoding_redis, clock)
    store.claim(by_bucket(["A", "B"]), "a", min_version=-1)
    store.complete(by_bucket(["A"]), "a", {"A": FP}, version=0)
    result = store.claim(by_bucket(["A", "B"]), "b", min_version=0)
    assert (result.duplicates, result.busy) == ({"A": FP}, ["B"])
    assert store.watermarks([0]) == {0: 0}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.claim({0: ["A"]}, "a|b", min_version=-1), "owner: 'a|b' must not contain"),
        (lambda s: s.claim({0: ["A"]}, "", min_version=-1), "owner"),
        (lambda s: s.claim({9: ["A"]}, "a", min_version=-1), r"bucket: 9 is outside 0\.\.3"),
        (lambda s: s.claim({0: ["A"]}, "a", min_version=True), "min_version"),
        (lambda s: s.complete({0: ["A"]}, "a", {"A": "x|y"}, version=0), "fingerprint"),
        (
            lambda s: s.index_completed(0, ["A"], [], [], to_version=0, from_version=None),
            "1 keys, 0 fingerprints",
        ),
        (lambda s: s.release({-1: ["A"]}, "a"), "bucket"),
    ],
)
def test_bad_input_is_refused_naming_the_field(
    fake_redis: redis.Redis, clock: ManualClock, call: object, message: str
) -> None:
    store = make_store(fake_redis, clock)
    with pytest.raises(ValueError, match=message):
        call(store)  # type: ignore[operator]


@pytest.mark.unit
def test_a_group_that_would_break_the_hash_tag_is_refused(fake_redis: redis.Redis) -> None:
    with pytest.raises(ValueError, match="group"):
        RedisHotStore(fake_redis, group="a}b", buckets=1, lease_ms=1, completed_ttl_ms=1)


@pytest.mark.unit
def test_from_config_takes_the_groups_settings(fake_redis: redis.Redis) -> None:
    config = IdemConfig(group="payments", buckets=8, lease_ms=60_000, redis_url="redis://h:7/2")
    store = RedisHotStore.from_config(config, client=fake_redis)
    assert (store.group, store.buckets, store.lease_ms) == ("payments", 8, 60_000)
    assert store.completed_ttl_ms == config.dedup_window_ms
    built = RedisHotStore.from_config(config)  # no connection is made until used
    kwargs = built.client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("h", 7, 2)


@pytest.mark.unit
def test_an_unreachable_redis_is_store_unavailable(clock: ManualClock) -> None:
    client = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    hot = RedisHotStore(
        client, group="orders", buckets=BUCKETS, lease_ms=LEASE_MS, completed_ttl_ms=WINDOW_MS
    )
    with pytest.raises(StoreUnavailable, match=r"Redis .* for group 'orders' failed") as info:
        hot.claim(by_bucket(KEYS), "a", min_version=-1)
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    with pytest.raises(StoreUnavailable):
        hot.watermarks()


@pytest.mark.unit
def test_a_value_idem_did_not_write_is_an_error_not_a_new_key(
    fake_redis: redis.Redis, clock: ManualClock
) -> None:
    store = make_store(fake_redis, clock)
    fake_redis.hset(store.claim_hash("A"), "A", "something else")
    with pytest.raises(StoreUnavailable, match="unrecognised value"):
        store.claim(by_bucket(["A"]), "a", min_version=-1)


@pytest.mark.unit
def test_the_eviction_check_warns_when_config_is_not_allowed(
    fake_redis: redis.Redis, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    store = make_store(fake_redis, clock)  # fakeredis knows no CONFIG, like a locked-down Redis
    with caplog.at_level(logging.WARNING, logger="idem.hotstore"):
        store.check_eviction_policy()
    assert "noeviction" in caplog.text


def test_every_hash_a_script_touches_is_declared_or_the_script_refuses(
    store: RedisHotStore, any_redis: redis.Redis, clock: ManualClock
) -> None:
    """On a Cluster, declared keys are what Redis checks during a slot migration; a script
    building a name its caller did not declare stops instead of touching it."""
    store.complete(by_bucket(KEYS), "q:0", dict.fromkeys(KEYS, FP), version=0)
    claim = store._claim.script
    tag = "idem:{orders:0}"
    args = [tag, clock.now_ms(), "q:1", LEASE_MS, store._claim_gens, -1, WINDOW_MS, "hold", "K"]
    with pytest.raises(
        redis.ResponseError, match=r"touches idem:\{orders:0\}:c:.*without declaring"
    ):
        any_redis.eval(claim, 1, f"{tag}:wm", *args)
    released = store.release(by_bucket(["ORDERID_1"]), "q:0")  # declared by the store itself
    assert released == 0
    assert store.lookup(by_bucket(["ORDERID_1"]))["ORDERID_1"].status is KeyStatus.COMPLETED
