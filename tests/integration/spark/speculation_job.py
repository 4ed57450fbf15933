"""One micro-batch through each sink with ``spark.speculation=true`` and a straggling claim task.

Run by ``test_speculation.py`` as ``python speculation_job.py MASTER REDIS_URL DATA_DIR
EVENTS_DIR DELTA_JARS`` against a standalone cluster of two single-core executors on two
hosts (``DELTA_JARS``: Delta's Spark jars, comma-separated, which the driver serves to
the executors).
The first attempt of one claim task stalls after it has claimed its keys in Redis,
so Spark starts a speculative copy of it on the other host; the copy claims the
same keys under the batch's owner token (the function sink's leases are its own
owner's: retaken), and its verdicts are the ones Spark keeps. Prints one JSON line
per sink (a function, ``delta_sink`` on delta-rs, ``delta_sink`` on delta-spark):
how often the sink got each key, the batch's outcome counts, how many
keys each claim task had, and every attempt of the claim stage's tasks (from
Spark's event log, which records each attempt, its host, whether it was a
speculative copy and how it ended).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder
from pyspark.sql import DataFrame, SparkSession

from idem.config import IdemConfig, LedgerEngine
from idem.keys import bucket_of
from idem.spark.decorator import ExactlyOnce
from idem.spark.delta_sink import delta_sink
from idem.spark.faults import TaskFault, TaskFaultAction, TaskFaultPoint

KEYS = 400
COPIES = 3
BUCKETS = 8
CLAIM_TASKS = 4
"""The claim stage's tasks (``spark.sql.shuffle.partitions``): Spark speculates a task
once three quarters of them have finished (``spark.speculation.quantile``)."""
STALL_S = 60.0
"""How long the first attempt of the straggling task sleeps: Spark kills it as soon as
its speculative copy succeeds, so this is only waited out when no copy ever runs."""
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""A short job: the JVMs start quickly rather than run at their peak."""
DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
CLAIM_STAGE = "MapInArrow"
"""The name Spark gives the claim stage's ``mapInArrow`` in a stage's RDD scopes."""


def main(master: str, url: str, data_dir: str, events: str, delta_jars: str) -> None:
    spark = (
        SparkSession.builder.master(master)
        .config("spark.jars", delta_jars)
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config(
            "spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog"
        )
        .appName("idem-speculation")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.executor.memory", "512m")
        .config("spark.driver.extraJavaOptions", QUICK_JVM)
        .config("spark.executor.extraJavaOptions", QUICK_JVM)
        .config("spark.sql.shuffle.partitions", str(CLAIM_TASKS))
        # Adaptive execution would coalesce the claim stage's small shuffle into one
        # task, and Spark never speculates a stage of one task.
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.speculation", "true")
        .config("spark.eventLog.enabled", "true")
        .config("spark.eventLog.dir", Path(events).as_uri())
        .config("spark.eventLog.rolling.enabled", "false")
        .config("spark.eventLog.compress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    log_task_scheduling(spark)
    warm_python_workers(spark)
    batch = spark.range(0, KEYS * COPIES, 1, CLAIM_TASKS).selectExpr(
        f"concat('ORDERID_', id % {KEYS}) AS order_id", "1L AS copy"
    )
    keys_of_task = keys_per_claim_task(spark)
    stalled = max(keys_of_task, key=keys_of_task.__getitem__)
    fault = TaskFault(TaskFaultPoint.CLAIMED, TaskFaultAction.STALL, stalled, STALL_S)
    reports = [
        function_sink(spark, batch, fault, url, data_dir),
        *(
            table_sink(spark, batch, fault, url, data_dir, engine=engine)
            for engine in (LedgerEngine.DELTA_RS, LedgerEngine.DELTA_SPARK)
        ),
    ]
    spark.stop()
    attempts = claim_attempts(Path(events))
    for report in reports:
        report["claim_attempts"] = attempts.get(report["sink"], [])
        report["stalled_task"] = stalled
        report["keys_of_task"] = keys_of_task
        print(json.dumps(report), flush=True)


def log_task_scheduling(spark: SparkSession) -> None:
    """Have the driver log where each task attempt starts and ends, and which tasks it
    marks as stragglers: what to read when no speculative copy ran."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    log4j = jvm.org.apache.logging.log4j
    log4j.core.config.Configurator.setLevel(
        "org.apache.spark.scheduler.TaskSetManager", log4j.Level.INFO
    )


def warm_python_workers(spark: SparkSession) -> None:
    """Start a Python worker with idem imported on each executor before the batch.

    Spark's threshold for a straggler is a multiple of the median task time; the
    first task on an executor also pays for starting Python and importing idem, and
    would raise that median past the stall.
    """

    def imports(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import idem.spark.verdicts  # noqa: F401 -- loaded into the reused worker

        yield from batches

    spark.range(2).repartition(2).mapInArrow(imports, "id long").collect()


def keys_per_claim_task(spark: SparkSession) -> dict[int, int]:
    """How many distinct keys each claim task (shuffle partition) gets: a key's task is
    ``pmod(hash(bucket), partitions)``, Spark's hash partitioning of the bucket column
    (evaluated by the driver: a query of literals runs no task)."""
    values = ", ".join(f"({b})" for b in range(BUCKETS))
    rows = spark.sql(
        f"SELECT b, pmod(hash(CAST(b AS INT)), {CLAIM_TASKS}) FROM VALUES {values} AS t(b)"  # noqa: S608 -- literals
    ).collect()
    task_of = {int(r[0]): int(r[1]) for r in rows}
    return dict(Counter(task_of[bucket_of(f"ORDERID_{n}", BUCKETS)] for n in range(KEYS)))


def function_sink(
    spark: SparkSession, batch: DataFrame, fault: TaskFault, url: str, data: str
) -> dict[str, Any]:
    """The batch through an ``@exactly_once`` function (claims with leases)."""
    config = IdemConfig(group="speculation-fn", redis_url=url, data_dir=data, buckets=BUCKETS,
                        engine=LedgerEngine.DELTA_RS)  # fmt: skip
    given: Counter[str] = Counter()

    def record(fresh: DataFrame, batch_id: int) -> None:
        given.update(row["order_id"] for row in fresh.select("order_id").collect())

    sink = ExactlyOnce(record, config=config, key="order_id", query_id="q", task_fault=fault)
    spark.sparkContext.setJobGroup("function", "function sink")
    outcome = sink.process(batch, 0)
    return {
        "sink": "function",
        "per_key": sorted(set(given.values())),
        "keys": len(given),
        "applied": outcome.applied,
        "retaken": outcome.retaken,
        "busy": outcome.busy,
    }


def table_sink(
    spark: SparkSession,
    batch: DataFrame,
    fault: TaskFault,
    url: str,
    data: str,
    *,
    engine: LedgerEngine,
) -> dict[str, Any]:
    """The batch through ``delta_sink`` on ``engine`` (its table is the ledger; no leases)."""
    name = "table" if engine is LedgerEngine.DELTA_RS else f"table-{engine.value}"
    config = IdemConfig(group=f"speculation-{name}", redis_url=url, data_dir=data,
                        buckets=BUCKETS, engine=engine)  # fmt: skip
    table = f"{data}/speculation-{name}"
    sink = delta_sink(table, key="order_id", config=config)
    sink.query_id = "q"
    sink.task_fault = fault
    spark.sparkContext.setJobGroup(name, f"delta sink on {engine.value}")
    outcome = sink.process(batch, 0)
    query = QueryBuilder().register("t", DeltaTable(table)).execute("SELECT key FROM t")
    keys = pa.table(query.read_all()).column(0).to_pylist()
    per_key = Counter(keys)
    return {
        "sink": name,
        "per_key": sorted(set(per_key.values())),
        "keys": len(per_key),
        "applied": outcome.applied,
        "retaken": outcome.retaken,
        "busy": outcome.busy,
    }


def claim_attempts(events: Path) -> dict[str, list[dict[str, Any]]]:
    """Per job group: every task attempt of its claim stage (the group's first stage
    that runs a ``mapInArrow``; later stages read the claim's kept rows), with the
    partition, attempt number, whether Spark ran it as a speculative copy, its host
    and how it ended, from the event log."""
    group_of_stage: dict[int, str] = {}
    claim_stage: dict[str, int] = {}
    found: dict[str, list[dict[str, Any]]] = {}
    for log in sorted(p for p in events.rglob("*") if p.is_file()):
        for line in log.read_text(encoding="utf-8").splitlines():
            event = json.loads(line)
            kind = event["Event"]
            if kind == "SparkListenerStageSubmitted":
                stage = event["Stage Info"]
                group = (event.get("Properties") or {}).get("spark.jobGroup.id")
                scopes = " ".join(str(rdd.get("Scope", "")) for rdd in stage["RDD Info"])
                if group and CLAIM_STAGE in scopes and group not in claim_stage:
                    claim_stage[group] = stage["Stage ID"]
                    group_of_stage[stage["Stage ID"]] = group
            elif kind == "SparkListenerTaskEnd" and event["Stage ID"] in group_of_stage:
                info = event["Task Info"]
                found.setdefault(group_of_stage[event["Stage ID"]], []).append(
                    {
                        "partition": info.get("Partition ID", info["Index"]),
                        "attempt": info["Attempt"],
                        "speculative": info["Speculative"],
                        "host": info["Host"],
                        "end": event["Task End Reason"]["Reason"],
                    }
                )
    return found


if __name__ == "__main__":
    main(*sys.argv[1:6])
