"""A window rebuild leaves no half-grown hash behind (real redis-server, real Delta ledger).

A Redis hash that outgrows its table moves to a bigger one a bucket per later
command; until then every claim on it searches two tables. These tests read
the tables' state with ``DEBUG HTSTATS-KEY`` on a private server that allows it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis_backends import flushed_client

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.hotstore import RedisHotStore
from idem.outcome import DuplicateCause
from idem.redis_server import RedisServer

pytestmark = pytest.mark.integration

KEYS = 2**15 + 300  # just past a table size, so the load ends in the middle of a move
WINDOW_MS = 86_400_000


@pytest.fixture(scope="module")
def debug_server() -> Iterator[RedisServer]:
    """A private redis-server whose DEBUG command answers loopback clients."""
    with RedisServer(extra={"enable-debug-command": "local"}) as server:
        yield server


@pytest.fixture
def debug_redis(debug_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of the private server, flushed before the test."""
    yield from flushed_client(debug_server)


def _moving(client: redis.Redis) -> list[str]:
    """Completed-generation hashes that are still moving to a bigger table."""
    names = [n.decode() for n in client.scan_iter(match="idem:*:c:*", count=1000)]
    assert names, "nothing was indexed"
    return [
        name
        for name in names
        if b"rehashing target" in client.execute_command("DEBUG", "HTSTATS-KEY", name)
    ]


def test_settle_index_finishes_the_move_and_keeps_every_key(debug_redis: redis.Redis) -> None:
    clock = ManualClock(1_700_000_000_000)
    store = RedisHotStore(
        debug_redis, group="orders", buckets=1, lease_ms=60_000, completed_ttl_ms=WINDOW_MS,
        clock=clock,
    )  # fmt: skip
    keys = [f"ORDERID_{i}" for i in range(KEYS)]
    store.index_completed(
        0, keys, ["f"] * KEYS, [clock.now_ms()] * KEYS, to_version=0, from_version=None
    )
    assert _moving(debug_redis), (
        "the load alone should end mid-move (else this test proves nothing)"
    )

    assert store.settle_index() == KEYS

    assert _moving(debug_redis) == []
    claimed = store.claim({0: keys}, "o1", min_version=0)
    assert len(claimed.duplicates) == KEYS
    assert not claimed.claimed


def test_a_window_rebuild_settles_what_it_loaded(
    debug_server: RedisServer, debug_redis: redis.Redis, tmp_path: Path
) -> None:
    config = IdemConfig(
        group="orders", redis_url=debug_server.url, data_dir=str(tmp_path), buckets=1
    )
    keys = [f"ORDERID_{i}" for i in range(KEYS)]
    writer = Dedup(config)
    writer.complete(writer.begin(keys, owner="w:0"), batch_id=0, app_id="test")
    debug_redis.flushall()  # Redis lost everything: the next claim rebuilds from the ledger

    reader = Dedup(config)
    reader.catch_up()

    assert reader.stats.rebuilt_keys == KEYS
    assert _moving(debug_redis) == []
    again = reader.begin([*keys[:1000], "ORDERID_NEW"], owner="r:0")
    assert list(again.fresh) == [1000]
    assert set(again.duplicates.values()) == {DuplicateCause.COMPLETED}
    assert len(again.duplicates) == 1000
