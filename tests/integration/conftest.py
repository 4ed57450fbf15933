"""Fixtures of the integration tier that need more than one real service."""

from __future__ import annotations

import pytest
from redis_backends import RealRedis

from idem.redis_cluster import LocalCluster
from idem.redis_server import RedisServer


@pytest.fixture(params=["redis-server", "redis-cluster"])
def real_backend(request: pytest.FixtureRequest) -> RealRedis:
    """One real redis-server, or the 3-primary Cluster: for tests that must hold on both."""
    if request.param == "redis-cluster":
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        client = request.getfixturevalue("cluster_redis")
        return RealRedis(client, cluster.url, cluster.client)
    server: RedisServer = request.getfixturevalue("redis_server")
    return RealRedis(request.getfixturevalue("real_redis"), server.url, server.client)
