"""The report counts each batch once, whatever moment a driver failure hits it.

``idem run``'s pipeline on real local Spark, a real redis-server and real Delta tables;
the failure is staged inside the batch that carries a retried row, and the run is
restarted on the same checkpoint, so Spark replays that batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from spark_helpers import config_for, delta_run, order, sink_key_counts, write_files

from idem.redis_server import RedisServer
from idem.spark.faults import CrashPlan, CrashPoint
from idem.spark.run import Pipeline, QueryFailed

pytestmark = [pytest.mark.integration, pytest.mark.spark]

RETRY_BATCH = 1
"""Batch 0 is the file; ORDERID_1 fails in it and comes back alone in batch 1."""


def _fail_orderid_1_once(fresh: DataFrame, batch_id: int) -> dict[str, str]:
    rows = fresh.select("order_id", "reconsume_times").toArrow().to_pylist()
    return {
        r["order_id"]: "TimeoutError: downstream timed out"
        for r in rows
        if r["order_id"] == "ORDERID_1" and not r["reconsume_times"]
    }


@pytest.mark.parametrize("point", [CrashPoint.AFTER_RECORD, CrashPoint.AFTER_ACK])
def test_a_crash_around_the_retry_ack_neither_loses_nor_doubles_the_batchs_counts(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path, point: CrashPoint
) -> None:
    write_files(tmp_path / "in", [[order(n) for n in range(1, 6)]])
    config = config_for(tmp_path, redis_server.url, f"counts-{point.value}".replace("_", "-"))
    spec = delta_run(tmp_path)
    crash = CrashPlan(point, RETRY_BATCH)
    pipeline = Pipeline(
        spark,
        config,
        spec,
        sink_fn=_fail_orderid_1_once,
        client=redis_server.client(),
        crash_plan=crash,
    )
    try:
        with pytest.raises(QueryFailed, match="SimulatedCrash"):
            pipeline.run()
        assert crash.fired
        report = pipeline.run()  # restarted on the checkpoint: Spark replays batch 1
    finally:
        pipeline.close()

    assert sink_key_counts(tmp_path / "sink") == {f"ORDERID_{n}": 1 for n in range(1, 6)}
    t = report.totals
    # Batch 0: five rows, four applied, one failed; batch 1: the retried row, applied.
    assert (t.batches, t.messages, t.retried_rows, t.applied, t.failed) == (2, 6, 1, 5, 1)
    assert t.retried_total == 1
    assert t.replayed_batches == 1
    assert report.pending_retries == 0
