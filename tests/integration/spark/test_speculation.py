"""Spark's speculative execution of a claim task: every key still reaches each sink once.

A real standalone cluster (``standalone_cluster.py``: two single-core executors on two
loopback hosts, since Spark runs a speculative copy only on another host than the
task's running attempt), a real redis-server, ``spark.speculation=true``. The first
attempt of one claim task stalls after claiming its keys; Spark starts a copy of it
on the other executor, which claims the same keys under the batch's owner token (a
retaken claim, for a function sink's leases) and whose rows Spark keeps. The sinks: a
function, and ``delta_sink`` on each ledger engine (Delta's Spark jars served to the
executors by the driver).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from jvm_jars import require_jars
from standalone_cluster import StandaloneCluster, standalone_cluster

from idem.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.spark]

JOB = Path(__file__).with_name("speculation_job.py")
KEYS = 400


@pytest.fixture
def cluster() -> Iterator[StandaloneCluster]:
    """A master and two single-core workers on 127.0.0.1-3, all stopped afterwards."""
    with standalone_cluster() as started:
        yield started


def test_every_key_reaches_each_sink_once_when_spark_speculates_a_claim_task(
    cluster: StandaloneCluster, redis_server: RedisServer, tmp_path: Path
) -> None:
    events = tmp_path / "events"
    events.mkdir()
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    data = str(tmp_path / "idem-data")
    jars = ",".join(require_jars("spark", "delta-spark_"))  # served to the executors
    done = subprocess.run(
        [sys.executable, str(JOB), cluster.master_url, redis_server.url, data, str(events), jars],
        capture_output=True,
        text=True,
        env=env,
        timeout=500,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = {r["sink"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert set(reports) == {"function", "table", "table-delta-spark"}
    for sink, report in reports.items():
        stalled = report["stalled_task"]
        assert report["keys_of_task"][str(stalled)] > 0, report  # the stall fires on rows
        attempts = [a for a in report["claim_attempts"] if a["partition"] == stalled]
        first = [a for a in attempts if a["attempt"] == 0]
        copies = [a for a in attempts if a["speculative"] and a["end"] == "Success"]
        # Spark ran a speculative copy of the stalled claim task on the other host, and
        # the copy's rows are the batch's: the first attempt was killed, not finished.
        assert len(copies) == 1, (sink, report["claim_attempts"], scheduling(done.stderr))
        assert copies[0]["attempt"] >= 1, (sink, copies)
        assert len(first) == 1, (sink, attempts)
        assert first[0]["end"] != "Success", (sink, attempts)
        assert first[0]["host"] != copies[0]["host"], (sink, attempts)
        # Each key once in the sink: none lost to the stalled attempt's claims, none twice.
        assert report["per_key"] == [1], (sink, report)
        assert report["keys"] == report["applied"] == KEYS, (sink, report)
        assert report["busy"] == 0, (sink, report)
    # The function sink's claims take leases: every successful copy of a claim task
    # found its keys' leases held by the batch's own owner (retaken, not busy).
    function = reports["function"]
    speculated = {
        a["partition"]
        for a in function["claim_attempts"]
        if a["speculative"] and a["end"] == "Success"
    }
    keys_of_task = function["keys_of_task"]
    assert function["retaken"] == sum(keys_of_task.get(str(p), 0) for p in speculated), function


def scheduling(stderr: str) -> str:
    """The driver's lines on where task attempts ran and which it marked as stragglers."""
    return "\n".join(line for line in stderr.splitlines() if "TaskSetManager" in line)[-4000:]
