"""``idem run`` stopped by a signal prints its report and exits as every idem command does:
Ctrl-C (SIGINT) is exit 130, SIGTERM a clean stop (exit 0), so a script can tell a run cut
short by Ctrl-C from one that ended.

A real ``idem run`` process (its own local Spark) and a real redis-server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from spark_helpers import order, sink_key_counts, write_files

from idem.redis_server import RedisServer
from idem.spark.session import FAST_START_JAVA_OPTIONS

pytestmark = [pytest.mark.integration, pytest.mark.spark]


@pytest.mark.parametrize(
    ("stop", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 0)], ids=["sigint", "sigterm"]
)
def test_idem_run_stopped_by_ctrl_c_is_exit_130_and_by_sigterm_exit_0_with_the_report(
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    stop: signal.Signals,
    code: int,
) -> None:
    write_files(tmp_path / "in", [[order(1), order(2)]])
    log = tmp_path / "stderr.txt"
    command = [
        sys.executable, "-m", "idem.cli", "run", "--source", str(tmp_path / "in"),
        "--key", "order_id", "--group", f"interrupted-{code}", "--redis-url", redis_server.url,
        "--data-dir", str(tmp_path / "data"), "--sink-delta", str(tmp_path / "sink"),
        "--trigger-seconds", "0.5",
        "--spark-conf", f"spark.driver.extraJavaOptions={FAST_START_JAVA_OPTIONS}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYSPARK_PYTHON": sys.executable}
    with log.open("w", encoding="utf-8") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            deadline = time.monotonic() + 180
            while "batch 0:" not in log.read_text(encoding="utf-8"):
                assert process.poll() is None, log.read_text(encoding="utf-8")
                assert time.monotonic() < deadline, "the first batch never ran"
                time.sleep(0.5)
        finally:
            process.send_signal(stop)
            out, _ = process.communicate(timeout=120)
    assert process.returncode == code, log.read_text(encoding="utf-8")[-3000:]
    assert "applied to the sink:   2" in out  # the report is printed either way
    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_1": 1, "ORDERID_2": 1}
