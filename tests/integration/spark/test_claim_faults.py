"""The executors' claim when a task fails or loses its Python worker.

A real Spark cluster of two executor JVMs (``local-cluster``: tasks are retried
there) and a real redis-server; the faults are staged in the first attempt of
every task (``idem.spark.faults.TaskFault``): an exception after the claim, and
SIGKILL of the Python worker between sending the claims and reading them. Every
key of the batch must still be claimed by exactly one of its rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from spark_helpers import run_job

from idem.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.spark]

JOB = Path(__file__).with_name("claim_faults_job.py")


def test_every_key_is_claimed_once_through_a_task_failure_and_a_killed_worker(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    lines = run_job(JOB, redis_server.url, str(tmp_path / "idem-data"), timeout=540)
    reports = {r["scenario"]: r for r in lines}
    claims = {"task_fails_after_claiming", "worker_killed_mid_claim"}
    assert set(reports) == claims | {f"sinks_{name}" for name in claims}
    for name in claims:
        report = reports[name]
        assert report["rows"] == 1200, name  # 400 keys x 3 copies, each row once
        assert report["keys"] == 400, name
        assert report["claimed_per_key"] == [1], (name, report["verdicts"])
        assert report["verdicts"].get("IN_BATCH") == 800, (name, report["verdicts"])
    # Every retried attempt found the first attempt's claims as its own.
    assert reports["task_fails_after_claiming"]["verdicts"] == {"RETAKEN": 400, "IN_BATCH": 800}
    # The same faults under the sinks: every key reaches each sink exactly once.
    for name in claims:
        sinks = reports[f"sinks_{name}"]
        assert sinks["function_sink_per_key"] == [1], (name, sinks)
        assert sinks["function_sink_keys"] == sinks["function_applied"] == 400, (name, sinks)
        assert sinks["table_rows_per_key"] == [1], (name, sinks)
        assert sinks["table_keys"] == sinks["table_applied"] == 400, (name, sinks)
