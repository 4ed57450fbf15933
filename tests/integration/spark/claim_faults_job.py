"""The executors' claim under task faults, on a Spark cluster of two executor JVMs.

Run by ``test_claim_faults.py`` as ``python claim_faults_job.py REDIS_URL DATA_DIR``:
starts ``local-cluster[2,1,1024]`` (two executors, each its own JVM and Python
workers; tasks are retried there, unlike in ``local[N]``), claims one batch per
scenario with a fault staged in the first attempt of every task, and prints one
JSON line per scenario: the verdicts of every row. Then the same faults under
``@exactly_once`` and ``delta_sink`` (delta-rs): one JSON line each, with how many
times the sink got each key and how many sink table rows each key has.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from pyspark.sql import types as st

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.spark.decorator import ExactlyOnce, fingerprint_sql
from idem.spark.delta_sink import delta_sink
from idem.spark.faults import TaskFault, TaskFaultAction, TaskFaultPoint
from idem.spark.verdicts import HASH_COLUMN, VERDICT_COLUMN, ClaimTask, Verdict, verdict_frame

SCHEMA = st.StructType(
    [st.StructField("order_id", st.StringType()), st.StructField("copy", st.LongType())]
)
KEYS = 400
COPIES = 3

SCENARIOS: dict[str, TaskFault] = {
    "task_fails_after_claiming": TaskFault(TaskFaultPoint.CLAIMED, TaskFaultAction.RAISE),
    "worker_killed_mid_claim": TaskFault(TaskFaultPoint.CLAIMS_SENT, TaskFaultAction.KILL),
}


def main(url: str, data_dir: str) -> None:
    spark = (
        SparkSession.builder.master("local-cluster[2,1,1024]")
        .appName("idem-claim-faults")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.task.maxFailures", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    rows = [(f"ORDERID_{n}", 1) for _ in range(COPIES) for n in range(KEYS)]
    batch = spark.createDataFrame(rows, SCHEMA).repartition(6)
    prepared = batch.withColumn(HASH_COLUMN, F.expr(fingerprint_sql(SCHEMA)))
    for name, fault in SCENARIOS.items():
        config = IdemConfig(group=name.replace("_", "-"), redis_url=url, data_dir=data_dir,
                            buckets=8, engine="delta-rs")  # fmt: skip
        dedup = Dedup(config)
        version = dedup.catch_up()
        dedup.close()
        task = ClaimTask(config, f"q:{name}:0", dedup.clock.now_ms(), version, True, "order_id",
                         fault=fault)  # fmt: skip
        verdicts = verdict_frame(prepared, task).select("order_id", VERDICT_COLUMN).collect()
        per_key: dict[str, Counter[str]] = {}
        for row in verdicts:
            per_key.setdefault(row["order_id"], Counter())[Verdict(row[VERDICT_COLUMN]).name] += 1
        report: dict[str, Any] = {
            "scenario": name,
            "rows": len(verdicts),
            "keys": len(per_key),
            "claimed_per_key": sorted(
                {
                    sum(c[v.name] for v in (Verdict.FRESH, Verdict.RETAKEN, Verdict.RECLAIMED))
                    for c in per_key.values()
                }
            ),
            "verdicts": dict(sum(per_key.values(), Counter())),
        }
        print(json.dumps(report), flush=True)
    for name, fault in SCENARIOS.items():
        print(json.dumps(through_the_sinks(batch, name, fault, url, data_dir)), flush=True)
    spark.stop()


def through_the_sinks(batch: DataFrame, name: str, fault: TaskFault, url: str, data: str) -> Any:
    """One batch through a function sink and through a Delta sink, ``fault`` staged in the
    first attempt of every claim task: what each sink got, per key."""
    group = f"sinks-{name.replace('_', '-')}"
    config = IdemConfig(group=group, redis_url=url, data_dir=data, buckets=8, engine="delta-rs")
    given: Counter[str] = Counter()

    def record(fresh: DataFrame, batch_id: int) -> None:
        given.update(row["order_id"] for row in fresh.select("order_id").collect())

    function_sink = ExactlyOnce(record, config=config, key="order_id", query_id="q",
                                task_fault=fault)  # fmt: skip
    applied = function_sink.process(batch, 0).applied
    table = f"{data}/{group}-table"
    table_sink = delta_sink(table, key="order_id", config=config.with_changes(group=f"{group}-t"))
    table_sink.query_id = "q"
    table_sink.task_fault = fault
    table_applied = table_sink.process(batch, 0).applied
    query = QueryBuilder().register("t", DeltaTable(table)).execute("SELECT key FROM t")
    keys = pa.table(query.read_all()).column(0)
    return {
        "scenario": f"sinks_{name}",
        "function_sink_per_key": sorted(set(given.values())),
        "function_sink_keys": len(given),
        "function_applied": applied,
        "table_rows_per_key": sorted(set(Counter(keys.to_pylist()).values())),
        "table_keys": len(set(keys.to_pylist())),
        "table_applied": table_applied,
    }


if __name__ == "__main__":
    main(*sys.argv[1:3])
