"""``@exactly_once`` and ``delta_sink`` while Spark runs speculative copies of claim tasks.

A real standalone Spark cluster with workers on two loopback hosts (Spark
speculates only onto another host), a real redis-server, real Delta tables: the
first attempt of one claim task stalls after claiming, Spark starts a copy of it
elsewhere, and both attempts claim under the batch's owner token. Every key
still reaches each sink exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from idem.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.spark]

JOB = Path(__file__).with_name("speculation_job.py")


def test_speculative_claim_tasks_still_give_every_key_once(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    done = subprocess.run(
        [sys.executable, str(JOB), redis_server.url, str(tmp_path / "idem-data")],
        capture_output=True,
        text=True,
        env=env,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["speculative_tasks"] >= 1, report  # Spark did run a copy of a task
    assert report["function_sink_per_key"] == [1], report
    assert report["function_sink_keys"] == report["function_applied"] == 400, report
    assert report["table_rows_per_key"] == [1], report
    assert report["table_keys"] == report["table_applied"] == 400, report
