"""Which Delta engine a Spark job's ledger uses, and what a session started for it gets.

The delta-rs engine runs in the Python process and needs nothing of Spark. The
delta-spark engine writes through the Spark session: it needs Delta's jars on the
session's classpath and Delta's SQL extension and catalog on, all fixed when the
session starts. :func:`session_conf_for` is what idem gives a session it starts;
:func:`engine_for_session` says which engine a ledger opened on a session uses,
and refuses a session that cannot run the one asked for, naming what it lacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from idem.config import LedgerEngine
from idem.errors import ConfigError
from idem.ledger.base import DELTA_SPARK_CATALOG, DELTA_SPARK_EXTENSION, delta_spark_missing

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


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


def session_conf_for(engine: LedgerEngine, jars: Sequence[str] = ()) -> dict[str, str]:
    """Settings of a session started for ``engine``: ``jars`` on its classpath, and for
    delta-spark Delta's SQL extension and catalog on."""
    conf = {"spark.jars": ",".join(jars)} if jars else {}
    if engine is LedgerEngine.DELTA_SPARK:
        conf["spark.sql.extensions"] = DELTA_SPARK_EXTENSION
        conf["spark.sql.catalog.spark_catalog"] = DELTA_SPARK_CATALOG
    return conf


def engine_for_session(engine: LedgerEngine, spark: SparkSession) -> LedgerEngine:
    """The engine a ledger opened on ``spark`` with ``engine`` uses (``auto`` resolved:
    delta-spark on a session that can run it, else delta-rs).

    Called before a job starts: a session that cannot run delta-spark when it is asked
    for is a :class:`ConfigError` naming what the session lacks (Spark starts a session
    whose extension class is missing with a warning only, and the job would fail in its
    first batch).
    """
    if engine is LedgerEngine.DELTA_RS:
        return engine
    missing = delta_spark_missing(spark)
    if missing is None:
        return LedgerEngine.DELTA_SPARK
    if engine is LedgerEngine.AUTO:
        return LedgerEngine.DELTA_RS
    raise ConfigError(f"engine: delta-spark cannot run on this Spark session: {missing}")
