"""The Spark pipeline under a consumer group's own Redis ACL user: the decorator's claims
and counters on the driver, the retry source on the executors, the schedule service, all
with the rights ``idem acl user`` gives, and nothing refused but ``CONFIG GET``."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from spark_helpers import config_for, delta_run, order, sink_key_counts, write_files

from idem.acl import acl_user_line, setuser_args
from idem.redis_client import connect
from idem.redis_server import RedisServer
from idem.spark.run import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.spark]


class FailsOnce:
    """Fails ``ORDERID_2`` on its first delivery, so it takes the retry path."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()

    def __call__(self, fresh: DataFrame, batch_id: int) -> dict[str, str]:
        failed: dict[str, str] = {}
        for row in fresh.select("order_id", "reconsume_times").toArrow().to_pylist():
            self.attempts[row["order_id"]] += 1
            if row["order_id"] == "ORDERID_2" and row["reconsume_times"] == 0:
                failed[row["order_id"]] = "TimeoutError: downstream timed out"
        return failed


def test_a_pipeline_runs_under_its_groups_acl_user(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    group, password = f"acl-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    admin = redis_server.client(decode_responses=True)
    admin.execute_command("ACL", "SETUSER", *setuser_args(acl_user_line(group, password=password)))
    url = f"redis://idem-{group}:{password}@127.0.0.1:{redis_server.port}/0"
    write_files(tmp_path / "in", [[order(1), order(2)], [order(3), order(1)]])
    config = config_for(tmp_path, url, group)
    sink = FailsOnce()
    admin.acl_log_reset()
    report = Pipeline(spark, config, delta_run(tmp_path), sink_fn=sink, client=connect(url)).run()
    assert sink_key_counts(tmp_path / "sink") == {f"ORDERID_{n}": 1 for n in (1, 2, 3)}
    assert sink.attempts["ORDERID_2"] == 2  # once failed, once from %RETRY%<group>
    assert report.pending_retries == 0
    refused = {e["object"] for e in admin.acl_log(count=1000) if e["username"] == f"idem-{group}"}
    assert refused <= {"config|get"}
