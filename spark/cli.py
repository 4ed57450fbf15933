"""``idem demo``, ``idem run`` and ``idem dlq {ls,show,replay,discard}``.

Exit codes as for every subcommand (:mod:`idem.cli`): 2 also for a missing
directory, 4 when the exactly-once check of ``demo`` or ``run --check`` fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.errors import IllegalArgumentException

from idem.cli import (
    EXIT_CHECK_FAILED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    exit_code,
)
from idem.cli_args import (
    add_engine_option,
    check_not_a_file,
    check_writable_dir,
    check_writable_file,
    in_flags,
    non_negative_int,
    path_flag,
    port_number,
    redis_url,
)
from idem.config import IdemConfig, LedgerEngine
from idem.errors import ConfigError, IdemError
from idem.metrics import MetricsServer
from idem.retry.dlq import DeadLetterStatus
from idem.retry.engine import RetryEngine
from idem.spark.demo import run_demo
from idem.spark.demo_data import DEMO_DELAY_LEVELS, DEMO_MAX_RECONSUME_TIMES
from idem.spark.dlq import (
    Selection,
    describe,
    discard,
    dumps,
    format_rows,
    progress_bar,
    replay,
)
from idem.spark.ledger_engine import engine_for_session, jar_paths, session_conf_for
from idem.spark.metrics import serve_job_metrics
from idem.spark.run import (
    Pipeline,
    RunSpec,
    check_redis,
    check_source,
    load_sink_fn,
    print_report,
    report_json,
)
from idem.spark.session import local_session

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)


def _fail(code: int, message: str) -> int:
    print(f"idem: error: {message}", file=sys.stderr)
    return code


def _add_config_options(parser: argparse.ArgumentParser, *, group_required: bool = True) -> None:
    parser.add_argument(
        "--group",
        required=group_required and not os.environ.get("IDEM_GROUP"),
        help="consumer group (default: IDEM_GROUP)",
    )
    parser.add_argument("--redis-url", type=redis_url, help="redis:// URL (IDEM_REDIS_URL)")
    parser.add_argument("--data-dir", help="where the group's Delta tables live (IDEM_DATA_DIR)")
    parser.add_argument("--dlq-path", help="the %%DLQ%%<group> Delta table")
    parser.add_argument("--journal-path", help="the retry journal's Delta table")
    parser.add_argument(
        "--delay-levels", help='messageDelayLevel, e.g. "1s 5s 10s 30s 1m 2m ... 2h"'
    )
    parser.add_argument(
        "--max-reconsume-times", type=int, help="retries before the DLQ (default 16)"
    )


def _config(args: argparse.Namespace, **extra: Any) -> IdemConfig:
    overrides: dict[str, Any] = dict(extra)
    for attr in (
        "group",
        "redis_url",
        "data_dir",
        "dlq_path",
        "journal_path",
        "delay_levels",
        "max_reconsume_times",
        "engine",
    ):
        value = getattr(args, attr, None)
        if value is not None:
            overrides[attr] = value
    return IdemConfig.from_env(**overrides)


# -- idem demo ---------------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    if args.workdir:  # an empty one means the default, a new temporary directory
        check_writable_dir(args.workdir, name="--workdir")
    engine = _demo_engine(args.engine)
    result = run_demo(
        args.workdir,
        engine=engine,
        jars=jar_paths(args.jars) if args.jars else (),
        delay_levels=args.delay_levels,
        max_reconsume_times=args.max_reconsume_times,
        orders=args.orders,
        files=args.files,
        crash_after_batch=None if args.no_crash else 2,
    )
    if result.report.interrupted:  # the check of a run cut short says nothing: not exit 4
        return EXIT_INTERRUPTED
    return EXIT_OK if result.passed else EXIT_CHECK_FAILED


def _demo_engine(flag: str | None) -> LedgerEngine:
    """``--engine``, else ``IDEM_ENGINE``, else ``auto`` (which a demo's own session,
    started without Delta's jars, resolves to delta-rs)."""
    if flag:
        return LedgerEngine(flag)
    raw = os.environ.get("IDEM_ENGINE", "auto")
    try:
        return LedgerEngine(raw)
    except ValueError:
        allowed = ", ".join(e.value for e in LedgerEngine)
        raise ConfigError(f"IDEM_ENGINE: {raw!r} is not one of {allowed}") from None


# -- idem run ----------------------------------------------------------------------------------


def run_spec(args: argparse.Namespace) -> RunSpec:
    """The :class:`RunSpec` of parsed ``idem run`` arguments."""
    return RunSpec(
        source=args.source,
        key=args.key,
        sink_delta=args.sink_delta,
        sink_fn=args.sink_fn,
        checkpoint=args.checkpoint,
        available_now=args.available_now,
        schema=args.schema,
        max_files_per_trigger=args.max_files_per_trigger,
        trigger_seconds=args.trigger_seconds,
        topic=args.topic,
        msg_id_field=args.msg_id_field,
        idempotency_column=args.idempotency_column,
        timeout_seconds=args.timeout,
        leases=True if args.leases else None,
        kafka_options=tuple(args.kafka_option or ()),
    )


def _run(args: argparse.Namespace) -> int:
    check_source(args.source)
    if not args.sink_delta and not args.sink_fn:
        raise ConfigError("a sink is required: --sink-delta PATH and/or --sink-fn M:F")
    spec = run_spec(args)  # a bad argument is exit 2 before anything starts
    config = _config(args)
    _check_run_paths(args, spec, config)
    sink_fn = load_sink_fn(spec.sink_fn) if spec.sink_fn else None  # before a JVM starts
    jars = jar_paths(args.jars) if args.jars else []
    # --spark-conf wins over what the engine asks of a new session
    conf = {**session_conf_for(config.engine, jars), **_spark_conf(args.spark_conf)}
    client = check_redis(config.redis_url)  # StoreUnavailable -> exit 3
    session = _session(f"idem-run-{config.group}", conf)
    used = engine_for_session(config.engine, session)  # before the query starts
    log.info("ledger engine: %s", used.value)
    pipeline = Pipeline(session, config, spec, client=client, sink_fn=sink_fn)
    server = None
    try:
        if args.metrics_port is not None:
            server = _serve_metrics(pipeline, args)
        report = pipeline.run()
    finally:
        if server is not None:
            server.close()
        pipeline.close()
    print_report(report)
    if args.report_json:
        Path(args.report_json).write_text(report_json(report), encoding="utf-8")
    if report.interrupted:
        return EXIT_INTERRUPTED
    if args.check and report.sink is not None and not report.sink.exactly_once:
        return EXIT_CHECK_FAILED
    return EXIT_OK


def _serve_metrics(pipeline: Pipeline, args: argparse.Namespace) -> MetricsServer:
    try:
        server = serve_job_metrics(pipeline.engine, host=args.metrics_host, port=args.metrics_port)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"--metrics-port: {exc}") from exc
    except OSError as exc:  # the port is taken, or the address is not this host's
        raise ConfigError(
            f"--metrics-port: cannot listen on {args.metrics_host}:{args.metrics_port}: "
            f"{exc.strerror or exc}"
        ) from exc
    print(f"idem run: metrics on {server.url}/metrics", file=sys.stderr, flush=True)
    return server


def _check_run_paths(args: argparse.Namespace, spec: RunSpec, config: IdemConfig) -> None:
    """Every place ``idem run`` writes takes writes, before Redis or Spark is touched: a
    Delta table or checkpoint that cannot be written fails deep in a streaming batch."""
    if spec.sink_delta:
        check_writable_dir(spec.sink_delta, name="--sink-delta")
    for setting, path in (
        ("checkpoint", spec.checkpoint_dir(config)),
        ("dlq_path", config.resolved_dlq_path),
        ("journal_path", config.resolved_journal_path),
    ):
        check_writable_dir(path, name=path_flag(args, setting))
    if args.report_json:
        check_writable_file(args.report_json, name="--report-json")


def _session(name: str, conf: dict[str, str]) -> SparkSession:
    """The local session, its ``--spark-conf`` settings checked by Spark itself."""
    session = local_session(name, conf=conf)
    if conf:
        try:
            # reading a SQL setting builds the session state, which checks every setting
            session.conf.get("spark.sql.shuffle.partitions")
        except IllegalArgumentException as exc:
            session.stop()
            raise ConfigError(f"--spark-conf: {str(exc).splitlines()[0]}") from None
    return session


def _spark_conf(pairs: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--spark-conf: {pair!r} must look like KEY=VALUE")
        out[name.strip()] = value
    return out


# -- idem dlq ----------------------------------------------------------------------------------


def _engine(args: argparse.Namespace) -> RetryEngine:
    config = _config(args)
    # a file where a Delta table belongs fails deep in delta-rs with a bare OSError
    check_not_a_file(config.resolved_dlq_path, name=path_flag(args, "dlq_path"))
    check_not_a_file(config.resolved_journal_path, name=path_flag(args, "journal_path"))
    return RetryEngine(config, client=check_redis(config.redis_url))


def _selection(args: argparse.Namespace) -> Selection:
    return Selection(
        keys=tuple(args.key or ()),
        msg_ids=tuple(args.msg_id or ()),
        everything=bool(getattr(args, "all", False)),
        include_replayed=bool(getattr(args, "include_replayed", False)),
    )


def _dlq_ls(args: argparse.Namespace) -> int:
    engine = _engine(args)
    if not engine.dlq.exists():
        # a typo in --group or --data-dir must not read as "nothing dead-lettered"
        print(
            f"%DLQ%{engine.group}: no table at {engine.dlq.path} (nothing dead-lettered in "
            f"this group yet; check {path_flag(args, 'dlq_path')} and --group)",
            file=sys.stderr if args.json else sys.stdout,
        )
        return EXIT_OK
    status = None if args.status == "all" else DeadLetterStatus(args.status.upper())
    letters = engine.dlq.list(status=status, limit=args.limit or None)
    if args.json:
        if letters:
            print(dumps(describe(d) for d in letters))
        return EXIT_OK
    print(
        f"%DLQ%{engine.group} at {engine.dlq.path}: {len(letters)} row(s) shown "
        f"(status {args.status})"
    )
    for line in format_rows(letters):
        print(line)
    return EXIT_OK


def _dlq_show(args: argparse.Namespace) -> int:
    engine = _engine(args)
    wanted = set(args.key or ()) | set(args.msg_id or ())
    if not wanted:
        return _fail(EXIT_USAGE, "dlq show: name --key K or --msg-id ID")
    letters = [
        d
        for d in engine.dlq.list()
        if d.key in wanted or d.msg_id in wanted or d.origin_msg_id in wanted
    ]
    for d in letters:
        print(json.dumps(describe(d), indent=2, ensure_ascii=False, default=str))
    found = {name for d in letters for name in (d.key, d.msg_id, d.origin_msg_id)}
    return _unknown(list(wanted - found))


def _unknown(names: Sequence[str]) -> int:
    """Exit 1 naming the keys / msg ids that match no dead letter (the rest were done)."""
    if not names:
        return EXIT_OK
    return _fail(EXIT_ERROR, f"no dead letter with key/msg id {', '.join(sorted(names))}")


def _dlq_replay(args: argparse.Namespace) -> int:
    selection = _selection(args)
    if selection.empty:
        return _fail(EXIT_USAGE, "dlq replay: name --key K, --msg-id ID or --all")
    engine = _engine(args)
    result = replay(engine, selection, by=args.by, progress=progress_bar())
    print(
        f"replayed {result.sent} dead letter(s) of %DLQ%{engine.group} through the retry path "
        f"(dedup applies: a key completed meanwhile is not applied again); "
        f"marked {result.marked} REPLAYED"
    )
    if result.skipped_replayed:
        print(
            f"{result.skipped_replayed} matching row(s) were replayed before and were left "
            "alone (--include-replayed sends them again; keys completed within the dedup "
            "window are still suppressed)"
        )
    if result.selected == 0:
        print("nothing to replay")
    return _unknown(result.unknown)


def _dlq_discard(args: argparse.Namespace) -> int:
    selection = _selection(args)
    if selection.empty:
        return _fail(EXIT_USAGE, "dlq discard: name --key K, --msg-id ID or --all")
    engine = _engine(args)
    result = discard(engine, selection, by=args.by)
    print(f"marked {result.marked} dead letter(s) of %DLQ%{engine.group} DISCARDED")
    return _unknown(result.unknown)


def _guarded(handler: Any) -> Any:
    """Map the errors a user can fix to the documented exit codes."""

    def run(args: argparse.Namespace) -> int:
        # py4j logs every callback at INFO; idem's own lines are what the user wants.
        logging.getLogger("py4j").setLevel(logging.WARNING)
        try:
            return int(handler(args))
        except IdemError as exc:
            return _fail(exit_code(exc), in_flags(args, exc))

    return run


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo``, ``run`` and ``dlq`` to the ``idem`` command."""

    demo = subparsers.add_parser(
        "demo",
        help="run the whole pipeline on embedded defaults and print the exactly-once report",
        description="Starts a private Redis, writes an order stream with redeliveries, "
        "flaky and poison orders, runs a local Spark streaming query through "
        "@exactly_once into a Delta table, and checks every order landed exactly once.",
    )
    demo.add_argument("--workdir", help="where to put the demo's data (default: a temp dir)")
    demo.add_argument("--delay-levels", default=DEMO_DELAY_LEVELS, help="short delay levels")
    demo.add_argument("--max-reconsume-times", type=int, default=DEMO_MAX_RECONSUME_TIMES)
    demo.add_argument("--orders", type=int, default=600, help="distinct orders (default 600)")
    demo.add_argument("--files", type=int, default=6, help="files = micro-batches (default 6)")
    demo.add_argument(
        "--no-crash",
        action="store_true",
        help="do not stage the driver failure after batch 2 (which Spark then replays)",
    )
    _add_session_options(demo)
    demo.set_defaults(func=_guarded(_demo))
    _register_run(subparsers)
    _register_dlq(subparsers)


def _add_session_options(parser: argparse.ArgumentParser) -> None:
    """``--engine`` and ``--jars``: the ledger's engine and the local session's jars."""
    add_engine_option(parser)
    parser.add_argument(
        "--jars",
        metavar="DIR_OR_LIST",
        help="jars for the Spark session this command starts (spark.jars): a directory of "
        "jars or comma-separated jar files, e.g. Delta's for --engine delta-spark; a "
        "session spark-submit configured is used as it is",
    )


def _register_run(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = subparsers.add_parser(
        "run",
        help="read JSON-lines files as a stream and write them exactly once",
        description="Reads JSON-lines files from --source as a Spark stream, unions the "
        "group's retry stream and writes through @exactly_once to a Delta sink table "
        "and/or a function of yours. Restartable from its checkpoint.",
    )
    run.add_argument(
        "--source",
        required=True,
        help="directory of JSON-lines files, or kafka://HOST:PORT[,HOST:PORT...]/TOPIC "
        "(JSON values; needs Spark's Kafka connector and --schema)",
    )
    run.add_argument(
        "--kafka-option",
        action="append",
        metavar="KEY=VALUE",
        help="a setting of Spark's Kafka reader, e.g. startingOffsets=latest, "
        "maxOffsetsPerTrigger=1000, kafka.security.protocol=SSL (repeatable; "
        "startingOffsets is earliest unless given)",
    )
    run.add_argument("--key", required=True, help="the business key field")
    _add_config_options(run)
    run.add_argument("--sink-delta", help="Delta table the rows go to (it is the group's ledger)")
    run.add_argument(
        "--sink-fn",
        help="module:function or file.py:function called as fn(fresh_df, batch_id); "
        "its rows carry an idempotency_key column; it may return the failed keys",
    )
    run.add_argument(
        "--idempotency-column",
        default="idempotency_key",
        help="name of the column --sink-fn's rows get their idempotency key in "
        "(default idempotency_key; it must not be a field of the rows)",
    )
    run.add_argument(
        "--checkpoint", help="Spark checkpoint dir (default <data-dir>/<group>/checkpoint)"
    )
    run.add_argument(
        "--available-now",
        action="store_true",
        help="process the files there at the start (and the retries they cause), then "
        "exit; files that land meanwhile are left for the next run",
    )
    run.add_argument(
        "--leases",
        action="store_true",
        help="claims take leases in Redis even with only --sink-delta (needed when a "
        "function sink or a consumer of another process writes the same group)",
    )
    run.add_argument("--schema", help="DDL of the rows (default: inferred, kept in the checkpoint)")
    run.add_argument("--max-files-per-trigger", type=int, help="files per micro-batch")
    run.add_argument(
        "--trigger-seconds",
        type=float,
        default=1.0,
        help="micro-batch interval (continuous runs; --available-now polls every 0.5 s)",
    )
    run.add_argument("--topic", default="files", help="topic name recorded for these messages")
    run.add_argument(
        "--msg-id-field",
        help="field with the source's message id (default: derived from key and payload)",
    )
    run.add_argument(
        "--timeout",
        type=float,
        help="stop after this many seconds (with --available-now: stop waiting for retries "
        "on the ladder; what is pending stays scheduled for the next run)",
    )
    run.add_argument("--report-json", help="also write the report as JSON to this file")
    run.add_argument(
        "--spark-conf",
        action="append",
        metavar="KEY=VALUE",
        help="a Spark setting for the local session (repeatable)",
    )
    _add_session_options(run)
    run.add_argument(
        "--check", action="store_true", help="exit 4 if the Delta sink holds a key twice"
    )
    run.add_argument(
        "--metrics-port",
        type=port_number,
        help="serve /metrics (and /healthz, /readyz) on this port while running (0: any)",
    )
    run.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics port listens on (default 127.0.0.1)",
    )
    run.set_defaults(func=_guarded(_run))


def _register_dlq(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dlq = subparsers.add_parser("dlq", help="the %%DLQ%%<group> table: ls, show, replay, discard")
    commands = dlq.add_subparsers(dest="dlq_command", metavar="COMMAND", required=True)
    ls = commands.add_parser("ls", help="list dead letters, newest first")
    _add_config_options(ls)
    ls.add_argument("--status", default="dead", choices=["dead", "replayed", "discarded", "all"])
    ls.add_argument(
        "--limit", type=non_negative_int, default=50, help="show at most this many rows (0: all)"
    )
    ls.add_argument("--json", action="store_true", help="JSON lines instead of a table")
    ls.set_defaults(func=_guarded(_dlq_ls))

    show = commands.add_parser("show", help="one dead letter in full, its row decoded")
    _add_config_options(show)
    show.add_argument("--key", action="append", help="business key (repeatable)")
    show.add_argument("--msg-id", action="append", help="msg id or origin msg id (repeatable)")
    show.set_defaults(func=_guarded(_dlq_show))

    for name, handler, text in (
        ("replay", _dlq_replay, "send dead letters back through the dedup layer"),
        ("discard", _dlq_discard, "mark dead letters DISCARDED"),
    ):
        sub = commands.add_parser(name, help=text)
        _add_config_options(sub)
        sub.add_argument("--key", action="append", help="business key (repeatable)")
        sub.add_argument("--msg-id", action="append", help="msg id or origin msg id (repeatable)")
        sub.add_argument("--all", action="store_true", help="every DEAD row of the group")
        sub.add_argument(
            "--by",
            help="who does it, recorded in the table's replayed_by (default: user@host)",
        )
        if name == "replay":
            sub.add_argument(
                "--include-replayed",
                action="store_true",
                help=(
                    "also send rows replayed before (keys completed within the dedup window "
                    "are still suppressed)"
                ),
            )
        sub.set_defaults(func=_guarded(handler))
