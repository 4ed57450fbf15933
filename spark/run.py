"""The ready pipeline behind ``idem run`` (and ``idem demo``).

JSON-lines files in a directory (or the JSON values of a Kafka topic:
:mod:`idem.spark.kafka_source`) are read as a Spark stream, unioned with the
group's retry stream, and written through :class:`ExactlyOnce` to a Delta
sink table (its own ledger) and/or a user function. A line that is not valid
JSON for the schema is dead-lettered with the line as its body. The query is restartable
from its checkpoint (the same query id, so a replayed batch re-takes its own
claims). ``available_now`` processes the files there when it starts — and the
retries they cause, which it waits for while any is scheduled — and returns;
files that land meanwhile are left for the next run.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO

import redis
from deltalake import DeltaTable
from pyspark.errors import StreamingQueryException
from redis.exceptions import RedisClusterException

from idem.config import IdemConfig
from idem.errors import ConfigError, IdemError, LedgerError, StoreUnavailable
from idem.ledger import read_table
from idem.redis_client import connect, redacted
from idem.redis_cluster import RedisClient
from idem.retry.dlq import DeadLetterStatus
from idem.retry.engine import RetryEngine
from idem.spark.decorator import ExactlyOnce
from idem.spark.faults import CrashPlan
from idem.spark.file_source import file_rows, source_schema
from idem.spark.kafka_source import (
    check_reachable,
    is_kafka,
    kafka_rows,
    kafka_schema,
    parse_options,
    parse_source,
)
from idem.spark.messages import SOURCE_ID_COLUMN
from idem.spark.metrics import observe_messages
from idem.spark.retry_source import retry_stream
from idem.spark.sink_result import SinkFunction
from idem.spark.stats import StatsStore, Totals

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

log = logging.getLogger(__name__)

AVAILABLE_NOW_TRIGGER_S = 0.5
"""Trigger interval while ``available_now`` waits for the retries its rows caused."""

STALL_S = 30.0
"""How long ``available_now`` waits on retries that are pending but neither due nor moving."""

STOP_POLL_S = 0.25
"""How often a run's waits look whether Ctrl-C or SIGTERM asked it to stop."""

_MIN_WAIT_S = 0.001

STORE_WAIT_S = 300.0
"""How long ``idem run`` waits for Redis to answer again after its query failed on an
outage, before it gives up (exit 1)."""

MAX_STORE_RESTARTS = 10
"""How many times in a row ``idem run`` starts its query again after a Redis outage
without a batch completing in between, before it gives up."""

_WAITING = ("Waiting for next trigger", "Waiting for data to arrive")
"""Spark's status messages of a query that has nothing to do."""


class QueryFailed(IdemError):
    """The streaming query stopped with an error; ``detail`` is Spark's whole error text."""

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail

    @property
    def store_outage(self) -> bool:
        """Whether Redis could not be reached (or was still loading its data): an outage
        the query can be started again after, unlike a bug or a wrong setting."""
        return _STORE_OUTAGE.search(f"{self}\n{self.detail}") is not None


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM during a run: noted here, and the run's waits stop.

    The handlers raise nothing: an exception raised inside a py4j call (the wait for
    the query is one) broke py4j's connection, and the query's stop then failed with
    a traceback (exit 1). The waits poll :attr:`stop` instead. Installed in the main
    thread only (Python delivers signals there); elsewhere a Ctrl-C raises as usual.
    """

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._noted)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _noted(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.stop.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: do not wait for the clean stop
        if self.received is None or signum == signal.SIGINT:
            self.received = signum  # Ctrl-C wins: the exit code says "interrupted"
        self.stop.set()

    @property
    def interrupted(self) -> bool:
        """Ctrl-C (not a SIGTERM, which is a clean stop) ended the run."""
        return self.received == signal.SIGINT


@dataclass(frozen=True)
class RunSpec:
    """What ``idem run`` was asked to do."""

    source: str
    key: str
    sink_delta: str | None = None
    sink_fn: str | None = None
    checkpoint: str | None = None
    available_now: bool = False
    schema: str | None = None
    """DDL of the source rows; inferred from the files (and kept in the checkpoint) if absent."""
    max_files_per_trigger: int | None = None
    trigger_seconds: float = 1.0
    topic: str = "files"
    msg_id_field: str | None = None
    """Field holding the source's message id (copies of one message share it)."""
    idempotency_column: str = "idempotency_key"
    timeout_seconds: float | None = None
    """Stop after this long (``None``: until interrupted, or with ``available_now`` until
    idle). With ``available_now`` it caps the wait for retries on the ladder: what is
    still pending stays scheduled for the next run."""
    leases: bool | None = None
    """Whether claims take leases in Redis (``None``: only with a function sink; pass
    ``True`` when another writer of the group runs a function sink or a consumer)."""
    kafka_options: tuple[str, ...] = ()
    """``KEY=VALUE`` settings of the Kafka reader (a ``kafka://`` source only)."""

    def __post_init__(self) -> None:
        if self.timeout_seconds is not None and not (
            math.isfinite(self.timeout_seconds) and self.timeout_seconds > 0
        ):
            raise ConfigError(
                f"--timeout: must be a number of seconds above 0, got {self.timeout_seconds:g}"
            )
        if not (math.isfinite(self.trigger_seconds) and self.trigger_seconds >= 0):
            raise ConfigError(
                f"--trigger-seconds: must be 0 or more seconds, got {self.trigger_seconds:g}"
            )
        if self.max_files_per_trigger is not None and self.max_files_per_trigger < 1:
            raise ConfigError(
                f"--max-files-per-trigger: must be at least 1, got {self.max_files_per_trigger}"
            )
        if is_kafka(self.source):
            parse_options(self.kafka_options)
            if self.max_files_per_trigger is not None:
                raise ConfigError(
                    "--max-files-per-trigger: a kafka:// source has no files; "
                    "use --kafka-option maxOffsetsPerTrigger=N"
                )
        elif self.kafka_options:
            raise ConfigError("--kafka-option: only with a kafka:// --source")

    def checkpoint_dir(self, config: IdemConfig) -> str:
        """The checkpoint directory (default ``<data_dir>/<group>/checkpoint``)."""
        return self.checkpoint or str(Path(config.group_dir) / "checkpoint")


@dataclass(frozen=True)
class SinkCheck:
    """What the sink table holds: rows, distinct keys, keys present more than once."""

    rows: int
    distinct_keys: int
    repeated_keys: tuple[str, ...]

    @property
    def exactly_once(self) -> bool:
        """Every key in the table once."""
        return not self.repeated_keys and self.rows == self.distinct_keys


@dataclass(frozen=True)
class RunReport:
    """The group's counters after the run, its DLQ and (for a Delta sink) the table check."""

    group: str
    totals: Totals
    dead_letters: int
    pending_retries: int
    sink: SinkCheck | None
    interrupted: bool = False
    """Ctrl-C (SIGINT) stopped the run: ``idem`` exits 130 after the report, as every
    subcommand does when interrupted (SIGTERM is a clean stop)."""

    def lines(self) -> list[str]:
        """The report as text lines."""
        t = self.totals
        dups = ", ".join(f"{cause} {n}" for cause, n in sorted(t.duplicates.items())) or "none"
        levels = ", ".join(f"level {lvl}: {n}" for lvl, n in t.retried_by_level.items()) or "none"
        out = [
            f"group {self.group}",
            f"  batches:               {t.batches} (replayed after a crash: {t.replayed_batches})",
            f"  messages:              {t.messages} (from the retry topic: {t.retried_rows})",
            f"  applied to the sink:   {t.applied}",
            f"  duplicates suppressed: {t.duplicates_total} ({dups})",
            f"  sink failures:         {t.failed} (busy keys sent back: {t.busy})",
            f"  retries by level:      {t.retried_total} ({levels})",
            f"  dead letters:          {self.dead_letters} in %DLQ%{self.group} "
            f"(bad keys {t.invalid}, malformed rows {t.malformed}, out of retries or rejected "
            f"{max(0, t.dead - t.invalid - t.malformed)}; "
            f"replayed from the DLQ so far: {t.dlq_replayed})",
            f"  retries still pending: {self.pending_retries}",
            f"  possible repeats:      {t.possible_repeats} (rows a replayed batch handed to the "
            "sink function again, with the same idempotency key)",
        ]
        if self.sink is not None:
            verdict = "PASS" if self.sink.exactly_once else "FAIL"
            out.append(
                f"  sink table:            {self.sink.rows} rows, {self.sink.distinct_keys} "
                f"distinct keys -> exactly-once check {verdict}"
            )
            if self.sink.repeated_keys:
                out.append(f"    keys more than once: {', '.join(self.sink.repeated_keys[:10])}")
        return out


def check_source(source: str) -> None:
    """``--source`` names a directory (an empty path would be the working directory), or a
    Kafka topic whose brokers take connections (``kafka://HOST:PORT/TOPIC``)."""
    if is_kafka(source):
        check_reachable(parse_source(source))
        return
    if not source:
        raise ConfigError("--source: the path is empty; name the directory of JSON-lines files")
    if Path(source).is_file():
        raise ConfigError(f"--source: {source} is a file, not a directory of JSON-lines files")
    if not Path(source).is_dir():
        raise ConfigError(f"--source: directory {source} does not exist")


def load_sink_fn(spec: str) -> SinkFunction:
    """``module:function`` or ``path/to/file.py:function`` -> the function.

    Whatever stops the module from loading (not found, a syntax error, an exception
    its top level raises) is a :class:`ConfigError` naming ``--sink-fn``.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"--sink-fn: {spec!r} must look like module:function or file.py:function")
    module_spec = None
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"--sink-fn: file {target} does not exist")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise ConfigError(f"--sink-fn: cannot load {target}")
    try:
        if module_spec is not None and module_spec.loader is not None:
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as exc:
        raise ConfigError(f"--sink-fn: cannot import {target!r}: {exc}") from exc
    except SyntaxError as exc:
        where = f"{Path(exc.filename).name}, line {exc.lineno}" if exc.filename else target
        raise ConfigError(f"--sink-fn: cannot load {target!r}: {exc.msg} ({where})") from exc
    except Exception as exc:  # the module's own code failed at import: say so, in one line
        raise ConfigError(
            f"--sink-fn: importing {target!r} failed: {type(exc).__name__}: {exc}"
        ) from exc
    fn = getattr(module, name, None)
    if fn is None:
        raise ConfigError(f"--sink-fn: {target!r} has no function {name!r}")
    if not callable(fn):
        raise ConfigError(
            f"--sink-fn: {name!r} in {target!r} is not callable (its type is {type(fn).__name__})"
        )
    return fn  # type: ignore[no-any-return]


def check_redis(url: str, timeout: float = 3.0) -> RedisClient:
    """A client to ``url`` after a PING, or :class:`StoreUnavailable` saying why not."""
    try:
        client = connect(url, connect_timeout=timeout)
    except (redis.RedisError, RedisClusterException) as exc:
        raise StoreUnavailable(f"cannot reach Redis at {redacted(url)}: {exc}") from exc
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        raise StoreUnavailable(f"cannot reach Redis at {redacted(url)}: {exc}") from exc
    return client


def sink_check(path: str) -> SinkCheck | None:
    """Count rows and distinct keys of a Delta sink table (``None`` if it does not exist)."""
    if not DeltaTable.is_deltatable(path):
        return None
    keys = read_table(DeltaTable(path), ["key"]).column("key").to_pylist()
    counts: dict[str, int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    repeated = tuple(sorted(k for k, n in counts.items() if n > 1))
    return SinkCheck(rows=len(keys), distinct_keys=len(counts), repeated_keys=repeated)


class Pipeline:
    """One group's file stream through :class:`ExactlyOnce`; start, run to the end, report."""

    def __init__(
        self,
        spark: SparkSession,
        config: IdemConfig,
        spec: RunSpec,
        *,
        sink_fn: SinkFunction | None = None,
        client: RedisClient | None = None,
        crash_plan: CrashPlan | None = None,
    ) -> None:
        if not spec.sink_delta and not spec.sink_fn and sink_fn is None:
            raise ConfigError(
                "a sink is required: --sink-delta PATH and/or --sink-fn module:function"
            )
        check_source(spec.source)
        self.spark = spark
        self.config = config
        self.spec = spec
        self._stop = threading.Event()
        """Set by Ctrl-C or SIGTERM during :meth:`run` (:class:`StopSignals`)."""
        self.client = client or check_redis(config.redis_url)
        self.checkpoint = spec.checkpoint_dir(config)
        fn = sink_fn or (load_sink_fn(spec.sink_fn) if spec.sink_fn else None)
        self.sink = ExactlyOnce(
            fn,
            config=config,
            key=spec.key,
            client=self.client,
            sink_table=spec.sink_delta,
            topic=_topic(spec),
            idempotency_column=spec.idempotency_column if fn is not None else None,
            msg_id=spec.msg_id_field or (SOURCE_ID_COLUMN if is_kafka(spec.source) else None),
            crash_plan=crash_plan,
            leases=spec.leases,
        )
        self.engine = RetryEngine(self.sink.config, client=self.client)
        self.stats = StatsStore(self.client, config.group, marker_ttl_ms=config.dedup_window_ms)

    def _query(self, trigger_seconds: float | None, *, new_files: bool = True) -> StreamingQuery:
        """Start the query: ``trigger_seconds`` apart, or ``None`` for Spark's AvailableNow;
        ``new_files=False`` lets the file source take no file (retries only)."""
        spec = self.spec
        fields = {"--key": spec.key, "--msg-id-field": spec.msg_id_field}
        if is_kafka(spec.source):
            # A Kafka query waiting for retries takes new records too (new_files is moot).
            schema = kafka_schema(
                self.spark, ddl=spec.schema, checkpoint=self.checkpoint, fields=fields
            )
            rows = kafka_rows(
                self.spark,
                schema,
                source=parse_source(spec.source),
                options=parse_options(spec.kafka_options),
            )
        else:
            schema = source_schema(
                self.spark,
                source=spec.source,
                ddl=spec.schema,
                checkpoint=self.checkpoint,
                fields=fields,
            )
            rows = file_rows(
                self.spark,
                schema,
                source=spec.source,
                max_files_per_trigger=spec.max_files_per_trigger,
                new_files=new_files,
            )
        stream = observe_messages(
            rows.unionByName(
                retry_stream(self.spark, schema=schema, config=self.sink.config),
                allowMissingColumns=True,
            )
        )
        writer = (
            stream.writeStream.foreachBatch(self.sink)
            .option("checkpointLocation", self.checkpoint)
            .queryName(f"idem_{self.config.group}".replace("-", "_").replace(".", "_"))
        )
        if trigger_seconds is None:
            return writer.trigger(availableNow=True).start()
        return writer.trigger(processingTime=f"{trigger_seconds} seconds").start()

    def run(self, *, on_started: Callable[[StreamingQuery], None] | None = None) -> RunReport:
        """Run as asked (``available_now``, or until interrupted / timed out); then report.

        ``on_started`` gets the query once it runs (with ``available_now``, the one that
        takes the source files). Before the query starts, the group's retry side is
        recovered (:meth:`RetryEngine.recover`): a dead-lettering that a killed process
        of the group cut short is finished, so its message is not consumed again.
        """
        self._recover_retries()
        interrupted = False
        timeout = self.spec.timeout_seconds
        deadline = None if timeout is None else time.monotonic() + timeout
        with StopSignals() as signals:
            self._stop = signals.stop
            try:
                self._ride_out_outages(lambda: self._run_queries(deadline, on_started))
            except KeyboardInterrupt:  # a second Ctrl-C, or one outside the main thread
                interrupted = True
            interrupted = interrupted or signals.interrupted
        if signals.received is not None or interrupted:
            log.info("interrupted; the query was stopped")
        # The report is still printed; only Ctrl-C makes the exit code say "interrupted".
        return replace(self.report(), interrupted=interrupted)

    def _recover_retries(self) -> None:
        """Finish the group's cut-short dead-letterings and bring Redis up to date with the
        retry journal; with the journal or DLQ unreadable, the next start does it."""
        try:
            self.engine.recover()
        except LedgerError:
            log.warning("could not settle the group's dead letters", exc_info=True)

    def _run_queries(
        self, deadline: float | None, on_started: Callable[[StreamingQuery], None] | None
    ) -> None:
        """The run's queries, from their checkpoint: until the source is drained
        (``available_now``), else until ``deadline`` or a stop signal."""
        if self.spec.available_now:
            self._available_now(on_started, deadline)
        else:
            query = self._query(self.spec.trigger_seconds)
            _drive(query, lambda q: _await(q, _left(deadline), self._stop), on_started)

    def _ride_out_outages(self, run: Callable[[], None]) -> None:
        """``run``, started again on its checkpoint each time its query fails because Redis
        was away, once Redis answers again.

        A batch cut short by the outage is replayed by the next query, as after a
        driver crash: its claims are re-taken under the same owner and nothing is
        written twice. Gives up (the failure is raised) when Redis stays away for
        :data:`STORE_WAIT_S`, or after :data:`MAX_STORE_RESTARTS` restarts in a row
        with no batch completed in between; any other failure is raised at once. A stop
        signal during the wait ends the run as it would have ended the query.
        """
        restarts = 0
        while True:
            batches = self._batches_done()
            try:
                run()
                return
            except QueryFailed as failed:
                if not failed.store_outage or self._stop.is_set():
                    raise
                if self._batches_done() > batches:
                    restarts = 0
                restarts += 1
                if restarts > MAX_STORE_RESTARTS:
                    raise
                log.warning(
                    "%s; Redis was away: the query starts again on its checkpoint once it "
                    "answers (restart %d of at most %d in a row)",
                    failed,
                    restarts,
                    MAX_STORE_RESTARTS,
                )
                if not self._store_back(failed):
                    if self._stop.is_set():
                        return  # Ctrl-C or SIGTERM while waiting: stop as asked
                    raise

    def _batches_done(self) -> int:
        """Batches the group has completed (0 while Redis cannot tell)."""
        try:
            return self.stats.totals().batches
        except (redis.RedisError, RedisClusterException, IdemError):
            return 0

    def _store_back(self, failed: QueryFailed) -> bool:
        """Wait until Redis answers a PING (``True``), a stop signal or :data:`STORE_WAIT_S`."""
        deadline = time.monotonic() + STORE_WAIT_S
        pause = 0.2
        while not self._stop.is_set():
            try:
                self.client.ping()
                return True
            except (redis.RedisError, RedisClusterException):
                if time.monotonic() >= deadline:
                    log.error("Redis did not answer for %.0f s after: %s", STORE_WAIT_S, failed)
                    return False
            self._stop.wait(pause)
            pause = min(pause * 2, 5.0)
        return False

    def _available_now(
        self, on_started: Callable[[StreamingQuery], None] | None, deadline: float | None
    ) -> None:
        """The source files there now and the retries they cause, then return.

        First Spark's own ``Trigger.AvailableNow``: the files present when the query
        starts (and the retries due then), in as many batches as ``max_files_per_trigger``
        makes, then the query stops; a file that lands meanwhile waits for the next run.
        Rows that failed are scheduled on the delay ladder, which AvailableNow does not
        wait for: while any is pending, a second query that takes no file picks them up
        as they come due (:meth:`_until_idle`).
        """
        _drive(self._query(None), lambda q: _await(q, _left(deadline), self._stop), on_started)
        if self.engine.pending() == 0 or _left(deadline) == 0 or self._stop.is_set():
            return
        _drive(
            self._query(AVAILABLE_NOW_TRIGGER_S, new_files=False),
            lambda q: self._until_idle(q, deadline),
            None,
        )

    def _until_idle(self, query: StreamingQuery, deadline: float | None = None) -> None:
        """Wait until every source is drained and no retry is scheduled or in the topic.

        Spark's own ``Trigger.AvailableNow`` stops before retries that come due
        later; a query that keeps triggering picks them up as they come due. A
        retry that stays pending without progress for ``STALL_S`` ends the wait,
        as does ``deadline`` (``time.monotonic()``); the report shows what is pending.
        """
        idle_since: float | None = None
        last_batch: object = None
        last_change = time.monotonic()
        while query.isActive:
            if self._stop.wait(AVAILABLE_NOW_TRIGGER_S / 2):
                return  # Ctrl-C or SIGTERM: the caller stops the query
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                log.info(
                    "--timeout reached; %d retry message(s) still pending", self.engine.pending()
                )
                return
            status = query.status
            progress = query.lastProgress
            batch = progress.get("batchId") if progress else None
            if batch != last_batch:
                last_batch, last_change = batch, now
            waiting = (
                status.get("message") in _WAITING
                and not status.get("isDataAvailable")
                and not status.get("isTriggerActive")
            )
            pending = self.engine.pending() if waiting else -1
            if pending == 0:
                idle_since = idle_since or now
                settled = min(now - idle_since, now - last_change)
                if settled >= 3 * AVAILABLE_NOW_TRIGGER_S:
                    return
                continue
            idle_since = None
            if pending > 0 and now - last_change > STALL_S:
                due = self.engine.next_due_ms()
                late = due is None or due < self.engine.clock.now_ms() - STALL_S * 1000
                if late:
                    log.warning("%d retry message(s) pending without progress; stopping", pending)
                    return

    def report(self) -> RunReport:
        """The group's report now."""
        dlq = self.engine.dlq
        return RunReport(
            group=self.config.group,
            totals=self.stats.totals(),
            dead_letters=dlq.count(DeadLetterStatus.DEAD),
            pending_retries=self.engine.pending(),
            sink=sink_check(self.spec.sink_delta) if self.spec.sink_delta else None,
        )

    def close(self) -> None:
        """Finish the sink's background work, then close connections."""
        self.sink.close()
        self.client.close()


_STORE_OUTAGE = re.compile(
    r"\b(?:StoreUnavailable|redis\.exceptions\.(?:ConnectionError|TimeoutError|BusyLoadingError"
    r"|ClusterDownError|TryAgainError|MasterDownError))\b"
)
"""The errors of a Redis that is away or still loading, wherever the failure's text has
them (raised on the driver, or in an executor's task)."""

_CAUSE = re.compile(r"^(?:[A-Za-z_]\w*\.)+[A-Za-z_]\w*: |^\w*(?:Error|Exception)\w*: ")


def _topic(spec: RunSpec) -> str:
    """The topic recorded on the messages: ``--topic``, else a Kafka source's own topic."""
    if spec.topic == RunSpec.topic and is_kafka(spec.source):
        return parse_source(spec.source).topic
    return spec.topic


def root_cause(text: str) -> str:
    """The innermost ``module.Error: message`` line of a Spark/py4j error text."""
    lines = [line for line in text.splitlines() if line and not line[0].isspace()]
    for line in reversed(lines):
        if _CAUSE.match(line) and "SQLSTATE" not in line:
            return line
    return lines[0] if lines else text


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 0; ``None`` for none."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _await(
    query: StreamingQuery,
    timeout_seconds: float | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Wait for the query (at most ``timeout_seconds``; until ``stop`` is set, looked at
    every :data:`STOP_POLL_S`); its failure becomes :class:`QueryFailed` naming the root
    cause."""
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    try:
        while stop is None or not stop.is_set():
            left = _left(deadline)
            if left is not None and left < _MIN_WAIT_S:
                break  # the time is up: Spark waits whole milliseconds and refuses 0
            wait = STOP_POLL_S if left is None else min(STOP_POLL_S, left)
            # Fractions of a second too: PySpark takes a float (its annotation says int).
            if query.awaitTermination(wait):  # type: ignore[arg-type]
                break
    except StreamingQueryException as exc:
        log.debug("the streaming query failed", exc_info=True)
        text = str(exc)
        raise QueryFailed(f"the streaming query failed: {root_cause(text)}", detail=text) from None
    _raise_if_failed(query)


def _drive(
    query: StreamingQuery,
    wait: Callable[[StreamingQuery], None],
    on_started: Callable[[StreamingQuery], None] | None = None,
) -> None:
    """Wait for ``query`` as ``wait`` does, stop it whatever happens, raise its failure."""
    try:
        if on_started is not None:
            on_started(query)
        wait(query)
    finally:
        if query.isActive:
            query.stop()
    _raise_if_failed(query)


def _raise_if_failed(query: StreamingQuery) -> None:
    error = query.exception()
    if error is not None:
        text = str(error)
        raise QueryFailed(f"the streaming query failed: {root_cause(text)}", detail=text)


def report_json(report: RunReport) -> str:
    """The report as one JSON object (for scripts and tests)."""
    t = report.totals
    return json.dumps(
        {
            "group": report.group,
            "batches": t.batches,
            "replayed_batches": t.replayed_batches,
            "messages": t.messages,
            "applied": t.applied,
            "duplicates": dict(t.duplicates),
            "failed": t.failed,
            "retried_by_level": {str(k): v for k, v in t.retried_by_level.items()},
            "dead_letters": report.dead_letters,
            "invalid": t.invalid,
            "malformed": t.malformed,
            "pending_retries": report.pending_retries,
            "possible_repeats": t.possible_repeats,
            "dlq_replayed": t.dlq_replayed,
            "interrupted": report.interrupted,
            "sink": None
            if report.sink is None
            else {
                "rows": report.sink.rows,
                "distinct_keys": report.sink.distinct_keys,
                "repeated_keys": list(report.sink.repeated_keys),
                "exactly_once": report.sink.exactly_once,
            },
        },
        sort_keys=True,
    )


def print_report(report: RunReport, *, stream: TextIO | None = None) -> None:
    """Print the report lines."""
    out = stream or sys.stdout
    for line in report.lines():
        print(line, file=out)
