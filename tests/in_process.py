"""``idem`` commands run in the test's own process, on its Spark session.

A restart of ``idem run`` on its checkpoint does not need a process of its own: run
here, it takes the session the test already has (whose settings win over the
command's ``--spark-conf``) instead of starting a JVM and a Spark session again.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from idem.cli import main as cli_main
from idem.spark.faults import KILL_AT_ENV


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set in this process, and no crash point, while the block runs."""
    saved = {name: os.environ.get(name) for name in (*env, KILL_AT_ENV)}
    os.environ.pop(KILL_AT_ENV, None)
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def cli_main_with(argv: list[str], env: dict[str, str]) -> int:
    """``idem argv`` in this process with ``env`` set: its exit code."""
    with environment(env):
        return cli_main(argv)
