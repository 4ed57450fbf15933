"""CPU seconds of processes, from Linux ``/proc`` (the benchmarks' cost accounting)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (the state first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pids: Sequence[int | None]) -> float | None:
    """User + system CPU seconds the processes used so far (``None``: one is unknown)."""
    total = 0.0
    for pid in pids:
        if pid is None:
            return None
        try:
            fields = stat_fields(pid)
        except (OSError, IndexError):
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total
