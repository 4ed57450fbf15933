"""``idem demo``: the whole pipeline on embedded defaults, with nothing configured.

It starts a private Redis (``redis-server`` on a free loopback port when the
binary exists, otherwise an in-process fakeredis TCP server — and says
which), writes an order stream with at-least-once redelivery patterns
(:mod:`idem.spark.demo_data`), runs a real PySpark streaming query through
``@exactly_once`` into a Delta sink table, and prints the report with the
exactly-once check: every good order in the table exactly once, the poison
orders and bad rows in ``%DLQ%<group>``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from deltalake import DeltaTable

from idem.config import IdemConfig, LedgerEngine
from idem.delay_levels import DelayLevels
from idem.errors import ConfigError
from idem.extras import install_hint
from idem.ledger import read_table
from idem.redis_server import RedisServer, free_port, redis_server_binary
from idem.retry.dlq import DeadLetterStatus
from idem.spark.demo_data import (
    DEMO_DELAY_LEVELS,
    DEMO_GROUP,
    DEMO_MAX_RECONSUME_TIMES,
    KEY_FIELD,
    DemoData,
    check_sizes,
    write_demo_data,
)
from idem.spark.faults import CrashPlan, CrashPoint
from idem.spark.ledger_engine import engine_for_session, session_conf_for
from idem.spark.messages import RECONSUME_TIMES_COLUMN
from idem.spark.run import Pipeline, QueryFailed, RunReport, RunSpec, sink_check
from idem.spark.session import local_session

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


@dataclass(frozen=True)
class EmbeddedRedis:
    """Where the demo's Redis runs and what it is."""

    url: str
    kind: str


@contextlib.contextmanager
def embedded_redis() -> Iterator[EmbeddedRedis]:
    """A private ``redis-server`` if installed, else an in-process fakeredis TCP server."""
    if redis_server_binary() is not None:
        server = RedisServer()
        server.start()
        try:
            yield EmbeddedRedis(server.url, f"private redis-server on 127.0.0.1:{server.port}")
        finally:
            server.stop()
        return
    # fakeredis runs idem's Lua scripts with lupa (fakeredis[lua])
    if not all(importlib.util.find_spec(name) for name in ("fakeredis", "lupa")):
        raise ConfigError(
            "idem demo needs a Redis it can start: install redis-server (e.g. apt-get "
            f"install redis-server) or the in-process one: {install_hint('demo')}"
        )
    from fakeredis import TcpFakeServer  # noqa: PLC0415 - only needed without redis-server

    port = free_port()
    fake = TcpFakeServer(("127.0.0.1", port), server_type="redis")
    thread = threading.Thread(target=fake.serve_forever, name="fakeredis", daemon=True)
    thread.start()
    try:
        yield EmbeddedRedis(
            f"redis://127.0.0.1:{port}/0",
            f"in-process fakeredis TCP server on 127.0.0.1:{port} (redis-server not installed)",
        )
    finally:
        fake.shutdown()
        fake.server_close()


class DemoSink:
    """The demo's downstream: rejects poison orders always, flaky ones on early deliveries.

    Poison orders (negative amounts) fail validation every time; flaky orders hit an
    "inventory timeout" on their first one or two deliveries, then succeed. The rows
    it accepts are written to the Delta sink table by idem, in one commit with the
    record that their keys are done.
    """

    def __init__(self, data: DemoData) -> None:
        self.flaky = dict(data.flaky)
        self.calls = 0

    def __call__(self, fresh: DataFrame, batch_id: int) -> dict[str, str]:
        """Return ``{order_id: error}`` for the rows this delivery could not take."""
        self.calls += 1
        rows = fresh.select(KEY_FIELD, "amount", RECONSUME_TIMES_COLUMN).toArrow().to_pylist()
        failed: dict[str, str] = {}
        for row in rows:
            key, amount, times = row[KEY_FIELD], row["amount"], row[RECONSUME_TIMES_COLUMN] or 0
            if amount is not None and amount < 0:
                failed[key] = f"ValueError: amount must be positive, got {amount}"
            elif times < self.flaky.get(key, 0):
                failed[key] = f"TimeoutError: inventory service timed out (delivery {times + 1})"
        return failed


@dataclass(frozen=True)
class DemoResult:
    """The demo's outcome."""

    redis: EmbeddedRedis
    data: DemoData
    report: RunReport
    sink_keys: frozenset[str]
    dlq_keys: tuple[str | None, ...]
    seconds: float

    @property
    def missing(self) -> frozenset[str]:
        """Good orders not in the sink table."""
        return self.data.expected_keys - self.sink_keys

    @property
    def unexpected(self) -> frozenset[str]:
        """Keys in the sink table that should not be there (poison, bad)."""
        return self.sink_keys - self.data.expected_keys

    @property
    def passed(self) -> bool:
        """Every good order exactly once; poison and bad rows dead-lettered."""
        sink = self.report.sink
        poison_dead = self.data.poison_keys <= set(self.dlq_keys)
        return bool(
            sink is not None
            and sink.exactly_once
            and not self.missing
            and not self.unexpected
            and poison_dead
            and len(self.dlq_keys) == len(self.data.poison_keys) + self.data.bad_rows
        )


def run_demo(
    workdir: str | Path | None = None,
    *,
    delay_levels: str = DEMO_DELAY_LEVELS,
    max_reconsume_times: int = DEMO_MAX_RECONSUME_TIMES,
    orders: int = 600,
    files: int = 6,
    crash_after_batch: int | None = 2,
    engine: LedgerEngine = LedgerEngine.AUTO,
    jars: Sequence[str] = (),
    out: TextIO | None = None,
) -> DemoResult:
    """Run the demo in ``workdir`` (default: a new temporary directory) and print the report.

    ``crash_after_batch`` stages a driver failure after that batch's commit (before
    Spark's commit log): the query is restarted and Spark replays the batch.
    ``engine`` is the sink table's Delta engine: ``auto`` is delta-rs on the session the
    demo starts (it has no Delta jars), delta-spark on an active session with Delta's
    extension; delta-spark on a session the demo starts needs Delta's ``jars``.
    """
    check_sizes(orders=orders, files=files)  # before Redis and Spark start
    out = out or sys.stdout
    started = time.monotonic()
    settings = IdemConfig(  # checked before anything starts; URL and data dir come later
        group=DEMO_GROUP,
        redis_url="redis://127.0.0.1:6379/0",
        delay_levels=DelayLevels.parse(delay_levels),
        max_reconsume_times=max_reconsume_times,
        buckets=8,
        engine=engine,
    )
    root = Path(workdir or tempfile.mkdtemp(prefix="idem-demo-"))
    with embedded_redis() as redis_info:
        print(f"idem demo: Redis: {redis_info.kind}", file=out)
        print(f"idem demo: data under {root}", file=out)
        data = write_demo_data(root / "incoming", orders=orders, files=files)
        print(
            f"idem demo: {data.messages} messages in {len(data.files)} files "
            f"({len(data.expected_keys)} good orders, {data.producer_duplicates} producer "
            f"resends, {data.redelivered} redeliveries, {len(data.flaky)} flaky, "
            f"{len(data.poison_keys)} poison, {data.bad_rows} bad keys)",
            file=out,
        )
        config = settings.with_changes(redis_url=redis_info.url, data_dir=str(root / "idem-data"))
        sink_path = str(root / "orders-sink")
        spec = RunSpec(
            source=data.directory,
            key=KEY_FIELD,
            sink_delta=sink_path,
            checkpoint=str(root / "checkpoint"),
            available_now=True,
            max_files_per_trigger=1,
            topic="orders",
            msg_id_field="mq_msg_id",
        )
        print(
            f"idem demo: delay levels {delay_levels!r}, max_reconsume_times "
            f"{max_reconsume_times}; starting local Spark",
            file=out,
        )
        spark = local_session(
            "idem-demo",
            log_level="FATAL",
            fast_start=True,
            conf=session_conf_for(settings.engine, jars),
        )
        used = engine_for_session(settings.engine, spark)
        print(f"idem demo: ledger engine {used.value}", file=out)
        crash = CrashPlan(CrashPoint.AFTER_COMMIT, crash_after_batch) if crash_after_batch else None
        if crash is not None:
            # py4j logs the staged failure with a traceback; the demo says what happened.
            logging.getLogger("py4j.clientserver").setLevel(logging.CRITICAL)
        pipeline = Pipeline(spark, config, spec, sink_fn=DemoSink(data), crash_plan=crash)
        try:
            try:
                report = pipeline.run()
            except QueryFailed as exc:
                if crash is None or not crash.fired or "SimulatedCrash" not in str(exc):
                    raise
                print(
                    f"idem demo: the driver failed after batch {crash.batch_id}'s commit "
                    "(staged); restarting on the same checkpoint: Spark replays the batch",
                    file=out,
                )
                report = pipeline.run()
            check = sink_check(sink_path)
            sink_keys = frozenset(_sink_keys(sink_path)) if check else frozenset()
            dlq_keys = tuple(d.key for d in pipeline.engine.dlq.list(status=DeadLetterStatus.DEAD))
        finally:
            pipeline.close()
    result = DemoResult(
        redis=redis_info,
        data=data,
        report=report,
        sink_keys=sink_keys,
        dlq_keys=dlq_keys,
        seconds=time.monotonic() - started,
    )
    _print(result, out)
    return result


def _sink_keys(path: str) -> list[str]:
    keys = read_table(DeltaTable(path), ["key"]).column("key")
    return [str(k) for k in keys.to_pylist()]


def _print(result: DemoResult, out: TextIO) -> None:
    print("", file=out)
    print("idem demo report", file=out)
    for line in result.report.lines():
        print(line, file=out)
    data = result.data
    print(
        f"  expected:              {len(data.expected_keys)} good orders once each; "
        f"{len(data.poison_keys)} poison + {data.bad_rows} bad rows in the DLQ",
        file=out,
    )
    if result.missing:
        print(f"  MISSING from the sink: {sorted(result.missing)[:10]}", file=out)
    if result.unexpected:
        print(f"  UNEXPECTED in the sink: {sorted(result.unexpected)[:10]}", file=out)
    verdict = "PASS" if result.passed else "FAIL"
    print(
        f"exactly-once check: {verdict} ({len(result.sink_keys)} keys in the sink table, "
        f"{len(result.dlq_keys)} dead letters) in {result.seconds:.0f} s",
        file=out,
    )


def cleanup(path: str | Path) -> None:
    """Remove a demo directory."""
    shutil.rmtree(path, ignore_errors=True)
