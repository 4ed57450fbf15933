"""C10: Spark replays a micro-batch after a driver crash; a function sink.

``idem run --sink-fn`` appends each row to a file and is killed with SIGKILL after
the sink and after the batch (before Spark's commit log), then started again on the
same checkpoint. At the end every key is in the file at least once, every repeat
carries the same idempotency key as the first delivery, and the report counts them.
"""

from __future__ import annotations

import json
import signal
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from c10_runs import idem_run, idem_run_here, order_files, read_report
from pyspark.sql import SparkSession

from idem.redis_server import RedisServer

pytestmark = [pytest.mark.scenarios, pytest.mark.spark]

HERE = Path(__file__).parent


def test_c10_file_sink_repeats_only_with_the_same_idempotency_key_and_counts_them(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    redis_server.client().flushall()
    keys = order_files(tmp_path / "in")
    out_file = tmp_path / "sink.jsonl"
    out_file.touch()
    flaky = ["ORDERID_5", "ORDERID_47", "ORDERID_101"]
    env = {"IDEM_C10_SINK_FILE": str(out_file), "IDEM_C10_FLAKY": ",".join(flaky)}
    # One engine for every start (in the test's process, auto would pick delta-spark).
    args = ["--sink-fn", f"{HERE / 'c10_file_sink.py'}:append", "--engine", "delta-rs"]
    url, group = redis_server.url, "c10-file"

    for point in ("after_sink@1", "after_batch@3"):
        code, out = idem_run(tmp_path, url, group, args, kill_at=point, env=env)
        assert code == -signal.SIGKILL, out[-3000:]

    # The last start finishes the job in this process, on the test's Spark session.
    assert idem_run_here(tmp_path, url, group, args, env=env) == 0
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    counts = Counter(line["key"] for line in lines)
    assert set(counts) == keys  # nothing lost
    idempotency: dict[str, set[str]] = defaultdict(set)
    for line in lines:
        idempotency[line["key"]].add(line["idempotency_key"])
    # Every repeat carries the same idempotency key as the first delivery ...
    assert all(ids == {f"{group}:{key}"} for key, ids in idempotency.items())
    repeats = sum(n - 1 for n in counts.values())
    report = read_report(tmp_path)
    # ... and the report counts them (claims re-taken by replayed batches bound the repeats).
    assert repeats >= 1  # the crashes after the sink did make the file sink see rows again
    assert repeats <= report["possible_repeats"]
    assert report["pending_retries"] == 0
    assert report["replayed_batches"] >= 2
