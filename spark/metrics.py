"""Metrics of a Spark job: Spark's own query progress, and idem's Prometheus counts.

Spark's side: :func:`observe_messages` adds to a stream's progress
(``query.lastProgress["observedMetrics"]["idem"]``) how many rows each batch held and
how many of them came back from the retry stream, counted by Spark with the batch's
own job (no Python per row), so Spark's UI, its listeners and ``StreamingQueryProgress``
consumers see them.

idem's side: what happened to the rows (applied, duplicates by cause, busy, failed,
claim and commit time) is known only once ``@exactly_once`` has run the batch. The
decorator records each batch's :class:`~idem.spark.outcome.BatchOutcome` in the
group's totals with :meth:`idem.spark.stats.StatsStore.record`, and that one call
also counts it into :mod:`idem.metrics` (once per batch, a replay as a replay).
Retries and dead letters are counted by the retry engine that writes them.
:func:`serve_job_metrics` exposes the counts and the group's state on ``/metrics``.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

from idem.metrics import MetricsServer, StateCollector, serve
from idem.retry.engine import RetryEngine
from idem.retry.group_state import read_group
from idem.spark.messages import RECONSUME_TIMES_COLUMN

OBSERVATION = "idem"
"""The name of idem's observed metrics in a query's progress."""


def observe_messages(stream: DataFrame, name: str = OBSERVATION) -> DataFrame:
    """``stream`` with its batches' ``messages`` and ``retried_rows`` in the query progress.

    Put it on the stream that ``foreachBatch(@exactly_once ...)`` writes (after the union
    with the retry stream): each progress then carries
    ``observedMetrics[name] = {"messages": n, "retried_rows": r}``.
    """
    counts = [F.count(F.lit(1)).alias("messages")]
    if RECONSUME_TIMES_COLUMN in stream.columns:
        retried = F.col(RECONSUME_TIMES_COLUMN) > 0
        counts.append(F.count(F.when(retried, F.lit(1))).alias("retried_rows"))
    return stream.observe(name, *counts)


def serve_job_metrics(engine: RetryEngine, *, host: str, port: int) -> MetricsServer:
    """Serve the process's idem metrics and ``engine``'s group state on ``host:port``."""
    state = StateCollector(engine.group, lambda: read_group(engine).gauges())
    return serve(port, host=host, collectors=[state])
