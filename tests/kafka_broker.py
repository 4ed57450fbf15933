"""A real single-node Kafka broker (KRaft: broker and controller in one JVM) for the tests.

The jars come from the Maven cache (``tests/jvm_jars.py``, ``bash tests/jvm/fetch.sh``);
the broker listens on free 127.0.0.1 ports and keeps its log in a throw-away
directory. Topics are created with Kafka's own admin client and messages are
written through Spark's Kafka sink: both the connector's ``kafka-clients``, on the
test Spark session's classpath, so no client of another kind is involved.
"""

from __future__ import annotations

import base64
import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from jvm_jars import IN_CI

from idem.redis_server import free_port

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0

_LOG4J2 = """\
status = error
appender.console.type = Console
appender.console.name = STDERR
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = STDERR
"""


def require_java() -> str:
    """The ``java`` binary; fail under CI, skip elsewhere, when there is none."""
    java = shutil.which("java")
    if java is not None:
        return java
    message = "no java on PATH: the Kafka broker needs a JVM (apt-get install openjdk-17-jre)"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


class KafkaBroker:
    """One ``kafka.Kafka`` process: ``start()`` formats its log dir and waits until it serves."""

    def __init__(self, jars: Sequence[str], *, java: str | None = None) -> None:
        self.jars = list(jars)
        self.java = java or require_java()
        self.port = free_port()
        self.controller_port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="idem-kafka-"))
        self.log_path = self.directory / "broker.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        """``host:port`` of the PLAINTEXT listener."""
        return f"127.0.0.1:{self.port}"

    def _properties(self) -> Path:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},"
            f"CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(self.directory / "log"),
            "num.partitions": "3",
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": "1",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "log.segment.bytes": str(16 * 1024 * 1024),
        }
        path = self.directory / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in props.items()), encoding="utf-8")
        return path

    def _command(self, main: str, *args: str) -> list[str]:
        log4j = self.directory / "log4j2.properties"
        log4j.write_text(_LOG4J2, encoding="utf-8")
        return [
            self.java,
            "-Xmx512m",
            "-Xms128m",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            f"-Dlog4j2.configurationFile={log4j}",
            "-cp",
            ":".join(self.jars),
            main,
            *args,
        ]

    def start(self) -> None:
        """Format the log directory (a new cluster id) and run the broker until it serves."""
        props = self._properties()
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        formatted = subprocess.run(
            self._command("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)),
            capture_output=True,
            timeout=START_TIMEOUT_S,
            check=False,
        )
        if formatted.returncode != 0:
            raise RuntimeError(
                "kafka StorageTool format failed: "
                + (formatted.stderr or formatted.stdout).decode(errors="replace")[-2000:]
            )
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                self._command("kafka.Kafka", str(props)),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_serving()

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise RuntimeError(f"the Kafka broker exited at start-up: {self.log_tail()}")
            if _accepts(self.port):
                return
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(
            f"the Kafka broker did not start in {START_TIMEOUT_S:g} s: {self.log_tail()}"
        )

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the broker's log (for a failure message)."""
        if not self.log_path.is_file():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM (a controlled shutdown), then SIGKILL if it lingers; remove the directory."""
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self._process = None
        shutil.rmtree(self.directory, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the broker's process group."""
        process = self._process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def create_topic(spark: SparkSession, bootstrap: str, name: str, partitions: int = 3) -> None:
    """Create ``name`` with ``partitions`` partitions through Kafka's admin client (py4j)."""
    jvm = spark._jvm
    assert jvm is not None
    props = jvm.java.util.Properties()
    props.put("bootstrap.servers", bootstrap)
    props.put("request.timeout.ms", "20000")
    admin = jvm.org.apache.kafka.clients.admin.Admin.create(props)
    try:
        topic = jvm.org.apache.kafka.clients.admin.NewTopic(name, partitions, 1)
        topics = jvm.java.util.Collections.singletonList(topic)
        admin.createTopics(topics).all().get()
    finally:
        admin.close()


Record = tuple[str | None, str | None, int | None]
"""``(Kafka key, value, partition)`` of a record to write."""


def produce(spark: SparkSession, bootstrap: str, topic: str, records: Iterable[Record]) -> int:
    """Write ``(key, value, partition)`` records with Spark's Kafka sink (one batch write).

    A ``None`` partition lets the producer choose by key; ``None`` key or value is a null.
    Returns how many records were written.
    """
    rows = list(records)
    df = spark.createDataFrame(rows, "key string, value string, partition int")
    (
        df.write.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("topic", topic)
        .option("kafka.acks", "all")
        .save()
    )
    return len(rows)
