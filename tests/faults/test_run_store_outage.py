"""``idem run`` rides out a Redis outage: its redis-server SIGKILLed while batches run,
restarted on its AOF seconds later.

The batch the outage cut short fails the streaming query; ``idem run`` waits for Redis
to answer, starts the query again on its checkpoint in the same process, and ends
with every key in the Delta sink exactly once (exit 0), as a restart of the whole
process would.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from c10_runs import (
    GROUP_TIMEOUT_S,
    SCHEMA,
    delta_versions,
    kill_run,
    order_files,
    read_report,
    run_command,
    start_run,
)
from deltalake import DeltaTable

from idem.ledger import read_table
from idem.redis_server import RedisServer

pytestmark = pytest.mark.faults

OUTAGE_S = 4.0
"""How long redis-server stays down: longer than a client's quick reconnect attempts."""


def test_idem_run_started_again_on_its_checkpoint_after_a_redis_outage_writes_each_key_once(
    tmp_path: Path,
) -> None:
    keys = order_files(tmp_path / "in")
    sink = tmp_path / "sink"
    with RedisServer(directory=tmp_path / "redis", appendonly=True, appendfsync="always") as server:
        command = run_command(
            source=tmp_path / "in", key="order_id", group="outage", url=server.url,
            data_dir=tmp_path / "data", checkpoint=tmp_path / "checkpoint", schema=SCHEMA,
            extra=["--available-now", "--max-files-per-trigger", "1",
                   "--report-json", str(tmp_path / "report.json"), "--sink-delta", str(sink)],
        )  # fmt: skip
        log = tmp_path / "run.log"
        run = start_run(command, log)
        try:
            deadline = time.monotonic() + GROUP_TIMEOUT_S
            while delta_versions(sink) < 2:  # batches are running
                assert run.poll() is None, log.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "no batch was committed"
                time.sleep(0.05)
            server.kill()
            time.sleep(OUTAGE_S)
            server.restart()
            code = run.wait(timeout=GROUP_TIMEOUT_S)
        finally:
            kill_run(run)
    out = log.read_text(errors="replace")
    assert code == 0, out[-3000:]
    assert "Redis was away: the query starts again on its checkpoint" in out
    counts = Counter(read_table(DeltaTable(str(sink)), ["key"])["key"].to_pylist())
    assert set(counts) == keys  # nothing lost
    assert set(counts.values()) == {1}  # nothing twice
    report = read_report(tmp_path)
    assert report["sink"]["exactly_once"] is True
    assert report["pending_retries"] == 0
