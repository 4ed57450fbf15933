"""Fixtures of the Kafka tier: the session's broker, a fresh topic per test, the Delta engine."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from kafka_broker import KafkaBroker, create_topic
from kafka_helpers import KafkaCase
from pyspark.sql import SparkSession

from idem.redis_server import RedisServer

PARTITIONS = 3


@pytest.fixture(params=["delta-rs", "delta-spark"])
def engine(request: pytest.FixtureRequest) -> str:
    """The Delta engine that writes the sink table and the ledger (``IdemConfig.engine``)."""
    return str(request.param)


@pytest.fixture
def topic(kafka_broker: KafkaBroker, spark: SparkSession) -> str:
    """A new topic of :data:`PARTITIONS` partitions on the shared broker."""
    name = f"orders-{uuid.uuid4().hex[:8]}"
    create_topic(spark, kafka_broker.bootstrap, name, PARTITIONS)
    return name


@pytest.fixture
def case(request: pytest.FixtureRequest, topic: str, engine: str, tmp_path: Path) -> KafkaCase:
    """A fresh topic on the shared broker, the shared redis-server, one Delta engine."""
    spark: SparkSession = request.getfixturevalue("spark")
    broker: KafkaBroker = request.getfixturevalue("kafka_broker")
    redis_server: RedisServer = request.getfixturevalue("redis_server")
    return KafkaCase(spark, broker.bootstrap, topic, redis_server.url, engine, tmp_path)
