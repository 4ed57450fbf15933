"""A local Spark session with defaults that suit one machine and idem's tests.

Spark's own defaults are tuned for clusters: 200 shuffle partitions (a stateful
dedup ran 13x slower with them here), a web UI on a public port and a console
progress bar. ``local_session`` sets what a single machine needs and makes sure
Spark's Python workers run the interpreter that runs us (``PYSPARK_PYTHON``).

When someone else chose the master — ``spark-submit --master ...`` started
this Python, ``PYSPARK_SUBMIT_ARGS`` names one, or a SparkContext is already
running — the session is taken as configured: none of the single-machine
defaults (master, loopback driver, 2 shuffle partitions, no UI) are forced on
a cluster job; only :data:`SUBMITTED_DEFAULTS` fill settings left unset.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from pyspark import SparkContext
from pyspark.sql import SparkSession

from idem.errors import ConfigError

LOCAL_DEFAULTS: Mapping[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.streaming.stopGracefullyOnShutdown": "false",
    "spark.sql.adaptive.enabled": "false",
    # Delta rebuilds a table's state in this many partitions (50 by default): on one
    # machine each is a task, and a small MERGE spent most of its time there.
    "spark.databricks.delta.snapshotPartitions": "2",
}
"""Settings applied by :func:`local_session` unless the caller overrides them."""

SUBMITTED_DEFAULTS: Mapping[str, str] = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.execution.arrow.pyspark.enabled": "true",
}
"""What idem wants of a session whose master was chosen elsewhere, where the submitter
left the setting unset (none of them depends on the cluster's size)."""

FAST_START_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""JVM options for short jobs (demo, tests): ~30 % faster start, slower steady state."""


def use_this_python() -> None:
    """Point Spark's Python workers at the running interpreter; keep Spark on loopback."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Bind to loopback without Spark warning that the hostname resolves to it.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def master_configured() -> bool:
    """Whether the master was chosen before us: a running SparkContext, a driver started by
    ``spark-submit`` (it hands Python its gateway port), or ``--master`` in
    ``PYSPARK_SUBMIT_ARGS``."""
    if SparkContext._active_spark_context is not None:
        return True
    if "PYSPARK_GATEWAY_PORT" in os.environ:
        return True
    args = os.environ.get("PYSPARK_SUBMIT_ARGS", "").split()
    return any(a == "--master" or a.startswith("--master=") for a in args)


def local_session(
    app_name: str = "idem",
    *,
    master: str | None = None,
    conf: Mapping[str, str] | None = None,
    log_level: str = "ERROR",
    fast_start: bool = False,
) -> SparkSession:
    """Get (or create) a Spark session; a local one with :data:`LOCAL_DEFAULTS` by default.

    ``master=None`` means ``local[2]`` unless :func:`master_configured`: then the
    session spark-submit (or the running context) configured is used as it is,
    with ``conf`` on top and :data:`SUBMITTED_DEFAULTS` only where unset.
    ``fast_start`` trades the JIT's peak speed for a quicker start
    (:data:`FAST_START_JAVA_OPTIONS`): right for a demo or a test, not for a
    long-running job (ignored when the JVM already runs). An existing active
    session is returned as it is: Spark allows one per process, and the caller
    that made it chose its settings.
    """
    use_this_python()
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    if master is None and master_configured():
        return _submitted_session(conf or {}, log_level)
    _check_java()
    builder = SparkSession.builder.master(master or "local[2]").appName(app_name)
    settings = dict(LOCAL_DEFAULTS)
    if fast_start:
        settings["spark.driver.extraJavaOptions"] = FAST_START_JAVA_OPTIONS
    settings.update(conf or {})
    for name, value in settings.items():
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    return spark


def _check_java() -> None:
    """Say plainly that PySpark needs a JVM, instead of its own error from deep inside."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return
    if shutil.which("java") is None:
        raise ConfigError(
            "java: PySpark needs Java 17 or later and none was found (no java on PATH, "
            "JAVA_HOME unset); install one, e.g. apt-get install openjdk-17-jre-headless"
        )


def _submitted_session(conf: Mapping[str, str], log_level: str) -> SparkSession:
    builder = SparkSession.builder
    for name, value in conf.items():
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    configured = spark.sparkContext.getConf()
    for name, value in SUBMITTED_DEFAULTS.items():
        if name not in conf and not configured.contains(name):
            spark.conf.set(name, value)
    spark.sparkContext.setLogLevel(log_level)
    return spark
