"""Which Delta engine a Spark job's ledger uses, and what its session needs for it.

The delta-rs engine runs in the Python process and needs nothing of Spark. The
delta-spark engine writes through the Spark session: it needs Delta's jars on the
session's classpath and Delta's SQL extension on, both fixed when the session
starts. :func:`delta_session_conf` gives a new session both;
:func:`engine_for_session` says which engine a ledger opened on a session uses and
refuses, naming what is missing, a session that cannot run the one asked for.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from idem.config import LedgerEngine
from idem.errors import ConfigError
from idem.ledger.base import DELTA_SPARK_EXTENSION

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DELTA_CATALOG = "org.apache.spark.sql.delta.catalog.DeltaCatalog"
"""The ``spark_catalog`` implementation Delta's SQL support needs."""


def jar_paths(text: str, *, name: str = "--jars") -> list[str]:
    """The jar files ``text`` names: comma-separated jar files and directories, a directory
    standing for every ``*.jar`` in it. Each must exist: a typo would otherwise show
    only later, as a class Spark cannot find."""
    jars: list[str] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        path = Path(entry).expanduser()
        if path.is_dir():
            found = sorted(str(p) for p in path.glob("*.jar"))
            if not found:
                raise ConfigError(f"{name}: directory {entry} holds no .jar file")
            jars += found
        elif path.is_file():
            jars.append(str(path))
        else:
            raise ConfigError(f"{name}: {entry} is neither a jar file nor a directory")
    if not jars:
        raise ConfigError(f"{name}: no jar named in {text!r}")
    return jars


def delta_session_conf(jars: Sequence[str] = ()) -> dict[str, str]:
    """Settings of a new session for the delta-spark engine: ``jars`` on its classpath,
    Delta's SQL extension and catalog on."""
    conf = {
        "spark.sql.extensions": DELTA_SPARK_EXTENSION,
        "spark.sql.catalog.spark_catalog": DELTA_CATALOG,
    }
    if jars:
        conf["spark.jars"] = ",".join(jars)
    return conf


def session_conf_for(engine: LedgerEngine, jars: Sequence[str] = ()) -> dict[str, str]:
    """What a session started for ``engine`` is given: Delta's settings for delta-spark;
    otherwise only ``jars``, if any, on its classpath."""
    if engine is LedgerEngine.DELTA_SPARK:
        return delta_session_conf(jars)
    return {"spark.jars": ",".join(jars)} if jars else {}


def delta_spark_missing(spark: SparkSession) -> str | None:
    """What ``spark`` lacks to run the delta-spark engine, in words (``None``: nothing).

    It needs the ``delta-spark`` Python package, Delta's jars on the driver's classpath
    and ``spark.sql.extensions`` naming Delta's extension. Spark starts a session whose
    extension class cannot be found with only a warning, so the class is looked up here.
    """
    if importlib.util.find_spec("delta") is None:
        return "the delta-spark Python package (pip install 'idem[spark-delta]')"
    if not _class_loadable(spark, DELTA_SPARK_EXTENSION):
        return (
            f"Delta's jars on the Spark session's classpath ({DELTA_SPARK_EXTENSION} was "
            "not found): delta-spark_<spark>_2.13-<version>.jar and delta-storage-<version>.jar"
        )
    if not _extension_on(spark):
        found = spark.conf.get("spark.sql.extensions", "") or "unset"
        return (
            f"spark.sql.extensions to name {DELTA_SPARK_EXTENSION} (it is {found}); "
            "it is read when the session starts"
        )
    return None


def engine_for_session(
    engine: LedgerEngine, spark: SparkSession, *, hint: str = ""
) -> LedgerEngine:
    """The engine a ledger opened on ``spark`` with ``engine`` uses (``auto`` resolved).

    ``auto`` is delta-spark when the session has Delta's extension on and the
    ``delta-spark`` package is installed, else delta-rs. A session that cannot run
    delta-spark when it is asked for (or when ``auto`` picks it) is refused with a
    :class:`ConfigError` naming what is missing, ``hint`` appended.
    """
    if engine is LedgerEngine.DELTA_RS:
        return engine
    if engine is LedgerEngine.AUTO and not (
        _extension_on(spark) and importlib.util.find_spec("delta") is not None
    ):
        return LedgerEngine.DELTA_RS
    missing = delta_spark_missing(spark)
    if missing is not None:
        chosen = ""
        if engine is LedgerEngine.AUTO:
            chosen = " (auto picks it: the session names its extension)"
        raise ConfigError(f"engine: delta-spark{chosen} needs {missing}{hint}")
    return LedgerEngine.DELTA_SPARK


def _extension_on(spark: SparkSession) -> bool:
    return DELTA_SPARK_EXTENSION in (spark.conf.get("spark.sql.extensions", "") or "")


def _class_loadable(spark: SparkSession, name: str) -> bool:
    """Whether the driver's JVM finds class ``name`` where Spark looks for its plugins."""
    jvm = spark.sparkContext._jvm
    if jvm is None:  # a stopped context
        return False
    return bool(jvm.org.apache.spark.util.Utils.classIsLoadable(name))
