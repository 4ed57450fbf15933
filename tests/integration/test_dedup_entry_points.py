"""What every entry point into the dedup layer refuses, on a real redis-server.

An evicting Redis can drop a claim or a completed key silently and let a duplicate
through, so the consumer's middleware and ``@idempotent`` refuse it as the Spark
decorator does. A claim whose buckets keep losing their index gives back what it
took and says so with an :class:`~idem.errors.IdemError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.errors import IdemError, IndexUnsettled, UnsafeRedisConfig
from idem.hotstore import RedisHotStore
from idem.idempotent import idempotent
from idem.keys import bucket_of
from idem.redis_server import RedisServer
from idem.retry import ConsumeConcurrentlyStatus
from idem.retry.consumer import ConsumerSettings, DedupMiddleware, PushConsumer

pytestmark = pytest.mark.integration

BUCKETS = 4


def _config(tmp_path: Path, url: str) -> IdemConfig:
    return IdemConfig(
        group="orders",
        redis_url=url,
        data_dir=str(tmp_path / "data"),
        buckets=BUCKETS,
        engine="delta-rs",
    )


@pytest.fixture
def evicting_redis() -> Any:
    with RedisServer(maxmemory_policy="allkeys-lru") as server:
        yield server


def test_a_consumer_with_the_dedup_middleware_does_not_start_on_an_evicting_redis(
    tmp_path: Path, evicting_redis: RedisServer
) -> None:
    config = _config(tmp_path, evicting_redis.url)
    consumer = PushConsumer(config, settings=ConsumerSettings(), client=evicting_redis.client())
    consumer.subscribe("orders")
    consumer.register_message_listener_concurrently(
        lambda messages, context: ConsumeConcurrentlyStatus.CONSUME_SUCCESS
    )
    consumer.use(DedupMiddleware(Dedup(config, client=evicting_redis.client()), key="keys"))
    with pytest.raises(UnsafeRedisConfig, match=r"allkeys-lru.*noeviction"):
        consumer.start()
    consumer.shutdown()


def test_idempotent_refuses_an_evicting_redis_before_running_the_function(
    tmp_path: Path, evicting_redis: RedisServer
) -> None:
    ran: list[str] = []

    @idempotent(key="order_id", config=_config(tmp_path, evicting_redis.url))
    def charge(order_id: str) -> None:
        ran.append(order_id)

    with pytest.raises(UnsafeRedisConfig, match=r"allkeys-lru.*noeviction"):
        charge("ORDERID_100")
    assert ran == []


class _LosingBucketZero(RedisHotStore):
    """A real hot store whose bucket 0 loses its index (its watermark key is deleted in
    Redis) right before every claim, as a Redis restarting in a loop would."""

    def start_claim(self, owner: str, **options: Any) -> Any:
        self.client.delete(self.watermark_name(0))
        return super().start_claim(owner, **options)

    def claim(self, keys_by_bucket: Any, owner: str, **options: Any) -> Any:
        self.client.delete(self.watermark_name(0))
        return super().claim(keys_by_bucket, owner, **options)


def _keys_in(bucket: int, count: int, *, other_than: bool = False) -> list[str]:
    found: list[str] = []
    n = 0
    while len(found) < count:
        key = f"ORDERID_{n}"
        if (bucket_of(key, BUCKETS) == bucket) != other_than:
            found.append(key)
        n += 1
    return found


def test_a_claim_whose_bucket_keeps_losing_its_index_gives_its_keys_back(
    tmp_path: Path, redis_server: RedisServer, real_redis: Any
) -> None:
    config = _config(tmp_path, redis_server.url)
    done = Dedup(config, client=redis_server.client())
    earlier = done.begin(["ORDERID_DONE"], owner="batch-0")
    done.complete(earlier, batch_id=0, app_id="test:batch-0")  # a ledger for the index
    looping = _LosingBucketZero.from_config(config, client=redis_server.client())
    elsewhere: Sequence[str] = _keys_in(0, 5, other_than=True)
    keys = [*_keys_in(0, 5), *elsewhere]
    with pytest.raises(IndexUnsettled, match=r"buckets \[0\].*released") as raised:
        Dedup(config, hot=looping).begin(keys, owner="batch-1")
    assert isinstance(raised.value, IdemError)
    # Nothing stays held for a lease: another owner can claim every key at once.
    claim = Dedup(config, client=redis_server.client()).begin(keys, owner="batch-2")
    assert sorted(claim.fresh_keys()) == sorted(keys)
    assert not claim.busy
