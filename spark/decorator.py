"""``@exactly_once``: a ``foreachBatch`` sink that sees every business key once.

::

    @exactly_once(group="orders", key="order_id", config=config)
    def write(fresh: DataFrame, batch_id: int) -> list[str] | None:
        ...  # only rows whose key was never completed; return the keys that failed

    stream.writeStream.foreachBatch(write).start()

Per micro-batch the rows stay on the executors (:mod:`idem.spark.micro_batch`):
the batch is repartitioned by Redis bucket and each task checks its keys, keeps
the first row of each key, claims the keys in Redis under an owner token made of
the query id and the batch id (a Spark replay of the batch, a retried or a
speculative task re-takes its own claims) and tags every row with its verdict,
kept by Spark. Bad keys, and rows whose values could not be read
(``_idem_malformed``: a retry body that no longer fits the schema, a source line
that is not JSON), go to ``%DLQ%<group>`` with their reason. The function gets
the claimed rows as a DataFrame; the rows it accepted are committed (ledger, then
Redis); the rows it rejected — returned keys, a DataFrame of rows, a
``{key: error}`` mapping, or every claimed row when it raised — are released and
sent back on RocketMQ's delay ladder, and after ``max_reconsume_times`` they are
dead-lettered. Only those rows, and counts, come to the driver.

With ``sink_table=PATH`` the Delta table at PATH is the group's ledger and
the accepted rows are written into it in the same commit as the record that
their keys are done: there is no moment between the two for a crash to fall into.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pyspark.sql import Column, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from pyspark.sql import types as st

from idem.clock import SYSTEM_CLOCK, Clock
from idem.config import IdemConfig, LedgerEngine
from idem.dedup import Dedup
from idem.errors import ConfigError
from idem.ledger import open_ledger
from idem.ledger.schema import LEDGER_SCHEMA
from idem.redis_client import connect
from idem.redis_cluster import RedisClient
from idem.retry.engine import RetryEngine
from idem.spark.faults import CrashPlan, KillAt, TaskFault
from idem.spark.ledger_engine import engine_for_session
from idem.spark.messages import (
    BOOKKEEPING_COLUMNS,
    DEFAULT_TOPIC,
    MESSAGE_COLUMN,
    RECONSUME_TIMES_COLUMN,
)
from idem.spark.micro_batch import BatchSetup, MicroBatch
from idem.spark.outcome import BatchOutcome
from idem.spark.row_meta import GIVEN_ID_COLUMN, KEY_HASH_COLUMN
from idem.spark.rows import RowCodec
from idem.spark.sink_result import SinkFunction, quoted
from idem.spark.stats import StatsStore
from idem.spark.verdicts import HASH_COLUMN, safe_names
from idem.spark.window_load import executor_window_load

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from idem.retry.engine import RetryEngine

log = logging.getLogger(__name__)

QUERY_ID_PROPERTY = "sql.streaming.queryId"
"""Spark's local property carrying the streaming query id (stable across restarts)."""

FINGERPRINT_COLUMN = HASH_COLUMN
"""Column the decorator adds: the payload's 64-bit hash."""


class ExactlyOnce:
    """What ``foreachBatch`` calls; built by :func:`exactly_once` or :func:`delta_sink`."""

    def __init__(
        self,
        fn: SinkFunction | None,
        *,
        config: IdemConfig,
        key: str,
        client: RedisClient | None = None,
        sink_table: str | None = None,
        topic: str = DEFAULT_TOPIC,
        idempotency_column: str | None = None,
        fingerprint: bool = True,
        msg_id: str | None = None,
        query_id: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
        crash_plan: CrashPlan | None = None,
        task_fault: TaskFault | None = None,
        leases: bool | None = None,
    ) -> None:
        if not isinstance(key, str) or not key:
            raise ConfigError(f"key: expected the name of the key column, got {key!r}")
        if sink_table is not None:
            config = config.with_changes(ledger_path=sink_table)
        self.fn = fn
        self.config = config
        self.key = key
        self.sink_table = sink_table
        self.topic = topic
        self.idempotency_column = idempotency_column
        self.fingerprint = fingerprint
        self.msg_id = msg_id
        self.query_id = query_id
        self.clock = clock
        self.crash_plan = crash_plan
        """An in-process failure to stage at a crash point (the demo's replay)."""
        self.kill_at = KillAt.from_env()
        """The crash points ``IDEM_SPARK_KILL_AT`` asks for (read once, here)."""
        self.task_fault = task_fault
        """A fault to stage in the executors' claim tasks (tests)."""
        self.leases = (fn is not None or sink_table is None) if leases is None else leases
        """Whether claims take leases in Redis. By default only the Delta sink with no
        function of the user's to run takes none: its rows are the ledger commit, which is
        checked against every version since the claim. Pass ``leases=True`` when a
        function sink or a consumer shares the group (see :meth:`idem.dedup.Dedup.begin`)."""
        self._client = client
        self._dedup: Dedup | None = None
        self._retry: RetryEngine | None = None
        self._stats: StatsStore | None = None
        self.last_outcome: BatchOutcome | None = None
        if fn is not None:
            # Name and docs only: a sink object's own attributes (its ``key``, ``config``...)
            # must not replace the decorator's.
            functools.update_wrapper(self, fn, updated=())

    # -- lazily built collaborators (the driver builds them on the first batch) -------------

    @property
    def client(self) -> RedisClient:
        """The Redis client (built from ``config.redis_url`` unless one was passed)."""
        if self._client is None:
            self._client = connect(self.config.redis_url)
        return self._client

    @property
    def dedup(self) -> Dedup:
        """The group's dedup protocol object."""
        if self._dedup is None:
            config = self._ledger_config()
            ledger = open_ledger(config)
            self._dedup = Dedup(
                config,
                client=self.client,
                clock=self.clock,
                ledger=ledger,
                load_window=executor_window_load(ledger, config, self.clock),
            )
            self._dedup.check()
        return self._dedup

    def _ledger_config(self) -> IdemConfig:
        """The config with ``auto`` resolved on the active Spark session: delta-spark where
        the session runs it, else delta-rs (see ``idem.spark.ledger_engine``)."""
        if self.config.engine is not LedgerEngine.AUTO:
            return self.config
        session = SparkSession.getActiveSession()
        if session is None:
            return self.config.with_changes(engine=LedgerEngine.DELTA_RS)
        return self.config.with_changes(engine=engine_for_session(LedgerEngine.AUTO, session))

    def close(self) -> None:
        """Finish the last batch's background Redis index update (call when the query ends).

        Skipping it is safe: the next claim would load that commit from the ledger.
        """
        if self._dedup is not None:
            self._dedup.close()

    @property
    def retry(self) -> RetryEngine:
        """The group's retry engine (send-back, schedule, DLQ)."""
        if self._retry is None:
            self._retry = RetryEngine(self.config, client=self.client, clock=self.clock)
        return self._retry

    @property
    def stats(self) -> StatsStore:
        """The group's batch counters."""
        if self._stats is None:
            self._stats = StatsStore(
                self.client, self.config.group, marker_ttl_ms=self.config.dedup_window_ms
            )
        return self._stats

    # -- foreachBatch ------------------------------------------------------------------------

    def __call__(self, batch_df: DataFrame, batch_id: int) -> None:
        """Process one micro-batch (Spark calls this on the driver)."""
        self.process(batch_df, batch_id)

    def process(self, batch_df: DataFrame, batch_id: int) -> BatchOutcome:
        """Process one micro-batch and return what happened to its rows."""
        query_id = self._query_id(batch_df)
        attempt = self.stats.begin(query_id, batch_id)
        if attempt > 1:
            log.info("batch %d: attempt %d (Spark replays it after a failure)", batch_id, attempt)
        schema = batch_df.schema  # one round trip to the JVM for names and types
        columns = schema.fieldNames()
        if self.key not in columns:
            raise ConfigError(
                f"key: the batch has no column {self.key!r} (columns: {', '.join(columns)})"
            )
        if self.msg_id is not None and self.msg_id not in columns:
            raise ConfigError(f"msg_id: the batch has no column {self.msg_id!r}")
        if self.fn is not None and self.idempotency_column in columns:
            raise ConfigError(
                f"idempotency_column: the rows already have a column {self.idempotency_column!r}"
                " (the sink would get two); name another one (idem run: --idempotency-column)"
            )
        if RECONSUME_TIMES_COLUMN in columns and MESSAGE_COLUMN not in columns:
            # idem's bookkeeping columns never reach a sink: a column of the user's by that
            # name would vanish without a word (the retry stream adds both of them)
            raise ConfigError(
                f"{RECONSUME_TIMES_COLUMN}: the batch has this column but not "
                f"{MESSAGE_COLUMN}; the pair is the retry stream's bookkeeping. Rename a "
                "column of your own, or keep both columns of the retry stream"
            )
        payload = st.StructType([f for f in schema.fields if f.name not in BOOKKEEPING_COLUMNS])
        payload_columns = payload.fieldNames()
        # A clash of a column with the ledger's fails the batch before any claim.
        sink_columns = tuple(self._sink_columns(payload_columns)) if self.sink_table else ()
        codec = RowCodec(payload)
        # Spark only hashes (xxhash64 on the JVM); the text forms are made in Arrow
        # (ids.py). One SQL projection: one py4j call, however many columns.
        added: dict[str, str] = {}  # column name -> its SQL
        if self.fingerprint:
            added[FINGERPRINT_COLUMN] = fingerprint_sql(payload)
        if self.msg_id is not None:
            added[GIVEN_ID_COLUMN] = f"CAST({quoted(self.msg_id)} AS STRING)"
        elif self.fingerprint:
            # A redelivered copy of a row (same key, same payload) is the same message.
            added[KEY_HASH_COLUMN] = f"xxhash64(CAST({quoted(self.key)} AS STRING))"
        clash = [name for name in added if name in columns]
        if clash:
            # A second column of that name makes the batch's Arrow table ambiguous: every
            # batch failed on it with pyarrow's KeyError, before any claim.
            raise ConfigError(
                f"{clash[0]}: the batch has a column of this name, which idem adds to the "
                "rows for its hashes; rename it (names starting with _idem_ are idem's)"
            )
        prepared, renamed = safe_names(
            batch_df.selectExpr("*", *(f"{sql} AS {name}" for name, sql in added.items()))
        )
        setup = BatchSetup(
            key=self.key,
            fn=self.fn,
            payload_columns=tuple(payload_columns),
            sink_columns=sink_columns,
            topic=self.topic,
            idempotency_column=self.idempotency_column,
            fingerprints=self.fingerprint,
            hold=self.leases,
            dedup=self.dedup,
            retry=self.retry,
            stats=self.stats,
            clock=self.clock,
            codec=codec,
            observers=tuple(o for o in (self.crash_plan, self.kill_at) if o is not None),
            task_fault=self.task_fault,
            renamed=renamed,
        )
        batch = MicroBatch(setup, prepared, batch_id=batch_id, query_id=query_id, attempt=attempt)
        outcome = batch.run()
        _log_outcome(outcome)
        self.last_outcome = outcome
        return outcome

    def _query_id(self, batch_df: DataFrame) -> str:
        if self.query_id is not None:
            return self.query_id
        prop = batch_df.sparkSession.sparkContext.getLocalProperty(QUERY_ID_PROPERTY)
        return str(prop) if prop else "static"

    def _sink_columns(self, payload_columns: Sequence[str]) -> list[str]:
        """The user's columns that go into the sink table next to the ledger's (a key
        column named ``key`` is the ledger's own)."""
        taken = [c for c in payload_columns if c != "key" or self.key != "key"]
        ledger = {name.lower() for name in LEDGER_SCHEMA.names}
        clash = [c for c in taken if c.lower() in ledger]  # Delta names ignore case
        if clash:
            raise ConfigError(
                f"sink_table: column(s) {', '.join(clash)} of the rows clash with the ledger "
                f"columns of the sink table ({', '.join(LEDGER_SCHEMA.names)}, in any case); "
                "rename them before the sink"
            )
        return taken


def fingerprint_hash(schema: st.StructType) -> Column:
    """A payload hash per row, computed by Spark: xxhash64 of the values and null flags.

    Spark's hash skips nulls, so the null flags keep ``(null, 1)`` and ``(1, null)``
    apart; map columns (which Spark cannot hash) are hashed as their JSON. The
    fingerprint is its text form (:func:`idem.spark.ids.spark_hex`).
    """
    return F.expr(fingerprint_sql(schema))


def fingerprint_sql(schema: st.StructType) -> str:
    """:func:`fingerprint_hash` as a Spark SQL expression."""
    values = [
        f"to_json({quoted(f.name)})" if _has_map(f.dataType) else quoted(f.name)
        for f in schema.fields
    ]
    flags = [f"isnull({quoted(f.name)})" for f in schema.fields]
    return f"xxhash64({', '.join([*values, *flags])})"


def _has_map(kind: st.DataType) -> bool:
    if isinstance(kind, st.MapType):
        return True
    if isinstance(kind, st.ArrayType):
        return _has_map(kind.elementType)
    if isinstance(kind, st.StructType):
        return any(_has_map(f.dataType) for f in kind.fields)
    return False


def _log_outcome(outcome: BatchOutcome) -> None:
    log.info(
        "batch %d: %d rows, %d applied, %d duplicate, %d failed, %d dead, %d busy",
        outcome.batch_id,
        outcome.messages,
        outcome.applied,
        sum(outcome.duplicates.values()),
        outcome.failed,
        outcome.dead,
        outcome.busy,
    )
    log.debug(
        "batch %d timings: %s",
        outcome.batch_id,
        ", ".join(f"{step} {seconds:.3f}s" for step, seconds in outcome.timings.items()),
    )


def exactly_once(
    *,
    group: str | None = None,
    key: str,
    config: IdemConfig | None = None,
    client: RedisClient | None = None,
    sink_table: str | None = None,
    topic: str = DEFAULT_TOPIC,
    idempotency_column: str | None = None,
    fingerprint: bool = True,
    msg_id: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> Callable[[SinkFunction], ExactlyOnce]:
    """Decorate a ``foreachBatch`` function so it sees every business key once.

    The function is called on the driver once per micro-batch, as
    ``fn(fresh, batch_id)``, with a Spark DataFrame of the rows whose key was never
    completed (in-batch duplicates, completed keys and bad rows are taken out
    first). It returns the keys it could not take (a list of keys, a DataFrame of
    rows, or a ``{key: error}`` mapping; ``None`` means all were taken); if it
    raises, every fresh row counts as failed. Failed rows go back on the delay
    ladder and, after ``max_reconsume_times``, to ``%DLQ%<group>``. While it runs,
    the driver renews the batch's leases every ``lease_ms / 3`` (a function slower
    than the lease keeps its keys); if the driver dies meanwhile, its keys come free
    a lease later. It may be called again with the same rows when Spark replays a
    batch or another query took over a dead driver's keys, so it must write
    idempotently (e.g. keyed on ``idempotency_column``) and must not stop the
    query or the session.

    Args:
        group: The consumer group; overrides ``config.group``. Without
            ``config``, the settings come from ``IDEM_*`` variables.
        key: The column holding the business key.
        config: The group's settings (Redis URL, Delta paths, dedup window, delay
            levels, mismatch policy, ...).
        client: A Redis client to use instead of one built from
            ``config.redis_url``.
        sink_table: A Delta table to write the rows the function accepted into,
            in the same commit as the record that their keys are done; the table
            is then the group's ledger.
        topic: The topic name recorded with these rows' messages (retry topic,
            journal, DLQ rows).
        idempotency_column: Adds a column of this name, ``<group>:<key>``, to the
            rows the function gets: the same value whenever a row could reach it
            twice. It must not be a column of the rows.
        fingerprint: Hash each row's payload (in Spark): a repeat of a completed
            key with a different payload follows the config's
            ``mismatch_policy``, and without ``msg_id`` copies of one message are
            recognised by key and payload. ``False`` skips the hash, and with it
            both checks.
        msg_id: A column holding the source's message id (a producer's resend and
            a redelivery carry the same one); without it a row's id is derived
            from its key and payload. Copies of one message share one retry
            chain and at most one DLQ row.
        clock: The time source of leases, delays and the dedup window.

    Returns:
        A decorator turning the function into an :class:`ExactlyOnce` to pass to
        ``foreachBatch``.
    """
    resolved = resolve_config(group, config)

    def wrap(fn: SinkFunction) -> ExactlyOnce:
        return ExactlyOnce(
            fn,
            config=resolved,
            key=key,
            client=client,
            sink_table=sink_table,
            topic=topic,
            idempotency_column=idempotency_column,
            fingerprint=fingerprint,
            msg_id=msg_id,
            clock=clock,
        )

    return wrap


def resolve_config(group: str | None, config: IdemConfig | None) -> IdemConfig:
    """``config`` with ``group`` applied, or one from ``IDEM_*`` variables."""
    if config is None:
        return IdemConfig.from_env(group=group) if group else IdemConfig.from_env()
    if group is not None and group != config.group:
        return config.with_changes(group=group)
    return config
