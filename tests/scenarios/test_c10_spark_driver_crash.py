"""C10: Spark replays a micro-batch after a driver crash; a Delta sink.

``idem run`` is killed with SIGKILL — right after a batch's claim
(``IDEM_SPARK_KILL_AT``) and, on delta-rs, at a random moment while it commits — and
started again on the same checkpoint, each time. At the end every key is in the Delta
sink exactly once, on either ledger engine. The kills after the commit and after the
batch are the Kafka driver-crash test's and the Spark soak's. The last start, which
finishes the job, runs in the test's process.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest
from c10_runs import delta_versions, idem_run, idem_run_here, order_files, read_report
from deltalake import DeltaTable
from jvm_jars import jar_cache, require_jars
from pyspark.sql import SparkSession
from redis_backends import RealRedis

from idem.ledger import read_table

pytestmark = [pytest.mark.scenarios, pytest.mark.spark]

KILL_POINT = "after_claim@1"
"""The chosen kill (each restart is a JVM and a Spark session started afresh)."""


def _writers(path: Path) -> set[str]:
    """Which Delta engines wrote the table: each commit's ``engineInfo`` names its writer."""
    found = set()
    for commit in (path / "_delta_log").glob("*.json"):
        for line in commit.read_text().splitlines():
            info = json.loads(line).get("commitInfo", {}).get("engineInfo")
            if info:
                found.add("Delta-Lake" if "Delta-Lake/" in info else "delta-rs")
    return found


def _engine_args(engine: str) -> list[str]:
    """``idem run``'s flags for the ledger ``engine``: delta-spark gets Delta's jars."""
    if engine == "delta-spark":
        require_jars("spark", "delta-spark_")
        return ["--engine", engine, "--jars", str(jar_cache() / "spark")]
    return ["--engine", engine]


@pytest.mark.parametrize(
    ("real_backend", "engine"),
    [("redis-cluster", "delta-rs"), ("redis-server", "delta-spark")],
    indirect=["real_backend"],
)
def test_c10_delta_sink_survives_driver_kills_with_every_key_exactly_once(
    spark: SparkSession,
    real_backend: RealRedis,
    tmp_path: Path,
    engine: str,
) -> None:
    """On a 3-primary Cluster (the backend's client comes flushed) the ledger written by
    delta-rs; on a redis-server by delta-spark, through the Spark session ``idem run``
    starts with Delta's jars. The ledger engine does not depend on the Redis deployment,
    so each engine meets one (the Kafka driver-crash test runs both on a redis-server)."""
    keys = order_files(tmp_path / "in")
    sink = tmp_path / "sink"
    args = ["--sink-delta", str(sink), *_engine_args(engine)]
    url, group = real_backend.url, "c10-delta"

    code, out = idem_run(tmp_path, url, group, args, kill_at=KILL_POINT)
    assert code == -signal.SIGKILL, out[-3000:]
    assert "crash point" in out
    assert f"ledger engine: {engine}" in out
    if engine == "delta-rs":
        # A kill at a moment nobody chose: while it is committing batches.
        seen = delta_versions(sink)
        idem_run(tmp_path, url, group, args, kill_when=lambda: delta_versions(sink) > seen + 1)

    # The last start finishes the job in this process, on the test's Spark session.
    assert idem_run_here(tmp_path, url, group, args) == 0
    counts = Counter(read_table(DeltaTable(str(sink)), ["key"])["key"].to_pylist())
    assert set(counts) == keys  # nothing lost
    assert set(counts.values()) == {1}  # nothing twice
    report = read_report(tmp_path)
    assert report["sink"]["exactly_once"] is True
    assert report["pending_retries"] == 0
    assert report["replayed_batches"] >= 1  # the chosen kill cut one
    assert _writers(sink) == {"Delta-Lake" if engine == "delta-spark" else "delta-rs"}
