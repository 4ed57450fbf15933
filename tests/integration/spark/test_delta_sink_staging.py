"""A Delta sink's rows on the delta-rs engine: staged by the executors, never gathered on
the driver.

Real Spark, a real redis-server, real Delta tables on disk. The delta-rs engine
commits from the driver; the sink's own columns go there as Parquet files the
executors wrote, which the commit streams, and the staging is gone afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
from pyspark.sql import SparkSession
from pyspark.sql import types as st
from spark_helpers import config_for, run_job, sink_key_counts, sink_rows

from idem.redis_server import RedisServer
from idem.spark.decorator import ExactlyOnce
from idem.spark.delta_sink import delta_sink
from idem.spark.faults import CrashPlan, CrashPoint, SimulatedCrash
from idem.spark.staging import STAGING_DIR, query_dir

pytestmark = [pytest.mark.integration, pytest.mark.spark]

JOB = Path(__file__).with_name("staged_sink_job.py")
SCHEMA = st.StructType(
    [st.StructField("order_id", st.StringType()), st.StructField("note", st.StringType())]
)


def test_a_batch_far_larger_than_the_drivers_result_limit_is_written_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    # A fresh session of its own: spark.driver.maxResultSize is fixed when it starts.
    report = run_job(JOB, redis_server.url, str(tmp_path / "idem-data"), timeout=540)[-1]
    assert report["applied"] == report["keys"] == 12_000
    assert report["rows_per_key"] == [1]
    assert report["numbers"] is True  # every row's own columns arrived with it
    assert report["payload_bytes"] == 12_000 * 4096  # 48 MiB through an 8 MiB result limit
    assert report["staging_left"] == []


def test_what_a_killed_batch_staged_is_removed_by_the_next_and_never_read_as_rows(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "leftover")
    table = tmp_path / "orders"
    sink = delta_sink(str(table), key="order_id", config=config, client=real_redis)
    sink.query_id = "q"
    sink.process(spark.createDataFrame([("A", "a")], SCHEMA), 0)
    # What a batch killed between staging and its commit leaves: rows shaped like the
    # table's, in the query's staging directory.
    leftover = Path(query_dir(str(table), f"idem-spark:{config.group}:q")) / "1-killed"
    leftover.mkdir(parents=True)
    pq.write_table(
        pa.table({"key": ["Z"], "order_id": ["Z"], "note": ["staged, never committed"]}),
        leftover / "part-0.parquet",
    )
    outcome = sink.process(spark.createDataFrame([("B", "b"), ("C", "c")], SCHEMA), 1)
    assert outcome.applied == 2
    assert sink_key_counts(table) == {"A": 1, "B": 1, "C": 1}
    assert {r["key"]: r["note"] for r in sink_rows(table)} == {"A": "a", "B": "b", "C": "c"}
    assert not (table / STAGING_DIR).exists()


def test_a_replay_commits_the_rows_that_failed_the_first_time_once_from_staged_files(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "late")
    table = tmp_path / "orders"
    failing = {"C"}

    def validate(fresh: object, batch_id: int) -> list[str]:
        return sorted(failing)

    def sink(crash: CrashPlan | None) -> ExactlyOnce:
        return ExactlyOnce(
            validate, config=config, key="order_id", client=real_redis, sink_table=str(table),
            query_id="q", crash_plan=crash,
        )  # fmt: skip

    batch = spark.createDataFrame([("A", "a"), ("B", "b"), ("C", "c")], SCHEMA)
    with pytest.raises(SimulatedCrash):
        sink(CrashPlan(CrashPoint.AFTER_COMMIT, 0)).process(batch, 0)
    assert sink_key_counts(table) == {"A": 1, "B": 1}
    failing.clear()  # Spark replays batch 0, and C goes through this time
    replay = sink(None).process(batch, 0)
    assert replay.commit_replayed
    assert sink_key_counts(table) == {"A": 1, "B": 1, "C": 1}
    assert {r["key"]: r["note"] for r in sink_rows(table)} == {"A": "a", "B": "b", "C": "c"}
    assert not (table / STAGING_DIR).exists()
