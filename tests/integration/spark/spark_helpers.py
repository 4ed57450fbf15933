"""Helpers shared by the Spark tests: order files, sink tables, DLQ rows, job processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from deltalake import DeltaTable

from idem.config import IdemConfig
from idem.ledger import read_table
from idem.retry.dlq import DeadLetter, DeadLetterTable
from idem.spark.run import RunSpec


def order(n: int | str, **extra: Any) -> dict[str, Any]:
    """One order row keyed ``order_id``."""
    key = n if isinstance(n, str) else f"ORDERID_{n}"
    return {"order_id": key, "amount": 10.0 + (hash(key) % 50), **extra}


def write_files(directory: Path, batches: Iterable[Iterable[Mapping[str, Any]]]) -> list[Path]:
    """One JSON-lines file per batch, named so they sort in order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    start = len(list(directory.glob("*.json")))
    for i, rows in enumerate(batches, start=start):
        path = directory / f"part-{i:04d}.json"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        paths.append(path)
    return paths


def sink_key_counts(path: str | Path) -> Counter[str]:
    """How often each key is in a Delta sink table."""
    keys = read_table(DeltaTable(str(path)), ["key"]).column("key").to_pylist()
    return Counter(str(k) for k in keys)


def sink_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a Delta sink table."""
    rows: list[dict[str, Any]] = read_table(DeltaTable(str(path))).to_pylist()
    return rows


def engines_of(path: str | Path) -> set[str]:
    """Which Delta engines wrote the table's commits (from each commit's ``engineInfo``):
    ``delta-rs`` or ``delta-spark``."""
    found = set()
    for commit in sorted((Path(path) / "_delta_log").glob("*.json")):
        for line in commit.read_text(encoding="utf-8").splitlines():
            info = json.loads(line).get("commitInfo")
            if info is not None:
                engine = str(info.get("engineInfo") or info.get("clientVersion") or "")
                found.add("delta-spark" if "Delta-Lake/" in engine else "delta-rs")
    return found


def dead_letters(config: IdemConfig) -> list[DeadLetter]:
    """The group's ``%DLQ%<group>`` rows."""
    return DeadLetterTable(config.resolved_dlq_path, config.group).list()


def config_for(tmp_path: Path, url: str, group: str, **extra: Any) -> IdemConfig:
    """A test config: short delay levels, few retries, tables under ``tmp_path``, the
    delta-rs engine unless ``engine=`` says otherwise."""
    settings: dict[str, Any] = {
        "engine": "delta-rs",
        "delay_levels": "1s 1s 1s",
        "max_reconsume_times": 2,
        "buckets": 4,
        **extra,
    }
    return IdemConfig(group=group, redis_url=url, data_dir=str(tmp_path / "idem-data"), **settings)


def delta_run(tmp_path: Path, source: str | Path | None = None, **extra: Any) -> RunSpec:
    """``idem run --available-now`` of ``source`` (default ``tmp_path/in``) keyed on
    ``order_id`` into the Delta sink ``tmp_path/sink``, checkpoint ``tmp_path/checkpoint``."""
    return RunSpec(
        source=str(source if source is not None else tmp_path / "in"),
        key="order_id",
        sink_delta=str(tmp_path / "sink"),
        checkpoint=str(tmp_path / "checkpoint"),
        available_now=True,
        **extra,
    )


def run_job(script: Path, *args: str, timeout: float) -> list[dict[str, Any]]:
    """Run the Spark job ``script`` in a process of its own (its own session and driver
    settings), Spark's Python workers on this interpreter; the JSON lines it printed.
    Fails the test with the end of its stderr when it does not exit 0."""
    python = sys.executable
    env = {**os.environ, "PYSPARK_PYTHON": python, "PYSPARK_DRIVER_PYTHON": python}
    done = subprocess.run(
        [python, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
