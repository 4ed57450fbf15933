"""A Spark job's metrics, scraped over HTTP after batches with known counts.

``@exactly_once`` counts each batch once into idem's metrics (a replay as a replay),
``idem stats`` shows the same totals, and the rows of each batch also appear in
Spark's own query progress. Real local Spark, a real redis-server, real Delta tables.
"""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client import CollectorRegistry
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery
from scrape import scrape, value
from spark_helpers import config_for, delta_run, order, sink_key_counts, write_files

from idem import metrics
from idem.redis_server import RedisServer
from idem.spark.decorator import exactly_once
from idem.spark.metrics import OBSERVATION, serve_job_metrics
from idem.spark.run import Pipeline
from idem.stats_cli import stats_snapshot

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def _df(spark: SparkSession, *keys: str) -> DataFrame:
    at = dt.datetime(2024, 5, 1, 10, 0, tzinfo=dt.UTC)
    return spark.createDataFrame(
        [(k, 9.99, at) for k in keys], "order_id STRING, amount DOUBLE, placed_at TIMESTAMP"
    )


def test_decorator_batches_are_counted_once_and_idem_stats_agrees(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Batch 0: 6 rows, one in-batch duplicate (A), the sink fails C; Spark replays
    batch 0; batch 1: A again (completed) and F."""
    config = config_for(tmp_path, redis_server.url, f"metrics-{uuid.uuid4().hex[:8]}")
    group = config.group

    def sink_fn(fresh: DataFrame, batch_id: int) -> list[str]:
        return [r["order_id"] for r in fresh.toArrow().to_pylist() if r["order_id"] == "C"]

    sink = exactly_once(key="order_id", config=config, client=real_redis)(sink_fn)
    sink.query_id = "q"
    http = metrics.serve(0, target=CollectorRegistry())
    try:
        batch0 = _df(spark, "A", "B", "C", "D", "A", "E")
        sink.process(batch0, 0)
        sink.process(batch0, 0)  # Spark runs batch 0 again after a failure
        sink.process(_df(spark, "A", "F"), 1)
        samples = scrape(http.url)
    finally:
        http.close()

    def v(name: str, **labels: object) -> float | None:
        return value(samples, name, group=group, **labels)

    assert v("idem_messages_total") == 8  # 6 + 2; the replay adds none
    assert v("idem_applied_total") == 5  # A B D E, then F
    assert v("idem_failed_total") == 1
    assert v("idem_duplicates_total", cause="in_batch") == 1
    assert v("idem_duplicates_total", cause="completed") == 1
    assert v("idem_retries_scheduled_total", level=3) == 1  # C, on the broker's level 3
    assert v("idem_replays_total", kind="batch") == 1
    assert v("idem_claim_duration_seconds_count") == 2
    assert v("idem_commit_duration_seconds_count") == 2

    snapshot = stats_snapshot(config)
    totals: dict[str, Any] = snapshot["spark"]
    assert (totals["messages"], totals["applied"], totals["failed"]) == (8, 5, 1)
    assert totals["duplicates"] == {"in_batch": 1, "completed": 1}
    assert totals["replayed_batches"] == 1
    assert snapshot["retry"]["scheduled_by_level"] == {"3": 1}


def test_a_run_shows_its_rows_in_sparks_progress_and_on_the_metrics_endpoint(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    """One file of 4 rows, one of them a second copy of ORDERID_1."""
    write_files(tmp_path / "in", [[order(1), order(2), order(1), order(3)]])
    config = config_for(tmp_path, redis_server.url, f"observed-{uuid.uuid4().hex[:8]}")
    pipeline = Pipeline(spark, config, delta_run(tmp_path), client=redis_server.client())
    queries: list[StreamingQuery] = []
    http = serve_job_metrics(pipeline.engine, host="127.0.0.1", port=0)
    try:
        try:
            pipeline.run(on_started=queries.append)
        finally:
            pipeline.close()  # lands the last batch's Redis index update
        samples = scrape(http.url)
    finally:
        http.close()
    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_1": 1, "ORDERID_2": 1, "ORDERID_3": 1}
    observed = [
        p.observedMetrics[OBSERVATION].asDict()
        for query in queries
        for p in query.recentProgress
        if OBSERVATION in p.observedMetrics
    ]
    assert sum(o["messages"] for o in observed) == 4
    assert sum(o["retried_rows"] for o in observed) == 0
    group = config.group
    assert value(samples, "idem_messages_total", group=group) == 4
    assert value(samples, "idem_applied_total", group=group) == 3
    assert value(samples, "idem_duplicates_total", group=group, cause="in_batch") == 1
    assert value(samples, "idem_ledger_version", group=group) == 0  # the sink is the ledger
    assert value(samples, "idem_index_lag_versions", group=group) == 0
    assert value(samples, "idem_index_buckets_behind", group=group) == 0
