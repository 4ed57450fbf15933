"""Duplicates inside a batch, across batches and across files reach the sink once.

A real local Spark streaming query (files -> ``@exactly_once``), a real
redis-server and real Delta tables; both kinds of sink: the Delta sink table
that is its own ledger, and a function of the user's.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from pyspark.sql import DataFrame, SparkSession
from spark_helpers import config_for, engines_of, order, sink_key_counts, write_files

from idem.redis_server import RedisServer
from idem.spark.run import Pipeline, RunSpec

pytestmark = [pytest.mark.integration, pytest.mark.spark]


class Collect:
    """A user sink that remembers every row it was given (and the idempotency key)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, fresh: DataFrame, batch_id: int) -> None:
        self.rows += fresh.toArrow().to_pylist()


@pytest.mark.parametrize(
    ("sink_kind", "ledger_engine"),
    [("delta", "delta-rs"), ("function", "delta-rs"), ("delta", "delta-spark")],
    indirect=["ledger_engine"],
)
def test_duplicates_in_a_batch_across_batches_and_across_files_reach_the_sink_once(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    *,
    sink_kind: str,
    ledger_engine: str,
) -> None:
    first = [order(1), order(2), order(3), order(1), order(4)]  # ORDERID_1 twice in one batch
    second = [order(3), order(5), order(6)]  # ORDERID_3 again, in the next batch
    third = [*first, order(7)]  # the first file delivered again (a redelivery)
    write_files(tmp_path / "in", [first, second, third])
    config = config_for(tmp_path, redis_server.url, f"dups-{sink_kind}", engine=ledger_engine)
    collect = Collect()
    spec = RunSpec(
        source=str(tmp_path / "in"),
        key="order_id",
        sink_delta=str(tmp_path / "sink") if sink_kind == "delta" else None,
        checkpoint=str(tmp_path / "checkpoint"),
        available_now=True,
        max_files_per_trigger=1,
    )
    pipeline = Pipeline(
        spark,
        config,
        spec,
        sink_fn=collect if sink_kind == "function" else None,
        client=real_redis,
    )
    report = pipeline.run()

    expected = {f"ORDERID_{n}": 1 for n in range(1, 8)}
    ledger = tmp_path / "sink" if sink_kind == "delta" else config.resolved_ledger_path
    assert engines_of(ledger) == {ledger_engine}
    if sink_kind == "delta":
        assert sink_key_counts(tmp_path / "sink") == expected
        assert report.sink is not None
        assert report.sink.exactly_once
    else:
        assert Counter(r["order_id"] for r in collect.rows) == expected
        # The function is told the idempotency key of every row it gets.
        assert {r["idempotency_key"] for r in collect.rows} == {
            f"{config.group}:{k}" for k in expected
        }
    totals = report.totals
    assert totals.messages == len(first) + len(second) + len(third)
    assert totals.applied == 7
    assert totals.duplicates == {"in_batch": 2, "completed": 5}
    assert totals.batches == 3
    assert report.dead_letters == 0
    assert report.pending_retries == 0
