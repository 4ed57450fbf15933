"""The JVM jars the tests hand to Spark and to the Kafka broker, from the Maven cache.

``bash tests/jvm/fetch.sh`` (run by the README's test command) resolves them into
``${IDEM_JAR_CACHE:-~/.cache/idem/jars}``; nothing downloads while a test runs.
A missing cache fails loudly under CI (``CI=true``) and skips elsewhere, naming
the command that fills it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FETCH_COMMAND = "bash tests/jvm/fetch.sh"
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}

DELTA_EXTENSION = "io.delta.sql.DeltaSparkSessionExtension"
DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"


def jar_cache() -> Path:
    """Where the fetched jars live."""
    configured = os.environ.get("IDEM_JAR_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "idem" / "jars"


def _jars(kind: str, must_contain: str) -> list[str] | None:
    folder = jar_cache() / kind
    jars = sorted(str(p) for p in folder.glob("*.jar"))
    if not any(Path(j).name.startswith(must_contain) for j in jars):
        return None
    return jars


def require_jars(kind: str, must_contain: str) -> list[str]:
    """The jars of ``kind`` (``spark`` or ``kafka-broker``); fail in CI, skip elsewhere."""
    jars = _jars(kind, must_contain)
    if jars is not None:
        return jars
    message = f"no {must_contain} jar under {jar_cache() / kind}: run {FETCH_COMMAND}"
    if IN_CI:
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def spark_jars() -> list[str] | None:
    """Delta's Spark jars and Spark's Kafka connector, or ``None`` when not fetched."""
    return _jars("spark", "delta-spark_")


def delta_spark_conf(jars: list[str]) -> dict[str, str]:
    """Session settings that put ``jars`` on the classpath and turn Delta's SQL support on."""
    return {
        "spark.jars": ",".join(jars),
        "spark.sql.extensions": DELTA_EXTENSION,
        "spark.sql.catalog.spark_catalog": DELTA_CATALOG,
    }
