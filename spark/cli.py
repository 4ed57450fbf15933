"""``idem demo``, ``idem run`` and ``idem dlq {ls,show,replay,discard}``.

Exit codes as for every subcommand (:mod:`idem.cli`): 2 also for a missing
directory, 4 when the exactly-once check of ``demo`` or ``run --check`` fails.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from pyspark.errors import IllegalArgumentException

from idem.cli_args import (
    check_not_a_file,
    check_writable_dir,
    check_writable_file,
    config_of,
    path_flag,
)
from idem.cli_command import (
    EXIT_CHECK_FAILED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Args,
    IdemCommand,
    IdemGroup,
    fail,
    handler,
)
from idem.cli_options import (
    NON_NEGATIVE,
    Decorator,
    apply,
    json_option,
    metrics_options,
    settings,
)
from idem.cli_output import emit_json, progress, say, table, where
from idem.config import IdemConfig, LedgerEngine
from idem.errors import ConfigError
from idem.metrics import MetricsServer
from idem.retry.dlq import DeadLetterStatus
from idem.retry.engine import RetryEngine
from idem.spark.demo import DemoResult, run_demo
from idem.spark.demo_data import DEMO_DELAY_LEVELS, DEMO_MAX_RECONSUME_TIMES
from idem.spark.dlq import Selection, describe, discard, replay, table_rows
from idem.spark.ledger_engine import engine_for_session, jar_paths, session_conf_for
from idem.spark.metrics import serve_job_metrics
from idem.spark.run import (
    Pipeline,
    RunReport,
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


def _quiet_py4j(func: Callable[[Args], int]) -> Callable[[Args], int]:
    """py4j logs every callback at INFO; idem's own lines are what the user wants."""

    def run(args: Args) -> int:
        logging.getLogger("py4j").setLevel(logging.WARNING)
        return func(args)

    run.__name__ = func.__name__
    run.__doc__ = func.__doc__
    return run


_SESSION_OPTIONS: list[Decorator] = [
    click.option(
        "--jars",
        metavar="DIR_OR_LIST",
        help="Jars for the Spark session this command starts (spark.jars): a directory of "
        "jars or comma-separated jar files, e.g. Delta's for --engine delta-spark; a "
        "session spark-submit configured is used as it is.",
    ),
    settings("engine"),
]


_session_options = apply(*_SESSION_OPTIONS)


# -- idem demo ---------------------------------------------------------------------------------


@click.command(
    "demo",
    cls=IdemCommand,
    short_help="Run the whole pipeline on embedded defaults and print the exactly-once report.",
    help="Starts a private Redis, writes an order stream with redeliveries, flaky and poison "
    "orders, runs a local Spark streaming query through @exactly_once into a Delta table, "
    "and checks every order landed exactly once.",
)
@click.option(
    "--workdir", metavar="DIR", help="Where to put the demo's data.  [default: a new temp dir]"
)
@click.option(
    "--delay-levels", default=DEMO_DELAY_LEVELS, metavar="LEVELS", help="Short delay levels."
)
@click.option(
    "--max-reconsume-times",
    type=int,
    default=DEMO_MAX_RECONSUME_TIMES,
    help="Retries before the DLQ.",
)
@click.option("--orders", type=int, default=600, help="Distinct orders.")
@click.option("--files", type=int, default=6, help="Files = micro-batches.")
@click.option(
    "--no-crash",
    is_flag=True,
    help="Do not stage the driver failure after batch 2 (which Spark then replays).",
)
@_session_options
@json_option
@handler
@_quiet_py4j
def _demo(args: Args) -> int:
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
        out=sys.stderr if args.json else None,
    )
    if args.json:
        emit_json(_demo_json(result))
    if result.report.interrupted:  # the check of a run cut short says nothing: not exit 4
        return EXIT_INTERRUPTED
    return EXIT_OK if result.passed else EXIT_CHECK_FAILED


def _demo_json(result: DemoResult) -> dict[str, Any]:
    return {
        "passed": result.passed,
        "missing": sorted(result.missing),
        "unexpected": sorted(result.unexpected),
        "dead_letter_keys": list(result.dlq_keys),
        "seconds": round(result.seconds, 3),
        "report": json.loads(report_json(result.report)),
    }


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


def run_spec(args: Args) -> RunSpec:
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


_RUN_OPTIONS: list[Decorator] = [
    click.option(
        "--source",
        required=True,
        metavar="DIR|URL",
        help="Directory of JSON-lines files, or kafka://HOST:PORT[,HOST:PORT...]/TOPIC "
        "(JSON values; needs Spark's Kafka connector and --schema).",
    ),
    click.option(
        "--kafka-option",
        multiple=True,
        metavar="KEY=VALUE",
        help="A setting of Spark's Kafka reader, e.g. startingOffsets=latest, "
        "maxOffsetsPerTrigger=1000, kafka.security.protocol=SSL (repeatable; "
        "startingOffsets is earliest unless given).",
    ),
    click.option("--key", required=True, metavar="FIELD", help="The business key field."),
    settings(
        "group",
        "redis_url",
        "data_dir",
        "dlq_path",
        "journal_path",
        "delay_levels",
        "max_reconsume_times",
    ),
    click.option(
        "--sink-delta",
        metavar="TABLE",
        help="Delta table the rows go to (it is the group's ledger).",
    ),
    click.option(
        "--sink-fn",
        metavar="M:F",
        help="module:function or file.py:function called as fn(fresh_df, batch_id); "
        "its rows carry an idempotency_key column; it may return the failed keys.",
    ),
    click.option(
        "--idempotency-column",
        default="idempotency_key",
        metavar="COLUMN",
        help="Name of the column --sink-fn's rows get their idempotency key in "
        "(it must not be a field of the rows).",
    ),
    click.option(
        "--checkpoint",
        metavar="DIR",
        help="Spark checkpoint dir.  [default: <data_dir>/<group>/checkpoint]",
    ),
    click.option(
        "--available-now",
        is_flag=True,
        help="Process the files there at the start (and the retries they cause), then "
        "exit; files that land meanwhile are left for the next run.",
    ),
    click.option(
        "--leases",
        is_flag=True,
        help="Claims take leases in Redis even with only --sink-delta (needed when a "
        "function sink or a consumer of another process writes the same group).",
    ),
    click.option(
        "--schema",
        metavar="DDL",
        help="DDL of the rows.  [default: inferred, kept in the checkpoint]",
    ),
    click.option("--max-files-per-trigger", type=int, metavar="N", help="Files per micro-batch."),
    click.option(
        "--trigger-seconds",
        type=float,
        default=1.0,
        help="Micro-batch interval (continuous runs; --available-now polls every 0.5 s).",
    ),
    click.option(
        "--topic", default="files", metavar="TOPIC", help="Topic name recorded for these messages."
    ),
    click.option(
        "--msg-id-field",
        metavar="FIELD",
        help="Field with the source's message id.  [default: derived from key and payload]",
    ),
    click.option(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="Stop after this many seconds (with --available-now: stop waiting for retries "
        "on the ladder; what is pending stays scheduled for the next run).",
    ),
    click.option(
        "--report-json", metavar="FILE", help="Also write the report as JSON to this file."
    ),
    click.option(
        "--spark-conf",
        multiple=True,
        metavar="KEY=VALUE",
        help="A Spark setting for the local session (repeatable).",
    ),
    _session_options,
    click.option("--check", is_flag=True, help="Exit 4 if the Delta sink holds a key twice."),
    metrics_options("Address the metrics port listens on."),
    json_option,
]


_run_options = apply(*_RUN_OPTIONS)


@click.command(
    "run",
    cls=IdemCommand,
    short_help="Read JSON-lines files as a stream and write them exactly once.",
    help="Reads JSON-lines files from --source as a Spark stream, unions the group's retry "
    "stream and writes through @exactly_once to a Delta sink table and/or a function of "
    "yours. Restartable from its checkpoint.",
)
@_run_options
@handler
@_quiet_py4j
def _run(args: Args) -> int:
    check_source(args.source)
    if not args.sink_delta and not args.sink_fn:
        raise ConfigError("a sink is required: --sink-delta PATH and/or --sink-fn M:F")
    spec = run_spec(args)  # a bad argument is exit 2 before anything starts
    config = config_of(args)
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
    _print_run(args, report)
    if args.report_json:
        Path(args.report_json).write_text(report_json(report), encoding="utf-8")
    if report.interrupted:
        return EXIT_INTERRUPTED
    if args.check and report.sink is not None and not report.sink.exactly_once:
        return EXIT_CHECK_FAILED
    return EXIT_OK


def _print_run(args: Args, report: RunReport) -> None:
    if args.json:
        print_report(report, stream=sys.stderr)
        emit_json(json.loads(report_json(report)))
    else:
        print_report(report)


def _serve_metrics(pipeline: Pipeline, args: Args) -> MetricsServer:
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


def _check_run_paths(args: Args, spec: RunSpec, config: IdemConfig) -> None:
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


def _spark_conf(pairs: Sequence[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--spark-conf: {pair!r} must look like KEY=VALUE")
        out[name.strip()] = value
    return out


# -- idem dlq ----------------------------------------------------------------------------------


def _engine(args: Args) -> RetryEngine:
    config = config_of(args)
    # a file where a Delta table belongs fails deep in delta-rs with a bare OSError
    check_not_a_file(config.resolved_dlq_path, name=path_flag(args, "dlq_path"))
    check_not_a_file(config.resolved_journal_path, name=path_flag(args, "journal_path"))
    return RetryEngine(config, client=check_redis(config.redis_url))


def _selection(args: Args) -> Selection:
    return Selection(
        keys=tuple(args.key or ()),
        msg_ids=tuple(args.msg_id or ()),
        everything=bool(getattr(args, "all", False)),
        include_replayed=bool(getattr(args, "include_replayed", False)),
    )


_DLQ = settings(
    "group", "redis_url", "data_dir", "dlq_path", "journal_path", "delay_levels",
    "max_reconsume_times",
)  # fmt: skip
_KEYS: list[Decorator] = [
    click.option("--key", multiple=True, help="Business key (repeatable)."),
    click.option("--msg-id", multiple=True, help="Msg id or origin msg id (repeatable)."),
]


_keys = apply(*_KEYS)


@click.command("ls", cls=IdemCommand, help="List dead letters, newest first.")
@_DLQ
@click.option(
    "--status",
    default="dead",
    type=click.Choice(["dead", "replayed", "discarded", "all"]),
    help="Rows of this status.",
)
@click.option(
    "--limit", type=NON_NEGATIVE, default=50, help="Show at most this many rows (0: all)."
)
@json_option
@handler
@_quiet_py4j
def _dlq_ls(args: Args) -> int:
    engine = _engine(args)
    if not engine.dlq.exists():
        # a typo in --group or --data-dir must not read as "nothing dead-lettered"
        say(
            args,
            f"%DLQ%{engine.group}: no table at {where(engine.dlq.path)} (nothing dead-lettered "
            f"in this group yet; check {path_flag(args, 'dlq_path')} and --group)",
        )
        if args.json:
            emit_json([])
        return EXIT_OK
    status = None if args.status == "all" else DeadLetterStatus(args.status.upper())
    letters = engine.dlq.list(status=status, limit=args.limit or None)
    if args.json:
        emit_json([describe(d) for d in letters])
        return EXIT_OK
    say(
        args,
        f"%DLQ%{engine.group} at {where(engine.dlq.path)}: {len(letters)} row(s) shown "
        f"(status {args.status})",
    )
    if letters:
        table(
            ["dead at (UTC)", "status", "times", "key", "origin msg id", "last error"],
            table_rows(letters),
        )
    return EXIT_OK


@click.command("show", cls=IdemCommand, help="Show dead letters in full, their rows decoded.")
@_DLQ
@_keys
@json_option
@handler
@_quiet_py4j
def _dlq_show(args: Args) -> int:
    engine = _engine(args)
    wanted = set(args.key or ()) | set(args.msg_id or ())
    if not wanted:
        return fail(EXIT_USAGE, "dlq show: name --key K or --msg-id ID")
    letters = [
        d
        for d in engine.dlq.list()
        if d.key in wanted or d.msg_id in wanted or d.origin_msg_id in wanted
    ]
    if args.json:
        emit_json([describe(d) for d in letters])
    else:
        for d in letters:
            print(json.dumps(describe(d), indent=2, ensure_ascii=False, default=str))
    found = {name for d in letters for name in (d.key, d.msg_id, d.origin_msg_id)}
    return _unknown(list(wanted - found))


def _unknown(names: Sequence[str]) -> int:
    """Exit 1 naming the keys / msg ids that match no dead letter (the rest were done)."""
    if not names:
        return EXIT_OK
    return fail(EXIT_ERROR, f"no dead letter with key/msg id {', '.join(sorted(names))}")


_SELECT: list[Decorator] = [
    _DLQ,
    _keys,
    click.option("--all", "all", is_flag=True, help="Every DEAD row of the group."),
    click.option(
        "--by",
        help="Who does it, recorded in the table's replayed_by.  [default: user@host]",
    ),
]


_select = apply(*_SELECT)


@click.command("replay", cls=IdemCommand, help="Send dead letters back through the dedup layer.")
@_select
@click.option(
    "--include-replayed",
    is_flag=True,
    help="Also send rows replayed before (keys completed within the dedup window are "
    "still suppressed).",
)
@json_option
@handler
@_quiet_py4j
def _dlq_replay(args: Args) -> int:
    selection = _selection(args)
    if selection.empty:
        return fail(EXIT_USAGE, "dlq replay: name --key K, --msg-id ID or --all")
    engine = _engine(args)
    with progress(f"replaying dead letters of %DLQ%{engine.group}") as steps:
        result = replay(engine, selection, by=args.by, progress=steps.update)
    if args.json:
        emit_json(
            {
                "group": engine.group,
                "selected": result.selected,
                "sent": result.sent,
                "dead_again": result.dead_again,
                "marked_replayed": result.marked,
                "skipped_replayed": result.skipped_replayed,
                "unknown": sorted(result.unknown),
            }
        )
    say(
        args,
        f"replayed {result.sent} dead letter(s) of %DLQ%{engine.group} through the retry path "
        f"(dedup applies: a key completed meanwhile is not applied again); "
        f"marked {result.marked} REPLAYED",
    )
    if result.skipped_replayed:
        say(
            args,
            f"{result.skipped_replayed} matching row(s) were replayed before and were left "
            "alone (--include-replayed sends them again; keys completed within the dedup "
            "window are still suppressed)",
        )
    if result.selected == 0:
        say(args, "nothing to replay")
    return _unknown(result.unknown)


@click.command("discard", cls=IdemCommand, help="Mark dead letters DISCARDED.")
@_select
@json_option
@handler
@_quiet_py4j
def _dlq_discard(args: Args) -> int:
    selection = _selection(args)
    if selection.empty:
        return fail(EXIT_USAGE, "dlq discard: name --key K, --msg-id ID or --all")
    engine = _engine(args)
    result = discard(engine, selection, by=args.by)
    if args.json:
        emit_json(
            {
                "group": engine.group,
                "marked_discarded": result.marked,
                "unknown": sorted(result.unknown),
            }
        )
    say(args, f"marked {result.marked} dead letter(s) of %DLQ%{engine.group} DISCARDED")
    return _unknown(result.unknown)


def register(cli: click.Group) -> None:
    """Add ``demo``, ``run`` and ``dlq`` to the ``idem`` command."""
    cli.add_command(_demo)
    cli.add_command(_run)
    dlq = IdemGroup("dlq", help="The %DLQ%<group> table: ls, show, replay, discard.")
    for command in (_dlq_ls, _dlq_show, _dlq_replay, _dlq_discard):
        dlq.add_command(command)
    cli.add_command(dlq)
