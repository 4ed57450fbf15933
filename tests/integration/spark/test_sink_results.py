"""What a sink function returns or how it is shaped must not lose a row or stop the query.

Each case is a sink that fails row ``B`` (``v < 0``) of a two-row batch: ``A`` must be
applied and ``B`` retried, or, when reading the result raises, both retried, as when the
function itself raises (docs/pages/protocol.md: "an exception fails every fresh row").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from spark_helpers import config_for

from idem.errors import ConfigError
from idem.redis_server import RedisServer
from idem.retry.engine import RetryEngine
from idem.spark.decorator import exactly_once
from idem.spark.outcome import BatchOutcome
from idem.spark.sink_result import SinkFunction

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def _process(
    fn: SinkFunction,
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
) -> tuple[BatchOutcome, RetryEngine]:
    config = config_for(tmp_path, redis_server.url, "results")
    sink = exactly_once(key="order_id", config=config, client=real_redis)(fn)
    sink.query_id = "q"
    df = spark.createDataFrame([("A", 1), ("B", -1)], "order_id string, v int")
    return sink.process(df, 0), RetryEngine(config, client=real_redis)


def _negative(fresh: DataFrame) -> list[Any]:
    return [r for r in fresh.collect() if r.v < 0]


def test_a_mapping_of_failed_rows_to_errors_retries_those_rows(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """``{row: error}`` of collected Rows matched no key: B was committed as done (its
    write never happened) and never retried, with only a warning in the log."""

    def sink(fresh: DataFrame, batch_id: int) -> dict[Any, str]:
        return dict.fromkeys(_negative(fresh), "negative amount")

    outcome, engine = _process(sink, spark, real_redis, redis_server, tmp_path)
    assert outcome.applied_keys == ("A",)
    assert outcome.failed_keys == ("B",)
    assert engine.pending() == 1


def test_failed_rows_returned_as_dicts_are_retried(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """``[row.asDict(), ...]`` failed the batch with ``TypeError: unhashable type: 'dict'``."""

    def sink(fresh: DataFrame, batch_id: int) -> list[dict[str, Any]]:
        return [row.asDict() for row in _negative(fresh)]

    outcome, engine = _process(sink, spark, real_redis, redis_server, tmp_path)
    assert outcome.applied_keys == ("A",)
    assert outcome.failed_keys == ("B",)
    assert engine.pending() == 1


def test_a_sink_with_a_keyword_only_option_gets_the_rows_alone(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """``fn(fresh, *, table=...)`` was called with the batch id too: a TypeError every
    time, so every row climbed the ladder into the DLQ and none was ever written."""

    def sink(fresh: DataFrame, *, table: str = "orders") -> list[str]:
        return [row.order_id for row in _negative(fresh)]

    outcome, engine = _process(sink, spark, real_redis, redis_server, tmp_path)
    assert outcome.applied_keys == ("A",)
    assert outcome.failed_keys == ("B",)
    assert engine.pending() == 1


def test_a_returned_dataframe_that_fails_when_read_fails_every_fresh_row(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A DataFrame of failed rows runs the user's code when idem reads it: its error
    escaped ``process`` and stopped the query (and every restart replayed it into the
    same error) instead of sending the rows back like the function's own exception."""

    @F.udf("boolean")
    def price_unknown(v: int) -> bool:
        raise ConnectionError("price service is down")

    def sink(fresh: DataFrame, batch_id: int) -> DataFrame:
        return fresh.where(price_unknown("v"))

    outcome, engine = _process(sink, spark, real_redis, redis_server, tmp_path)
    assert outcome.applied == 0
    assert sorted(outcome.failed_keys) == ["A", "B"]
    assert engine.pending() == 2


def test_a_returned_generator_that_raises_fails_every_fresh_row(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    def sink(fresh: DataFrame, batch_id: int) -> Iterator[str]:
        for row in fresh.collect():
            if row.v < 0:
                yield row.order_id
        raise ConnectionError("the audit log is down")

    outcome, engine = _process(sink, spark, real_redis, redis_server, tmp_path)
    assert outcome.applied == 0
    assert sorted(outcome.failed_keys) == ["A", "B"]
    assert engine.pending() == 2


@pytest.mark.parametrize("column", ["_idem_fingerprint", "_idem_key_hash", "_idem_msg_id"])
def test_a_column_of_the_users_named_like_idems_own_is_refused_naming_it(
    column: str,
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    """idem adds these columns for its hashes: a column of the rows by that name failed
    every batch with pyarrow's ``KeyError: Field "..." exists 2 times in schema``."""
    config = config_for(tmp_path, redis_server.url, "own-names")
    sink = exactly_once(key="order_id", config=config, client=real_redis, msg_id="src_id")(
        lambda fresh, batch_id: None
    )
    sink.query_id = "q"
    if column == "_idem_key_hash":  # added only when the id is derived from the key
        sink.msg_id = None
    df = spark.createDataFrame([("A", "m1", 1)], f"order_id string, src_id string, {column} int")
    with pytest.raises(ConfigError, match=f"{column}: .*rename"):
        sink.process(df, 0)
    assert RetryEngine(config, client=real_redis).pending() == 0
