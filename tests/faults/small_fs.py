"""A small filesystem of its own for a test, and a filler that leaves it no free byte.

The filesystem is a tmpfs mounted by the test (as root, or through ``sudo -n``):
every write on it fails with ENOSPC once the filler has taken the space, exactly
as a full disk refuses the Delta tables and redis-server written there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from jvm_jars import IN_CI


def _run_as_root(args: list[str]) -> subprocess.CompletedProcess[str]:
    command = args if os.geteuid() == 0 else ["sudo", "-n", *args]
    if shutil.which(command[0]) is None:
        return subprocess.CompletedProcess(command, 127, "", f"{command[0]} not found")
    return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)


@contextlib.contextmanager
def small_filesystem(path: Path, size_mib: int) -> Iterator[Path]:
    """A tmpfs of ``size_mib`` MiB mounted at ``path``; unmounted (lazily if busy) on the way
    out, whatever happened. Fails under CI and skips elsewhere when mounting is not
    permitted."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size_mib}m,mode=0777,uid={os.getuid()},gid={os.getgid()}"
    done = _run_as_root(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)])
    if done.returncode != 0:
        message = f"cannot mount a tmpfs at {path} (root or passwordless sudo): {done.stderr}"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        yield path
    finally:
        if _run_as_root(["umount", str(path)]).returncode != 0:
            _run_as_root(["umount", "-l", str(path)])


class Filler:
    """A file that takes every free byte of a filesystem until :meth:`free`."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "filler"

    def fill(self) -> int:
        """Write until the filesystem refuses (ENOSPC); return the bytes taken."""
        chunk = b"\0" * (1 << 16)
        written = 0
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 16, 1 << 12, 1):
                while True:
                    try:
                        written += os.write(fd, chunk[:size])
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        """Give the space back."""
        self.path.unlink(missing_ok=True)


def free_bytes(path: Path) -> int:
    """Bytes still free on ``path``'s filesystem."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize
