"""idem.spark: PySpark glue (exactly-once foreachBatch, retry stream, Delta sinks, DLQ tools).

Needs PySpark 4.2: the ``spark`` extra, or the PySpark of the Spark runtime the job
runs on (idem does not install its own there).
"""

import importlib.util

from idem.extras import install_hint

if importlib.util.find_spec("pyspark") is None:
    raise ModuleNotFoundError(
        f"idem.spark needs PySpark 4.2: {install_hint('spark')}, or run on a Spark "
        "runtime that provides it",
        name="pyspark",
    )

from idem.spark.decorator import ExactlyOnce, exactly_once
from idem.spark.delta_sink import delta_sink
from idem.spark.outcome import BatchOutcome
from idem.spark.retry_source import retry_stream, with_retries
from idem.spark.rows import RowCodec
from idem.spark.run import Pipeline, RunReport, RunSpec
from idem.spark.session import local_session

__all__ = [
    "BatchOutcome",
    "ExactlyOnce",
    "Pipeline",
    "RowCodec",
    "RunReport",
    "RunSpec",
    "delta_sink",
    "exactly_once",
    "local_session",
    "retry_stream",
    "with_retries",
]
