"""The Redis hot store against a real redis-server only: configuration checks,
concurrent claimers in separate processes, timeouts and a dead server.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from idem import claim_calls
from idem.clock import ManualClock
from idem.errors import StoreUnavailable, UnsafeRedisConfig
from idem.hotstore import KeyStatus, RedisHotStore
from idem.keys import group_by_bucket
from idem.redis_server import RedisServer

pytestmark = pytest.mark.integration

BUCKETS = 8
LEASE_MS = 60_000
WINDOW_MS = 86_400_000


def _store(client: redis.Redis, clock: Any = None) -> RedisHotStore:
    extra = {} if clock is None else {"clock": clock}
    return RedisHotStore(
        client,
        group="orders",
        buckets=BUCKETS,
        lease_ms=LEASE_MS,
        completed_ttl_ms=WINDOW_MS,
        **extra,
    )


def _index_empty_ledger(store: RedisHotStore) -> None:
    for bucket in range(store.buckets):
        store.index_completed(bucket, [], [], [], to_version=-1, from_version=None)


# -- maxmemory-policy ------------------------------------------------------------------


@pytest.fixture
def policy(real_redis: redis.Redis) -> Iterator[redis.Redis]:
    """The shared server's eviction policy may be changed by the test; it is put back."""
    yield real_redis
    real_redis.config_set("maxmemory-policy", "noeviction")


def test_noeviction_passes_the_check(policy: redis.Redis) -> None:
    _store(policy).check_eviction_policy()


def test_an_evicting_redis_is_refused_with_the_fix(policy: redis.Redis) -> None:
    policy.config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(UnsafeRedisConfig) as info:
        _store(policy).check_eviction_policy()
    message = str(info.value)
    assert "'allkeys-lru'" in message
    assert "maxmemory-policy noeviction" in message


def test_a_user_without_config_rights_gets_a_warning(
    redis_server: RedisServer, policy: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    user = f"idem-{uuid.uuid4().hex[:8]}"
    policy.acl_setuser(
        user, enabled=True, passwords=["+secret"], keys=["*"], commands=["+@all", "-config"]
    )
    limited = redis.Redis(port=redis_server.port, username=user, password="secret")
    try:
        with caplog.at_level(logging.WARNING, logger="idem.hotstore"):
            _store(limited).check_eviction_policy()
        assert "could not read Redis maxmemory-policy" in caplog.text
    finally:
        limited.close()
        policy.acl_deluser(user)


# -- concurrency -------------------------------------------------------------------------


def _claim_all(url: str, owner: str, keys: list[str], barrier: Any, seed: int) -> list[str]:
    """Claim ``keys`` in small shuffled batches once both processes are ready."""
    store = _store(redis.Redis.from_url(url))
    order = keys[:]
    random.Random(seed).shuffle(order)
    barrier.wait()
    claimed: list[str] = []
    for start in range(0, len(order), 250):
        batch = group_by_bucket(order[start : start + 250], BUCKETS)
        claimed += store.claim(batch, owner, min_version=-1).claimed
    return claimed


def test_two_processes_never_claim_the_same_key(
    redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    keys = [f"ORDERID_{n}" for n in range(10_000)]
    _index_empty_ledger(_store(real_redis))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(2) as pool:
        barrier = manager.Barrier(2)
        results = pool.starmap(
            _claim_all,
            [(redis_server.url, "a", keys, barrier, 1), (redis_server.url, "b", keys, barrier, 2)],
        )
    by_a, by_b = set(results[0]), set(results[1])
    assert by_a  # they really raced for the keys
    assert by_b
    assert not by_a & by_b
    assert by_a | by_b == set(keys)
    assert len(results[0]) + len(results[1]) == len(keys)
    states = _store(real_redis).lookup(group_by_bucket(keys, BUCKETS))
    assert {k for k, s in states.items() if s.owner == "a"} == by_a
    assert all(s.status is KeyStatus.IN_PROGRESS for s in states.values())


# -- unknown outcomes ------------------------------------------------------------------


def test_a_timeout_is_an_unknown_outcome_not_a_failure(
    redis_server: RedisServer, real_redis: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    _index_empty_ledger(_store(real_redis, clock))
    # One script call of 150k new keys runs >= 0.1 s on the server (measured 0.15-0.3 s):
    # several times longer than the client waits.
    monkeypatch.setattr(claim_calls, "CLAIM_CHUNK", 150_000)
    keys = {0: [f"K{n}" for n in range(150_000)]}
    impatient = redis_server.client(socket_timeout=0.02, retry=Retry(NoBackoff(), 0))
    with pytest.raises(StoreUnavailable, match="outcome is unknown") as info:
        _store(impatient, clock).claim(keys, "batch-1", min_version=-1)
    assert isinstance(info.value.__cause__, redis.TimeoutError)
    impatient.close()
    # The claim did land: the same owner retries and finds every key its own.
    again = _store(real_redis, clock).claim(keys, "batch-1", min_version=-1)
    assert again.retaken == again.claimed == keys[0]


def test_a_dead_server_is_store_unavailable() -> None:
    with RedisServer() as server:
        client = server.client(socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
        store = _store(client)
        _index_empty_ledger(store)
        server.kill()
        with pytest.raises(StoreUnavailable):
            store.claim({0: ["A"]}, "a", min_version=-1)
        with pytest.raises(StoreUnavailable):
            store.complete({0: ["A"]}, "a", {"A": "fp"}, version=0)
        client.close()


def test_an_empty_restart_makes_every_bucket_stale() -> None:
    with RedisServer() as server:
        client = server.client()
        store = _store(client)
        _index_empty_ledger(store)
        store.claim({0: ["A"]}, "a", min_version=-1)
        server.restart()  # no AOF, no RDB: everything is gone, the watermarks too
        result = store.claim({0: ["A"]}, "b", min_version=-1)
        assert result.stale_buckets == {0}
        assert result.claimed == []
        client.close()


def test_a_server_that_cannot_start_says_why() -> None:
    server = RedisServer(extra={"no-such-directive": "1"})
    with pytest.raises(StoreUnavailable, match="no-such-directive"):
        server.start()
    assert not server.running
    server.stop()


def test_a_claim_that_fails_part_way_gives_its_connection_and_leases_back(
    real_redis: redis.Redis,
) -> None:
    store = _store(real_redis)
    _index_empty_ledger(store)
    pool = real_redis.connection_pool
    for _ in range(3):
        with pytest.raises(ValueError, match="bucket"):
            store.claim({0: ["A"], 1: ["B"], 99: ["C"]}, "owner:1", min_version=-1)
    assert not pool._in_use_connections  # each attempt's connection went back, read
    # A and B were sent before bucket 99 failed: their leases were given back too.
    taken = store.claim({0: ["A"], 1: ["B"]}, "owner:2", min_version=-1)
    assert sorted(taken.claimed) == ["A", "B"]


def test_a_complete_refused_for_a_bad_fingerprint_marks_no_key_and_keeps_no_connection() -> None:
    with RedisServer() as server:
        client = server.client()
        store = _store(client)
        _index_empty_ledger(store)
        keys = [f"K{i}" for i in range(40)]
        grouped = group_by_bucket(keys, BUCKETS)
        store.claim(grouped, "a", min_version=-1)
        prints = dict.fromkeys(keys, "fp")
        prints[grouped[BUCKETS - 1][0]] = "bad|fp"  # the last bucket's: checked before any is sent
        for _ in range(3):
            with pytest.raises(ValueError, match=r"must not contain '\|'"):
                store.complete(grouped, "a", prints, version=0)
        states = store.lookup(grouped)
        assert {state.status for state in states.values()} == {KeyStatus.IN_PROGRESS}
        assert len(client.connection_pool._in_use_connections) == 0  # type: ignore[attr-defined]
        client.close()
