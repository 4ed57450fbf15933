"""The dedup hook keeps the keys it works on: their claims are renewed while the listener
runs, up to the consume timeout, and the renewal thread ends when nothing is held."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis
from waiting import eventually

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.keys import group_by_bucket
from idem.redis_server import RedisServer
from idem.retry import MessageExt
from idem.retry.consumer import BatchResult, ConsumeScope, DedupMiddleware, MessageQueue

pytestmark = pytest.mark.integration


def _renewers(hook: DedupMiddleware) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"idem-lease-{hook.owner[-8:]}"]


def _slow(seconds: float) -> object:
    def listener(messages: Sequence[MessageExt]) -> BatchResult:
        time.sleep(seconds)
        return BatchResult(len(messages))

    return listener


@pytest.mark.parametrize(
    ("runs_s", "taken_by_other"), [(2.5, False), (5.0, True)], ids=["slow", "hung"]
)
def test_a_listener_keeps_its_key_past_the_lease_until_the_consume_timeout(
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    runs_s: float,
    taken_by_other: bool,
) -> None:
    """Lease 1 s, consume timeout 2 s. A listener of 2.5 s keeps its key from another
    owner throughout; one hung for 5 s lets it go a lease after the timeout."""
    config = IdemConfig(
        group="leases",
        redis_url=redis_server.url,
        data_dir=str(tmp_path),
        buckets=4,
        lease_ms=1000,
        consume_timeout_ms=2000,
    )
    hook = DedupMiddleware(Dedup(config))
    other = Dedup(config)
    message = MessageExt(topic="orders", msg_id="M0", keys="ORDER-1", body=b"{}")
    scope = ConsumeScope(
        mq=MessageQueue("orders", 0), client_id="c1", orderly=False, defer_acks=False
    )
    call = threading.Thread(target=hook, args=([message], scope, _slow(runs_s)))
    call.start()
    eventually(lambda: _renewers(hook), timeout=2, what="the renewal thread started")
    grouped = group_by_bucket(["ORDER-1"], 4)
    time.sleep(1.6)  # past the first lease: held only if renewed
    assert other.hot.claim(grouped, "other", min_version=-1).busy == ["ORDER-1"]
    if taken_by_other:
        time.sleep(2.0)  # past the timeout (2 s) and one more lease
        assert other.hot.claim(grouped, "other", min_version=-1).claimed == ["ORDER-1"]
    call.join(10)
    assert hook.stats.completed == 1
    eventually(lambda: not _renewers(hook), timeout=5, what="the renewal thread ended")


def test_a_hook_shared_by_two_consumers_renews_until_the_last_one_stops(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """One hook serves two consumers (each ``open``s it at start): when one stops, the
    other's call still holds its key past the lease; when both have stopped, renewal
    stops and the key goes a lease later (a stopped instance's leases run out)."""
    config = IdemConfig(
        group="shared",
        redis_url=redis_server.url,
        data_dir=str(tmp_path),
        buckets=4,
        lease_ms=1000,
        consume_timeout_ms=60_000,
    )
    hook = DedupMiddleware(Dedup(config))
    hook.open()
    hook.open()
    other = Dedup(config)
    message = MessageExt(topic="orders", msg_id="M0", keys="ORDER-1", body=b"{}")
    scope = ConsumeScope(
        mq=MessageQueue("orders", 0), client_id="c1", orderly=False, defer_acks=False
    )
    call = threading.Thread(target=hook, args=([message], scope, _slow(4.0)))
    call.start()
    eventually(lambda: _renewers(hook), timeout=2, what="the renewal thread started")
    hook.close()  # the first consumer stops; the call belongs to the other one
    grouped = group_by_bucket(["ORDER-1"], 4)
    time.sleep(1.6)  # past the first lease: held only if renewed
    assert other.hot.claim(grouped, "other", min_version=-1).busy == ["ORDER-1"]
    hook.close()  # the second one stops too: nothing renews any more
    eventually(lambda: not _renewers(hook), timeout=2, what="the renewal thread ended")
    time.sleep(1.1)  # one more lease
    assert other.hot.claim(grouped, "other", min_version=-1).claimed == ["ORDER-1"]
    call.join(10)


def test_a_key_waiting_for_its_group_commit_keeps_its_claim_past_the_consume_timeout(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    """Lease 1 s, consume timeout 2 s. A listener of 1.5 s returns; its key then waits for
    a group commit that starts 3 s later (e.g. behind commits retried while Redis was
    away). The listener is done, so the key is no longer at the mercy of a hung listener:
    it stays held until the commit, long past the consume timeout counted from the call's
    start, and no other owner can take it and write it to the sink again."""
    config = IdemConfig(
        group="commit-wait",
        redis_url=redis_server.url,
        data_dir=str(tmp_path),
        buckets=4,
        lease_ms=1000,
        consume_timeout_ms=2000,
    )
    hook = DedupMiddleware(Dedup(config), commit_interval_ms=3000)
    other = Dedup(config)
    message = MessageExt(topic="orders", msg_id="M0", keys="ORDER-1", body=b"{}")
    scope = ConsumeScope(
        mq=MessageQueue("orders", 0), client_id="c1", orderly=False, defer_acks=True
    )
    started = time.monotonic()
    result = hook([message], scope, _slow(1.5))
    assert list(result.pending) == [0], "the key waits for its group commit"
    grouped = group_by_bucket(["ORDER-1"], 4)
    # past the timeout and a lease (renewal without the listener's return ends by then),
    # before the commit
    time.sleep(max(0.0, started + 3.6 - time.monotonic()))
    taken = other.hot.claim(grouped, "other", min_version=-1)
    assert taken.busy == ["ORDER-1"], f"{time.monotonic() - started:.2f}s: {taken}"
    assert hook.flush(10_000)
    assert hook.stats.completed == 1
    assert other.hot.claim(grouped, "other", min_version=-1).claimed == []
