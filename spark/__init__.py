"""idem.spark: PySpark glue (exactly-once foreachBatch, retry stream, Delta sinks, DLQ tools)."""

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
