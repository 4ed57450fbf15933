"""``idem run`` rides out a Redis outage: its redis-server SIGKILLed while batches run,
restarted on its AOF seconds later.

The batch the outage cut short fails the streaming query; ``idem run`` waits for Redis
to answer, starts the query again on its checkpoint, and ends with every key in the
Delta sink exactly once (exit 0), as a restart of the whole process would. The run is
this process's (the shared Spark session); the outage is a real SIGKILL.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from c10_runs import GROUP_TIMEOUT_S, SCHEMA, delta_versions, order_files
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from idem.cli import main as cli_main
from idem.ledger import read_table
from idem.redis_server import RedisServer

pytestmark = [pytest.mark.faults, pytest.mark.spark]

OUTAGE_S = 4.0
"""How long redis-server stays down: longer than a client's quick reconnect attempts."""


def _outage_once_batches_run(server: RedisServer, sink: Path, done: list[str]) -> None:
    """SIGKILL ``server`` once the sink has two commits, restart it ``OUTAGE_S`` later."""
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    while delta_versions(sink) < 2:
        if time.monotonic() > deadline:
            done.append("no batch was committed")
            return
        time.sleep(0.05)
    server.kill()
    time.sleep(OUTAGE_S)
    server.restart()
    done.append("restarted")


def test_idem_run_started_again_on_its_checkpoint_after_a_redis_outage_writes_each_key_once(
    spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = order_files(tmp_path / "in")
    sink = tmp_path / "sink"
    with RedisServer(directory=tmp_path / "redis", appendonly=True, appendfsync="always") as server:
        done: list[str] = []
        outage = threading.Thread(target=_outage_once_batches_run, args=(server, sink, done))
        outage.start()
        try:
            code = cli_main([
                "run", "--source", str(tmp_path / "in"), "--key", "order_id",
                "--group", "outage", "--redis-url", server.url,
                "--data-dir", str(tmp_path / "data"), "--checkpoint", str(tmp_path / "checkpoint"),
                "--schema", SCHEMA, "--delay-levels", "1s 1s 1s", "--max-reconsume-times", "3",
                "--available-now", "--max-files-per-trigger", "1",
                "--report-json", str(tmp_path / "report.json"), "--sink-delta", str(sink),
                "--engine", "delta-rs",
            ])  # fmt: skip
        finally:
            outage.join(GROUP_TIMEOUT_S)
    assert done == ["restarted"]
    assert code == 0
    assert "Redis was away: the query starts again on its checkpoint" in caplog.text
    counts = Counter(read_table(DeltaTable(str(sink)), ["key"])["key"].to_pylist())
    assert set(counts) == keys  # nothing lost
    assert set(counts.values()) == {1}  # nothing twice
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["sink"]["exactly_once"] is True
    assert report["pending_retries"] == 0
