"""C10: Spark replays a micro-batch after a driver crash.

``idem run`` is killed with SIGKILL — at chosen crash points inside a batch
(``IDEM_SPARK_KILL_AT``: after the claim, after the sink, after the commit,
after the batch but before Spark's commit log) and at a random moment while it
works — and started again on the same checkpoint, each time. At the end every key is in the sink
exactly once (Delta sink) or at least once with every repeat carrying the same
idempotency key and counted in the report (a file appended by ``--sink-fn``).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from jvm_jars import jar_cache, require_jars
from redis_backends import RealRedis

from idem.ledger import read_table
from idem.redis_server import RedisServer
from idem.spark.session import FAST_START_JAVA_OPTIONS

pytestmark = [pytest.mark.scenarios, pytest.mark.spark]

HERE = Path(__file__).parent
SCHEMA = "order_id string, amount double"
GROUP_TIMEOUT_S = 240


def _files(directory: Path, batches: int = 8, per_batch: int = 20) -> set[str]:
    """Order files with duplicates inside and across files; returns the distinct keys."""
    directory.mkdir(parents=True)
    rng = random.Random(10)
    keys: set[str] = set()
    for b in range(batches):
        rows = [f"ORDERID_{b * per_batch + i}" for i in range(per_batch)]
        rows += rng.sample(rows, 3)  # duplicates in the batch
        if b:
            rows += [f"ORDERID_{(b - 1) * per_batch + i}" for i in range(4)]  # redelivered
        keys.update(rows)
        text = "".join(json.dumps({"order_id": k, "amount": 1.0}) + "\n" for k in rows)
        (directory / f"part-{b:03d}.json").write_text(text)
    return keys


def _idem_run(
    tmp: Path,
    url: str,
    group: str,
    sink_args: list[str],
    *,
    kill_at: str | None = None,
    kill_when: Callable[[], bool] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Run ``idem run --available-now`` once; kill it as asked; return (exit code, output)."""
    command = [
        sys.executable, "-m", "idem.cli", "run",
        "--source", str(tmp / "in"), "--key", "order_id", "--group", group,
        "--redis-url", url, "--data-dir", str(tmp / "data"),
        "--checkpoint", str(tmp / "checkpoint"), "--schema", SCHEMA,
        "--available-now", "--max-files-per-trigger", "1",
        "--delay-levels", "1s 1s 1s", "--max-reconsume-times", "3",
        "--report-json", str(tmp / "report.json"),
        "--spark-conf", f"spark.driver.extraJavaOptions={FAST_START_JAVA_OPTIONS}",
        *sink_args,
    ]  # fmt: skip
    full_env = {**os.environ, **(env or {})}
    full_env.pop("IDEM_SPARK_KILL_AT", None)
    if kill_at:
        full_env["IDEM_SPARK_KILL_AT"] = kill_at
    log = tmp / f"run-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
        try:
            if kill_when is not None:
                deadline = time.monotonic() + GROUP_TIMEOUT_S
                while proc.poll() is None and not kill_when() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(random.Random(os.getpid()).uniform(0.0, 0.8))
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait(timeout=GROUP_TIMEOUT_S)
        finally:
            # The JVM is the driver's child: make sure nothing of this run survives it.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return code, log.read_text(errors="replace")


def _report(tmp: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads((tmp / "report.json").read_text())
    return report


def _writers(path: Path) -> set[str]:
    """Which Delta engines wrote the table: each commit's ``engineInfo`` names its writer."""
    found = set()
    for commit in (path / "_delta_log").glob("*.json"):
        for line in commit.read_text().splitlines():
            info = json.loads(line).get("commitInfo", {}).get("engineInfo")
            if info:
                found.add("Delta-Lake" if "Delta-Lake/" in info else "delta-rs")
    return found


def _delta_versions(path: Path) -> int:
    log = path / "_delta_log"
    return len(list(log.glob("*.json"))) if log.is_dir() else 0


def _engine_args(engine: str) -> list[str]:
    """``idem run``'s flags for the ledger ``engine``: delta-spark gets Delta's jars."""
    if engine == "delta-spark":
        require_jars("spark", "delta-spark_")
        return ["--engine", engine, "--jars", str(jar_cache() / "spark")]
    return ["--engine", engine]


@pytest.mark.parametrize(
    ("real_backend", "engine"),
    [("redis-server", "delta-rs"), ("redis-cluster", "delta-rs"), ("redis-server", "delta-spark")],
    indirect=["real_backend"],
)
def test_c10_delta_sink_survives_driver_kills_with_every_key_exactly_once(
    real_backend: RealRedis, tmp_path: Path, engine: str
) -> None:
    """On a redis-server and on a 3-primary Cluster (the backend's client comes flushed),
    the ledger written by delta-rs; and on a redis-server by delta-spark, through the Spark
    session ``idem run`` starts with Delta's jars (the ledger engine does not depend on
    the Redis deployment)."""
    keys = _files(tmp_path / "in")
    sink = tmp_path / "sink"
    args = ["--sink-delta", str(sink), *_engine_args(engine)]
    url, group = real_backend.url, "c10-delta"

    for point in ("after_claim@1", "after_commit@3"):
        code, out = _idem_run(tmp_path, url, group, args, kill_at=point)
        assert code == -signal.SIGKILL, out[-3000:]
        assert "crash point" in out
    # A kill at a moment nobody chose: while it is committing batches.
    seen = _delta_versions(sink)
    _idem_run(tmp_path, url, group, args, kill_when=lambda: _delta_versions(sink) > seen + 1)

    code, out = _idem_run(tmp_path, url, group, args)
    assert code == 0, out[-3000:]
    counts = Counter(read_table(DeltaTable(str(sink)), ["key"])["key"].to_pylist())
    assert set(counts) == keys  # nothing lost
    assert set(counts.values()) == {1}  # nothing twice
    report = _report(tmp_path)
    assert report["sink"]["exactly_once"] is True
    assert report["pending_retries"] == 0
    assert report["replayed_batches"] >= 2
    assert f"ledger engine: {engine}" in out
    assert _writers(sink) == {"Delta-Lake" if engine == "delta-spark" else "delta-rs"}


def test_c10_file_sink_repeats_only_with_the_same_idempotency_key_and_counts_them(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    redis_server.client().flushall()
    keys = _files(tmp_path / "in")
    out_file = tmp_path / "sink.jsonl"
    out_file.touch()
    flaky = ["ORDERID_5", "ORDERID_47", "ORDERID_101"]
    env = {"IDEM_C10_SINK_FILE": str(out_file), "IDEM_C10_FLAKY": ",".join(flaky)}
    args = ["--sink-fn", f"{HERE / 'c10_file_sink.py'}:append"]
    url, group = redis_server.url, "c10-file"

    for point in ("after_sink@1", "after_batch@3"):
        code, out = _idem_run(tmp_path, url, group, args, kill_at=point, env=env)
        assert code == -signal.SIGKILL, out[-3000:]

    code, out = _idem_run(tmp_path, url, group, args, env=env)
    assert code == 0, out[-3000:]
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    counts = Counter(line["key"] for line in lines)
    assert set(counts) == keys  # nothing lost
    idempotency: dict[str, set[str]] = defaultdict(set)
    for line in lines:
        idempotency[line["key"]].add(line["idempotency_key"])
    # Every repeat carries the same idempotency key as the first delivery ...
    assert all(ids == {f"{group}:{key}"} for key, ids in idempotency.items())
    repeats = sum(n - 1 for n in counts.values())
    report = _report(tmp_path)
    # ... and the report counts them (claims re-taken by replayed batches bound the repeats).
    assert repeats >= 1  # the crashes after the sink did make the file sink see rows again
    assert repeats <= report["possible_repeats"]
    assert report["pending_retries"] == 0
    assert report["replayed_batches"] >= 2
