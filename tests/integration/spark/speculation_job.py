"""``@exactly_once`` with ``spark.speculation=true`` on a standalone cluster of two hosts.

Run by ``test_speculation.py`` as ``python speculation_job.py REDIS_URL DATA_DIR``.
Spark starts a speculative copy of a slow task only on another host than the
original's, so this starts a real standalone master on 127.0.0.1 and one worker
on each of 127.0.0.2 and 127.0.0.3 (``spark-class``), then runs one batch through
a function sink and one through ``delta_sink`` (delta-rs) with the first attempt
of one claim task stalled after claiming. Prints one JSON line: how often each
sink got each key, and how many speculative attempts Spark launched.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyspark
from deltalake import DeltaTable, QueryBuilder
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as st

from idem.config import IdemConfig
from idem.spark.decorator import ExactlyOnce
from idem.spark.delta_sink import delta_sink
from idem.spark.faults import TaskFault, TaskFaultAction, TaskFaultPoint

SCHEMA = st.StructType(
    [st.StructField("order_id", st.StringType()), st.StructField("copy", st.LongType())]
)
KEYS = 400
COPIES = 3
STALL_S = 20.0
SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _wait_for_port(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")


@contextlib.contextmanager
def standalone_cluster(work: Path) -> Iterator[str]:
    """A standalone master on 127.0.0.1 and a worker (1 core) on 127.0.0.2 and 127.0.0.3."""
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_CLASS.parent.parent),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYSPARK_PYTHON": sys.executable,
    }
    port = _free_port("127.0.0.1")
    master = f"spark://127.0.0.1:{port}"
    procs = [
        subprocess.Popen(
            [
                str(SPARK_CLASS),
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(_free_port("127.0.0.1")),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=(work / "master.log").open("wb"),
        )
    ]
    try:
        _wait_for_port("127.0.0.1", port, 60)
        for host in ("127.0.0.2", "127.0.0.3"):
            procs.append(
                subprocess.Popen(
                    [
                        str(SPARK_CLASS),
                        "org.apache.spark.deploy.worker.Worker",
                        "--host",
                        host,
                        "--cores",
                        "1",
                        "--memory",
                        "1g",
                        "--work-dir",
                        str(work / host),
                        "--webui-port",
                        str(_free_port(host)),
                        master,
                    ],
                    env={**env, "SPARK_LOCAL_IP": host},
                    stdout=subprocess.DEVNULL,
                    stderr=(work / f"worker-{host}.log").open("wb"),
                )
            )
        yield master
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(url: str, data_dir: str) -> None:
    work = Path(data_dir) / "cluster"
    work.mkdir(parents=True, exist_ok=True)
    with standalone_cluster(work) as master:
        spark = (
            SparkSession.builder.master(master)
            .appName("idem-speculation")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.executor.memory", "768m")
            .config("spark.cores.max", "2")
            .config("spark.sql.adaptive.enabled", "false")
            .config("spark.sql.shuffle.partitions", "4")
            .config("spark.speculation", "true")
            .config("spark.speculation.interval", "200ms")
            .config("spark.speculation.quantile", "0.5")
            .config("spark.speculation.multiplier", "1.5")
            .config("spark.speculation.minTaskRuntime", "1s")
            .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        deadline = time.monotonic() + 120
        while len(spark.sparkContext._jsc.sc().getExecutorMemoryStatus()) < 3:
            if time.monotonic() > deadline:
                raise RuntimeError("the two workers' executors did not register in 120 s")
            time.sleep(0.5)
        listener = _SpeculativeTasks(spark)
        rows = [(f"ORDERID_{n}", 1) for _ in range(COPIES) for n in range(KEYS)]
        batch = spark.createDataFrame(rows, SCHEMA).repartition(4)
        fault = TaskFault(
            TaskFaultPoint.CLAIMED, TaskFaultAction.STALL, partition=0, stall_s=STALL_S
        )
        report: dict[str, Any] = {}
        config = IdemConfig(group="speculated", redis_url=url, data_dir=data_dir, buckets=8,
                            engine="delta-rs")  # fmt: skip
        given: Counter[str] = Counter()

        def record(fresh: DataFrame, batch_id: int) -> None:
            given.update(row["order_id"] for row in fresh.select("order_id").collect())

        function_sink = ExactlyOnce(record, config=config, key="order_id", query_id="q",
                                    task_fault=fault)  # fmt: skip
        report["function_applied"] = function_sink.process(batch, 0).applied
        report["function_sink_per_key"] = sorted(set(given.values()))
        report["function_sink_keys"] = len(given)
        table = f"{data_dir}/speculated-table"
        table_sink = delta_sink(table, key="order_id",
                                config=config.with_changes(group="speculated-t"))  # fmt: skip
        table_sink.query_id = "q"
        table_sink.task_fault = fault
        report["table_applied"] = table_sink.process(batch, 0).applied
        query = QueryBuilder().register("t", DeltaTable(table)).execute("SELECT key FROM t")
        keys = pa.table(query.read_all()).column(0).to_pylist()
        report["table_rows_per_key"] = sorted(set(Counter(keys).values()))
        report["table_keys"] = len(set(keys))
        report["speculative_tasks"] = listener.count()
        print(json.dumps(report), flush=True)
        spark.stop()


class _SpeculativeTasks:
    """How many speculative task attempts the application ran (from Spark's status store)."""

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark

    def count(self) -> int:
        store = self.spark.sparkContext._jsc.sc().statusStore()
        stages = store.stageList(None)
        total = 0
        for n in range(stages.size()):
            stage = stages.apply(n)
            tasks = store.taskList(stage.stageId(), stage.attemptId(), 10_000)
            for t in range(tasks.size()):
                total += int(bool(tasks.apply(t).speculative()))
        return total


if __name__ == "__main__":
    main(*sys.argv[1:3])
