"""A table's log read through the Spark driver's Hadoop filesystem (py4j).

The delta-spark engine reads ``_delta_log`` directly, as delta-rs' engine does,
to tell its version and what versions added without a Spark job. Whatever
filesystem Delta writes through (``s3a://``, ``abfss://``, HDFS) is reached
with the session's own Hadoop configuration and credentials; a table on the
driver's local filesystem is read with plain OS calls instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq

from idem.errors import LedgerError
from idem.ledger import _log

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_NOT_FOUND = "java.io.FileNotFoundException"


class HadoopLogStore:
    """A table root on a Hadoop filesystem (:class:`~idem.ledger._log.LogStore`)."""

    def __init__(self, spark: SparkSession, root: str) -> None:
        jvm = spark._jvm
        if jvm is None:
            raise LedgerError(
                "engine: delta-spark needs a classic Spark session with a JVM on the driver "
                "(not Spark Connect)"
            )
        self._jvm: Any = jvm
        conf = spark._jsparkSession.sessionState().newHadoopConf()
        self._root = self._jvm.org.apache.hadoop.fs.Path(root)
        self._fs = self._root.getFileSystem(conf)

    def _path(self, relative: str) -> Any:
        if "://" in relative:  # an absolute add path
            return self._jvm.org.apache.hadoop.fs.Path(relative)
        return self._jvm.org.apache.hadoop.fs.Path(self._root, unquote(relative))

    def exists(self, relative: str) -> bool:
        """Whether the file exists."""
        return bool(_hadoop_call(lambda: self._fs.exists(self._path(relative)), relative))

    def read_bytes(self, relative: str) -> bytes:
        """The whole file; ``FileNotFoundError`` when it is missing."""
        stream = _hadoop_call(lambda: self._fs.open(self._path(relative)), relative)
        try:
            return bytes(_hadoop_call(stream.readAllBytes, relative))
        finally:
            stream.close()

    def list_log(self) -> list[str]:
        """File names in ``_delta_log``."""
        try:
            statuses = _hadoop_call(
                lambda: self._fs.listStatus(self._path(_log.LOG_DIR)), _log.LOG_DIR
            )
        except FileNotFoundError:
            return []
        return [str(status.getPath().getName()) for status in statuses]

    def read_parquet(self, relative: str, columns: Sequence[str]) -> pa.Table:
        """Some columns of a data file, fetched whole to the driver then decoded."""
        return pq.read_table(pa.BufferReader(self.read_bytes(relative)), columns=list(columns))


def _hadoop_call(call: Any, relative: str) -> Any:
    """``call()``, with Hadoop's FileNotFoundException as ``FileNotFoundError`` and any other
    JVM failure as ``OSError``."""
    from py4j.protocol import Py4JJavaError  # noqa: PLC0415 -- py4j comes with pyspark

    try:
        return call()
    except Py4JJavaError as exc:
        if exc.java_exception.getClass().getName() == _NOT_FOUND:
            raise FileNotFoundError(relative) from None
        raise OSError(f"{relative}: {exc.java_exception}") from None


def open_spark_log_store(spark: SparkSession, path: str) -> tuple[str, _log.LogStore]:
    """The table location as Spark resolves it, and the store that reads its log.

    A plain path means the session's default filesystem, which is HDFS on some
    clusters: only a path Spark resolves to ``file:`` is read with OS calls.
    """
    store = HadoopLogStore(spark, path)
    qualified = store._fs.makeQualified(store._root)
    if str(qualified.toUri().getScheme()) == "file":
        local = str(qualified.toUri().getPath())
        return local, _log.LocalLogStore(local)
    return str(qualified.toString()), store
