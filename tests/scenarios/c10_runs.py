"""``idem run`` driven for C10: order files, one run killed as asked, its report.

Shared by the C10 tests of a Delta sink and of a function sink appending to a file.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from in_process import cli_main_with

from idem.spark.faults import KILL_AT_ENV
from idem.spark.session import FAST_START_JAVA_OPTIONS

SCHEMA = "order_id string, amount double"
GROUP_TIMEOUT_S = 240


def order_files(directory: Path, batches: int = 6, per_batch: int = 20) -> set[str]:
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


def run_args(
    *,
    source: Path,
    key: str,
    group: str,
    url: str,
    data_dir: Path,
    checkpoint: Path,
    schema: str,
    extra: list[str],
) -> list[str]:
    """``idem run``'s arguments in a test: a ladder of 1 s delays."""
    return [
        "run", "--source", str(source), "--key", key, "--group", group,
        "--redis-url", url, "--data-dir", str(data_dir),
        "--checkpoint", str(checkpoint), "--schema", schema,
        "--delay-levels", "1s 1s 1s", "--max-reconsume-times", "3",
        *extra,
    ]  # fmt: skip


def run_command(arguments: list[str]) -> list[str]:
    """The command line running ``idem`` with ``arguments`` (:func:`run_args`), its JVM
    quick to start."""
    return [
        sys.executable, "-m", "idem.cli", *arguments,
        "--spark-conf", f"spark.driver.extraJavaOptions={FAST_START_JAVA_OPTIONS}",
    ]  # fmt: skip


def start_run(
    command: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``command`` in a session of its own (its JVM with it), output to ``log``;
    ``env`` is its whole environment (``None``: this one)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def kill_run(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the run and everything of its session (the JVM is the driver's child)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _c10_args(tmp: Path, url: str, group: str, sink_args: list[str]) -> list[str]:
    return run_args(
        source=tmp / "in", key="order_id", group=group, url=url,
        data_dir=tmp / "data", checkpoint=tmp / "checkpoint", schema=SCHEMA,
        extra=[
            "--available-now", "--max-files-per-trigger", "1",
            "--report-json", str(tmp / "report.json"), *sink_args,
        ],
    )  # fmt: skip


def idem_run(
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
    command = run_command(_c10_args(tmp, url, group, sink_args))
    full_env = {**os.environ, **(env or {})}
    full_env.pop(KILL_AT_ENV, None)
    if kill_at:
        full_env[KILL_AT_ENV] = kill_at
    log = tmp / f"run-{time.monotonic_ns()}.log"
    proc = start_run(command, log, full_env)
    try:
        if kill_when is not None:
            deadline = time.monotonic() + GROUP_TIMEOUT_S
            while proc.poll() is None and not kill_when() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(random.Random(os.getpid()).uniform(0.0, 0.8))
            if proc.poll() is None:
                kill_run(proc)
        code = proc.wait(timeout=GROUP_TIMEOUT_S)
    finally:
        # The JVM is the driver's child: make sure nothing of this run survives it.
        kill_run(proc)
    return code, log.read_text(errors="replace")


def idem_run_here(
    tmp: Path, url: str, group: str, sink_args: list[str], *, env: dict[str, str] | None = None
) -> int:
    """The same run in this process, on its Spark session (the test's shared one, whose
    settings win): a restart on the checkpoint with no JVM of its own to start. Its exit
    code; ``env`` is set while it runs."""
    return cli_main_with(_c10_args(tmp, url, group, sink_args), env or {})


def delta_versions(path: Path) -> int:
    """How many commits the Delta table at ``path`` has (0: none yet)."""
    log = path / "_delta_log"
    return len(list(log.glob("*.json"))) if log.is_dir() else 0


def read_report(tmp: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads((tmp / "report.json").read_text())
    return report
