"""idem.spark: PySpark glue (exactly-once foreachBatch, retry stream, Delta sinks, DLQ tools).

Needs PySpark 4.2: the ``spark`` extra, or the PySpark of the Spark runtime the job
runs on (idem does not install its own there).
"""

from idem.extras import install_hint

try:
    import pyspark  # noqa: F401 -- only to say what is missing, before the modules below
except ModuleNotFoundError as missing:
    if missing.name != "pyspark":
        raise
    raise ModuleNotFoundError(
        f"idem.spark needs PySpark 4.2: {install_hint('spark')}, or run on a Spark "
        "runtime that provides it",
        name="pyspark",
    ) from missing

from idem.spark.decorator import ExactlyOnce, exactly_once
from idem.spark.delta_sink import delta_sink
from idem.spark.outcome import BatchOutcome
from idem.spark.retry_source import retry_stream, with_retries
from idem.spark.rows import RowCodec
from idem.spark.session import local_session

# idem run's pipeline (idem.spark.run) is the command's own machinery, not part of this API.
__all__ = [
    "BatchOutcome",
    "ExactlyOnce",
    "RowCodec",
    "delta_sink",
    "exactly_once",
    "local_session",
    "retry_stream",
    "with_retries",
]
