"""Shared fixtures: a real redis-server per test session, fakeredis, clocks, tmp tables.

A real service that is missing fails loudly under CI (``CI=true``); on a
developer machine the tests that need it are skipped with the install hint.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import redis
from jvm_jars import IN_CI, delta_spark_conf, require_jars
from kafka_broker import KafkaBroker
from pyspark.sql import SparkSession
from redis_backends import RealRedis, flushed_client

from idem.clock import ManualClock
from idem.redis_cluster import LocalCluster
from idem.redis_server import RedisServer, redis_server_binary
from idem.retry.consumer import PushConsumer
from idem.spark.session import local_session

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


def _file_rank(items: list[pytest.Item]) -> int:
    """How early a test file should start: scenarios and the fault tier first (they
    run processes again and again: ``idem run``, consumers, servers), Spark's tests
    next, the rest last."""
    marks = {mark.name for item in items for mark in item.iter_markers()}
    if marks & {"scenarios", "faults"}:
        return 0
    return 1 if "spark" in marks else 2


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the files slowest tier first, each file's tests kept together in their order.

    Workers (``-n 2 --dist loadfile``) take files in this order, so the long scenario
    runs start early instead of finishing the run on one worker while the other idles.
    """
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    ranked = sorted(by_file.values(), key=_file_rank)  # stable: collection order within a tier
    items[:] = [item for group in ranked for item in group]


def _require_redis_server() -> None:
    if redis_server_binary() is None:
        message = "redis-server is not installed (apt-get install redis-server)"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the whole run; tests flush what they use."""
    _require_redis_server()
    server = RedisServer(appendonly=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def real_redis(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the shared real server, flushed before each test."""
    yield from flushed_client(redis_server)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """One real Redis Cluster (3 primaries on loopback ports) for the whole run."""
    _require_redis_server()
    cluster = LocalCluster(3)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_redis(redis_cluster: LocalCluster) -> Iterator[redis.Redis]:
    """A Cluster client, every primary flushed before each test."""
    client = redis_cluster.client()
    client.flushall(target_nodes="primaries")
    yield client  # type: ignore[misc]  # a RedisCluster, which idem takes wherever Redis goes
    client.close()


@pytest.fixture(params=["redis-server", "redis-cluster"])
def real_backend(request: pytest.FixtureRequest) -> RealRedis:
    """One real redis-server, or the 3-primary Cluster: for tests that must hold on both."""
    if request.param == "redis-cluster":
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        client = request.getfixturevalue("cluster_redis")
        return RealRedis(client, cluster.url, cluster.client)
    server: RedisServer = request.getfixturevalue("redis_server")
    return RealRedis(request.getfixturevalue("real_redis"), server.url, server.client)


@pytest.fixture
def fake_redis() -> Iterator[redis.Redis]:
    """fakeredis with Lua, for the fast unit tier only."""
    import fakeredis

    client = fakeredis.FakeRedis()
    yield client
    client.close()


@pytest.fixture(
    params=[
        pytest.param("fakeredis", marks=pytest.mark.unit),
        pytest.param("redis-server", marks=pytest.mark.integration),
        pytest.param("redis-cluster", marks=pytest.mark.integration),
    ]
)
def any_redis(request: pytest.FixtureRequest) -> redis.Redis:
    """The behaviour suite runs against every backend: fakeredis, one real server, a Cluster."""
    if request.param == "fakeredis":
        return request.getfixturevalue("fake_redis")  # type: ignore[no-any-return]
    if request.param == "redis-cluster":
        return request.getfixturevalue("cluster_redis")  # type: ignore[no-any-return]
    return request.getfixturevalue("real_redis")  # type: ignore[no-any-return]


@pytest.fixture
def clock() -> ManualClock:
    """A clock that moves only when the test says so."""
    return ManualClock()


@pytest.fixture
def consumers() -> Iterator[list[PushConsumer]]:
    """Push consumers a test starts: each is shut down when the test ends."""
    started: list[PushConsumer] = []
    yield started
    for consumer in started:
        consumer.shutdown()


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local Spark session (local[2], UI off, 2 shuffle partitions, UTC) per pytest worker.

    It takes ~7 s to start, so every Spark test shares it. It carries Delta's Spark
    jars and Spark's Kafka connector from the Maven cache (``tests/jvm_jars.py``), with
    Delta's SQL extension on, so the delta-spark ledger engine and a Kafka source run
    in the same process as everything else.
    """
    jars = require_jars("spark", "delta-spark_")
    conf = {
        **delta_spark_conf(jars),
        # Every Spark test of a pytest worker runs in this one driver: room for all of them,
        # and the plans of finished queries are not kept by the thousand.
        "spark.driver.memory": "2g",
        "spark.sql.ui.retainedExecutions": "50",
    }
    session = local_session("idem-tests", fast_start=True, conf=conf)
    yield session
    session.stop()


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    """One real single-node Kafka broker (KRaft) on loopback ports for the whole run."""
    broker = KafkaBroker(require_jars("kafka-broker", "kafka_2.13"))
    try:
        broker.start()
        yield broker
    finally:
        broker.stop()
