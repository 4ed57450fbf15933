"""The executors' claim under task faults, on a Spark cluster of two executor JVMs.

Run by ``test_claim_faults.py`` as ``python claim_faults_job.py REDIS_URL DATA_DIR``:
starts ``local-cluster[2,1,1024]`` (two executors, each its own JVM and Python
workers; tasks are retried there, unlike in ``local[N]``), claims one batch per
scenario with a fault staged in the first attempt of every task, and prints one
JSON line per scenario: the verdicts of every row.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from pyspark.sql import types as st

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.spark.decorator import fingerprint_sql
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
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:3])
