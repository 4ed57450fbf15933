"""One append to a Delta table through delta-spark's transaction API, from Python.

The delta-spark engine's checked append needs what no DataFrame writer offers:
a transaction whose snapshot version is known before it writes, that every
other writer's commit since that snapshot makes fail (instead of Delta
retrying it past them), and that records the batch's ``(appId, version)``
like ``txnAppId``/``txnVersion`` do. :class:`AppendTxn` is that: Delta's
``OptimisticTransaction`` opened on the table, marked as having read the whole
table, its rows written by the executors (``writeFiles``), and committed with
a ``SetTransaction`` action as a ``WRITE`` in append mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

CONFLICTS = frozenset(
    {
        "ConcurrentWriteException",
        "ConcurrentAppendException",
        "ConcurrentDeleteReadException",
        "ConcurrentDeleteDeleteException",
        "ConcurrentTransactionException",
        "MetadataChangedException",
        "ProtocolChangedException",
    }
)
"""The simple names of the JVM exceptions a commit raises when another writer won."""


class AppendTxn:
    """A Delta transaction on the table at ``path``, opened on its latest snapshot.

    Nothing is written until :meth:`commit`; an instance that is never
    committed leaves no trace in the table.
    """

    def __init__(self, spark: SparkSession, path: str) -> None:
        jvm: Any = spark._jvm
        self._jvm = jvm
        delta = jvm.org.apache.spark.sql.delta
        self._delta = delta
        log = delta.DeltaLog.forTable(spark._jsparkSession, path)
        self._txn: Any = log.startTransaction()
        # Any data another writer commits after this snapshot conflicts with the commit.
        self._txn.readWholeTable()

    @property
    def read_version(self) -> int:
        """The table version the transaction started from."""
        return int(self._txn.readVersion())

    def committed_txn(self, app_id: str) -> int:
        """The highest ``txn_version`` committed for ``app_id`` in the snapshot (-1: none)."""
        return int(self._txn.txnVersion(app_id))

    def commit(
        self, rows: DataFrame, *, app_id: str, txn_version: int, now_ms: int, tag: str
    ) -> int:
        """Write ``rows`` as new files of the table (a Spark job) and commit them with
        ``(app_id, txn_version)`` and ``tag`` as the commit's ``userMetadata``; the
        version committed.

        Raises the JVM's conflict exception (see :func:`is_conflict`) when another
        writer committed since the snapshot: the files written stay unreferenced
        until a vacuum removes them.
        """
        jvm = self._jvm
        files = self._txn.writeFiles(rows._jdf)
        actions = jvm.java.util.ArrayList(jvm.scala.jdk.javaapi.CollectionConverters.asJava(files))
        stamp = jvm.scala.Some(jvm.java.lang.Long.valueOf(now_ms))
        actions.add(self._delta.actions.SetTransaction(app_id, txn_version, stamp))
        none = jvm.scala.Option.empty()
        append = jvm.org.apache.spark.sql.SaveMode.Append
        write = getattr(self._delta, "DeltaOperations$Write")
        operation = write(append, none, none, jvm.scala.Some(tag), none, none, none, none, none)
        seq = jvm.scala.jdk.javaapi.CollectionConverters.asScala(actions).toList()
        return int(self._txn.commit(seq, operation))


def is_conflict(exc: BaseException) -> bool:
    """Whether ``exc`` is one of Delta's commit conflicts: converted by delta-spark's
    Python package, converted by PySpark's handler of JVM errors (which keeps the
    original), or as Py4J raised it."""
    if type(exc).__name__ in CONFLICTS:
        return True
    java = getattr(exc, "java_exception", None) or getattr(exc, "_origin", None)
    if java is None:
        return False
    try:
        return str(java.getClass().getSimpleName()) in CONFLICTS
    except Exception:  # the gateway may be gone: not a conflict then
        return False
