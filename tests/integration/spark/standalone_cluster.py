"""A real Spark standalone cluster on loopback: one master and one worker per host address.

Spark starts a speculative copy of a task only on a host where no attempt of that
task runs, so a test of speculation needs executors that report different hosts:
``local-cluster`` runs all of its executors on ``localhost``. Here each worker (and
the executors it launches) binds and names itself by its own loopback address
(``127.0.0.2``, ``127.0.0.3``, ...: Linux routes all of ``127.0.0.0/8`` to ``lo``),
with the master on ``127.0.0.1``. The master and workers are pyspark's own
(``bin/spark-class``); each runs in its own process group, so :meth:`stop` ends them
together with the executors and Python workers they started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from jvm_jars import IN_CI

from idem.redis_server import free_port

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0
WORKER_HOSTS = ("127.0.0.2", "127.0.0.3")


def spark_home() -> Path:
    """pyspark's installation, which carries ``bin/spark-class`` and Spark's jars."""
    import pyspark

    return Path(pyspark.__file__).parent


def require_cluster_parts(hosts: Sequence[str] = WORKER_HOSTS) -> None:
    """Fail under CI, skip elsewhere, when a standalone cluster cannot run here: no
    ``java``, no ``bin/spark-class`` in pyspark, or a worker address that cannot be bound."""
    problem = None
    if shutil.which("java") is None:
        problem = "no java on PATH: a Spark standalone cluster needs a JVM"
    elif not (spark_home() / "bin" / "spark-class").is_file():
        problem = f"pyspark at {spark_home()} has no bin/spark-class"
    else:
        for host in hosts:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind((host, 0))
            except OSError as exc:
                problem = f"cannot bind the loopback address {host} ({exc}): Linux binds all "
                "of 127.0.0.0/8; elsewhere add it as an alias of the loopback interface"
                break
    if problem is None:
        return
    if IN_CI:
        pytest.fail(problem, pytrace=False)
    pytest.skip(problem)


class StandaloneCluster:
    """A master on ``127.0.0.1`` and one single-core worker per address of ``hosts``."""

    def __init__(self, hosts: Sequence[str] = WORKER_HOSTS, *, worker_memory: str = "1g") -> None:
        self.hosts = tuple(hosts)
        self.worker_memory = worker_memory
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="idem-spark-standalone-"))
        self._processes: list[subprocess.Popen[bytes]] = []

    @property
    def master_url(self) -> str:
        """What ``SparkSession.builder.master`` takes."""
        return f"spark://127.0.0.1:{self.port}"

    def _start(self, name: str, main: str, address: str, *args: str) -> None:
        env = {
            **os.environ,
            "SPARK_HOME": str(spark_home()),
            "SPARK_LOCAL_IP": address,
            "SPARK_LOCAL_HOSTNAME": address,
            "SPARK_LOG_DIR": str(self.directory),
            "SPARK_CONF_DIR": str(self.directory / "conf"),
            # Short-lived daemons: a quick start matters more than peak speed.
            "SPARK_DAEMON_MEMORY": "256m",
            "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        }
        with (self.directory / f"{name}.log").open("ab") as log:
            self._processes.append(
                subprocess.Popen(
                    [str(spark_home() / "bin" / "spark-class"), main, "--host", address, *args],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def start(self) -> None:
        """Start the master and the workers; return once every worker has registered."""
        (self.directory / "conf").mkdir()
        self._start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "127.0.0.1",
            *("--port", str(self.port), "--webui-port", "0"),
        )
        # A worker that finds no master retries only after several seconds.
        self._wait_for("the master to listen", lambda: _accepts(self.port))
        for host in self.hosts:
            self._start(
                f"worker-{host}",
                "org.apache.spark.deploy.worker.Worker",
                host,
                *("--cores", "1", "--memory", self.worker_memory, "--webui-port", "0"),
                *("--work-dir", str(self.directory / f"work-{host}"), self.master_url),
            )
        master_log = self.directory / "master.log"

        def registered() -> bool:
            text = master_log.read_text(errors="replace") if master_log.is_file() else ""
            return all(f"Registering worker {host}:" in text for host in self.hosts)

        self._wait_for("the workers to register", registered)

    def _wait_for(self, what: str, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if any(process.poll() is not None for process in self._processes):
                tail = self.log_tail()
                self.stop()
                raise RuntimeError(f"a Spark standalone daemon exited: {tail}")
            if done():
                return
            time.sleep(0.2)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"waited {START_TIMEOUT_S:g} s for {what}: {tail}")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of each daemon's log (for a failure message)."""
        return "\n".join(
            f"== {log.name}\n{log.read_text(errors='replace')[-chars:]}"
            for log in sorted(self.directory.glob("*.log"))
        )

    def stop(self) -> None:
        """End every process the cluster started and remove its directory.

        SIGTERM, then SIGKILL, to each daemon's process group (a worker's group holds
        the executors it launched); then SIGKILL to any process still working in the
        cluster's directory: an executor's Python daemon and workers, which run in the
        executor's work directory but in their own process group.
        """
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for process in self._processes:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for process in self._processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for pid in self._working_here():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._processes.clear()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _working_here(self) -> list[int]:
        """The processes whose working directory is inside the cluster's directory."""
        found = []
        for entry in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if (entry / "cwd").readlink().is_relative_to(self.directory):
                    found.append(int(entry.name))
        return found


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def standalone_cluster(hosts: Sequence[str] = WORKER_HOSTS) -> Iterator[StandaloneCluster]:
    """A started :class:`StandaloneCluster`, stopped when the block ends, however it ends."""
    require_cluster_parts(hosts)
    cluster = StandaloneCluster(hosts)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
