"""A local Spark session with defaults that suit one machine and idem's tests.

Spark's own defaults are tuned for clusters: 200 shuffle partitions (a stateful
dedup ran 13x slower with them here), a web UI on a public port and a console
progress bar. ``local_session`` sets what a single machine needs and makes sure
Spark's Python workers run the interpreter that runs us (``PYSPARK_PYTHON``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession

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
}
"""Settings applied by :func:`local_session` unless the caller overrides them."""

FAST_START_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""JVM options for short jobs (demo, tests): ~30 % faster start, slower steady state."""


def use_this_python() -> None:
    """Point Spark's Python workers at the running interpreter; keep Spark on loopback."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Bind to loopback without Spark warning that the hostname resolves to it.
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def local_session(
    app_name: str = "idem",
    *,
    master: str = "local[2]",
    conf: Mapping[str, str] | None = None,
    log_level: str = "ERROR",
    fast_start: bool = False,
) -> SparkSession:
    """Get (or create) a local Spark session with :data:`LOCAL_DEFAULTS` applied.

    ``fast_start`` trades the JIT's peak speed for a quicker start
    (:data:`FAST_START_JAVA_OPTIONS`): right for a demo or a test, not for a
    long-running job. An existing active session is returned as it is: Spark
    allows one per process, and the caller that made it chose its settings.
    """
    use_this_python()
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    builder = SparkSession.builder.master(master).appName(app_name)
    settings = dict(LOCAL_DEFAULTS)
    if fast_start:
        settings["spark.driver.extraJavaOptions"] = FAST_START_JAVA_OPTIONS
    settings.update(conf or {})
    for name, value in settings.items():
        builder = builder.config(name, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(log_level)
    return spark
