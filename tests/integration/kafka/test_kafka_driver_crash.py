"""C10 on Kafka: ``idem run`` reading a topic is killed with SIGKILL inside a batch and
restarted on its checkpoint; every key is in the Delta sink exactly once.

The crash points are idem's own (``IDEM_SPARK_KILL_AT``, :mod:`idem.spark.faults`): after
the commit, and after the batch before Spark's commit log, one per Delta engine. The driver is
a separate ``idem run`` process with its own local Spark and Spark's Kafka connector; the
last start, which finishes the job, runs in the test's process on its Spark session.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from in_process import cli_main_with
from jvm_jars import delta_spark_conf, require_jars
from kafka_helpers import SCHEMA, KafkaCase, resent_orders, sink_counts

from idem.spark.faults import KILL_AT_ENV
from idem.spark.session import FAST_START_JAVA_OPTIONS

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.scenarios]

RUN_TIMEOUT_S = 600
"""One ``idem run`` process: a JVM and Spark of its own start each time."""

KILL_POINTS = {
    "delta-rs": ("after_batch@3",),
    "delta-spark": ("after_commit@2",),
}
"""Where each engine's run is killed (every restart is a JVM and a Spark session started
afresh); the kills after the claim are the file-source C10's, on both engines."""


def _run_args(case: KafkaCase, group: str) -> list[str]:
    """``idem run --available-now`` of the case's topic."""
    tmp = case.tmp_path
    return [
        "run", "--source", case.source, "--key", "order_id", "--schema", SCHEMA,
        "--kafka-option", "maxOffsetsPerTrigger=100",
        "--group", group, "--redis-url", case.redis_url, "--data-dir", str(tmp / "data"),
        "--checkpoint", str(tmp / "checkpoint"), "--sink-delta", str(tmp / "sink"),
        "--available-now", "--delay-levels", "1s 1s 1s", "--max-reconsume-times", "3",
        "--report-json", str(tmp / "report.json"),
    ]  # fmt: skip


def _idem_run(case: KafkaCase, group: str, *, kill_at: str) -> tuple[int, str]:
    """The run in a process of its own (its own JVM), killed at ``kill_at``."""
    tmp = case.tmp_path
    conf = {
        **delta_spark_conf(require_jars("spark", "delta-spark_")),
        "spark.driver.extraJavaOptions": FAST_START_JAVA_OPTIONS,
    }
    command = [
        sys.executable, "-m", "idem.cli", *_run_args(case, group),
        *(arg for name, value in conf.items() for arg in ("--spark-conf", f"{name}={value}")),
    ]  # fmt: skip
    env = {**os.environ, "IDEM_ENGINE": case.engine, KILL_AT_ENV: kill_at}
    log = tmp / f"run-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=RUN_TIMEOUT_S)
        finally:
            # The JVM is the driver's child: nothing of this run may outlive it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return code, log.read_text(errors="replace")


@pytest.mark.timeout(4 * RUN_TIMEOUT_S)
def test_c10_driver_killed_inside_batches_leaves_every_key_once(case: KafkaCase) -> None:
    keys = [f"ORDERID_{i}" for i in range(150)]
    case.produce(resent_orders(keys, seed=10))
    group = f"c10-{case.topic}"

    for point in KILL_POINTS[case.engine]:
        code, out = _idem_run(case, group, kill_at=point)
        assert code == -signal.SIGKILL, out[-3000:]
        assert f"crash point {point.split('@')[0]}" in out

    # The last start finishes the job in this process, on the test's Spark session.
    assert cli_main_with(_run_args(case, group), {"IDEM_ENGINE": case.engine}) == 0
    counts = sink_counts(case.tmp_path / "sink")
    assert set(counts) == set(keys)  # nothing lost
    assert set(counts.values()) == {1}  # nothing twice
    report: dict[str, Any] = json.loads((case.tmp_path / "report.json").read_text())
    assert report["sink"]["exactly_once"] is True
    # Spark did replay the batches the kills cut
    assert report["replayed_batches"] >= len(KILL_POINTS[case.engine])
    assert report["pending_retries"] == 0
