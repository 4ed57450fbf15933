"""``idem schedule`` and ``idem retry {rebuild,compact,stats}``.

``idem schedule --group G`` runs the group's schedule service in the
foreground until interrupted (SIGINT / SIGTERM); it exits 1 if the service's
thread ever ends on its own (the service outlives Redis's errors, so that is a
bug, and a supervisor should restart the process); with ``--metrics-port`` it also
serves its metrics, the group's state gauges and the ``/healthz`` and ``/readyz``
probes. ``idem retry rebuild``
clears the group's Redis side and rebuilds it from the Delta retry journal;
``idem retry compact`` snapshots the live messages into the journal so that
rebuilds start from the snapshot instead of version 0; ``idem retry stats``
prints what is scheduled, in the retry topic and in the journal; ``idem retry
audit`` checks that no message is both retrying and dead and that Redis holds
what the journal holds live (exit 1 when not).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from dataclasses import asdict
from types import FrameType

import click

from idem.cli_args import check_not_a_file, config_of, path_flag
from idem.cli_command import EXIT_INTERRUPTED, Args, IdemCommand, IdemGroup, handler
from idem.cli_options import POSITIVE, json_option, metrics_options, settings
from idem.cli_output import emit_json, progress, say, table, where
from idem.config import IdemConfig
from idem.errors import ConfigError, StoreUnavailable, UnsafeRedisConfig
from idem.metrics import MetricsServer, StateCollector, serve
from idem.redis_client import redacted
from idem.retry.audit import audit_group
from idem.retry.engine import RetryEngine
from idem.retry.group_state import read_group
from idem.retry.schedule import DEFAULT_BATCH_SIZE, DEFAULT_MAX_IDLE_MS, ScheduleService

log = logging.getLogger(__name__)

_RETRY = settings("group", "redis_url", "delay_levels", "data_dir", "journal_path", "dlq_path")


def _config(args: Args) -> IdemConfig:
    config = config_of(args)
    # a file where a Delta table belongs fails deep in delta-rs with a bare OSError
    check_not_a_file(config.resolved_journal_path, name=path_flag(args, "journal_path"))
    check_not_a_file(config.resolved_dlq_path, name=path_flag(args, "dlq_path"))
    return config


@click.command(
    "schedule",
    cls=IdemCommand,
    help="Run the schedule service of a consumer group until interrupted.",
)
@_RETRY
@click.option(
    "--batch-size", type=POSITIVE, default=DEFAULT_BATCH_SIZE, help="Messages moved per Lua call."
)
@click.option(
    "--max-idle-ms",
    type=POSITIVE,
    default=DEFAULT_MAX_IDLE_MS,
    help="Longest wait without looking at the queues.",
)
@metrics_options("Address the metrics port listens on (0.0.0.0 in a pod).")
@handler
def _schedule(args: Args) -> int:
    engine = RetryEngine(_config(args))
    try:
        engine.check()  # an evicting Redis would drop scheduled retries silently
    except StoreUnavailable as exc:  # the service outlives an outage, so it starts unchecked
        log.warning(
            "could not check Redis's maxmemory-policy (%s); make sure it is 'noeviction'", exc
        )
    except UnsafeRedisConfig:
        engine.close()
        raise
    service = engine.schedule_service(batch_size=args.batch_size, max_idle_ms=args.max_idle_ms)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()
        service.stop(timeout=0)

    signal.signal(signal.SIGTERM, on_signal)
    print(
        f"idem schedule: group {engine.group}, {redacted(engine.config.redis_url)}, "
        f"levels {engine.config.delay_levels}",
        file=sys.stderr,
        flush=True,
    )
    service.start()
    server = None
    if args.metrics_port is not None:
        try:
            server = schedule_metrics(
                engine, service, host=args.metrics_host, port=args.metrics_port
            )
        except ModuleNotFoundError as exc:
            service.stop()
            engine.close()
            raise ConfigError(f"--metrics-port: {exc}") from exc
        except OSError as exc:  # the port is taken, or the address is not this host's
            service.stop()
            engine.close()
            raise ConfigError(
                f"--metrics-port: cannot listen on {args.metrics_host}:{args.metrics_port}: "
                f"{exc.strerror or exc}"
            ) from exc
        print(f"idem schedule: metrics on {server.url}/metrics", file=sys.stderr, flush=True)
    code = 0
    try:
        while not stop.wait(0.5):
            if not service.alive and not stop.is_set():
                # the service logs and outlives Redis's errors; this is a bug: exit, so that
                # a supervisor (systemd, Kubernetes) restarts the process and someone looks
                print(
                    f"idem schedule: error: the schedule service of group {engine.group} "
                    f"stopped: {_describe(service.failure)}; exiting",
                    file=sys.stderr,
                    flush=True,
                )
                code = 1
                break
    except KeyboardInterrupt:  # stopped cleanly, but by Ctrl-C: 130, as every idem command
        code = EXIT_INTERRUPTED
    finally:
        service.stop()
        if server is not None:
            server.close()
        print(f"idem schedule: moved {service.moved_total} message(s)", file=sys.stderr)
        engine.close()
    return code


def schedule_metrics(
    engine: RetryEngine, service: ScheduleService, *, host: str, port: int
) -> MetricsServer:
    """Serve the schedule service's metrics, the group's state gauges, and its probes.

    ``/healthz`` fails once the service's thread has ended (the process should be
    restarted); ``/readyz`` also fails while its moving loop fails in a row (Redis away
    or refusing writes).
    """

    def healthy() -> str | None:
        if service.alive:
            return None
        return f"schedule service of group {engine.group} stopped: {_describe(service.failure)}"

    def ready() -> str | None:
        problem = healthy()
        if problem is None and service.failing is not None:
            failing = service.failing
            problem = f"moving due messages fails: {type(failing).__name__}: {failing}"
        return problem

    state = StateCollector(engine.group, lambda: read_group(engine).gauges())
    return serve(port, host=host, collectors=[state], healthy=healthy, ready=ready)


def _describe(failure: BaseException | None) -> str:
    if failure is None:
        return "its thread ended without an error"
    return f"{type(failure).__name__}: {failure}"


@click.command(
    "rebuild",
    cls=IdemCommand,
    help="Clear the group's Redis side and rebuild it from the retry journal.",
)
@_RETRY
@json_option
@handler
def _rebuild(args: Args) -> int:
    engine = RetryEngine(_config(args))
    try:
        path = engine.journal.path
        if engine.journal.latest_version() is None:
            # a mistyped path: the rebuild would clear Redis and rebuild it from nothing
            say(
                args,
                f"idem retry rebuild: no retry journal at {where(path)} yet, "
                "nothing to rebuild from; Redis left as it is",
            )
            if args.json:
                emit_json({"group": engine.group, "journal_path": path, "rebuilt": False})
            return 0
        with progress(f"rebuilding the retry side of group {engine.group} from {where(path)}"):
            result = engine.rebuild()
        pending = engine.pending()
        if args.json:
            emit_json(
                {
                    "group": engine.group,
                    "journal_path": path,
                    "rebuilt": True,
                    "scheduled": result.scheduled,
                    "removed": result.removed,
                    "pending": pending,
                }
            )
        else:
            say(
                args,
                f"rebuilt {engine.group} from {where(path)}: {result.scheduled} scheduled, "
                f"{result.removed} removed, {pending} pending",
            )
    finally:
        engine.close()
    return 0


@click.command(
    "compact",
    cls=IdemCommand,
    help="Snapshot the live messages into the retry journal so rebuilds start there.",
)
@_RETRY
@json_option
@handler
def _compact(args: Args) -> int:
    engine = RetryEngine(_config(args))
    try:
        path = engine.journal.path
        with progress(f"compacting the retry journal at {where(path)}"):
            base = engine.compact_journal()
        if base is None:
            say(args, f"{engine.group}: no retry journal at {where(path)} yet")
            if args.json:
                emit_json({"group": engine.group, "journal_path": path, "compacted": False})
        elif args.json:
            emit_json(
                {
                    "group": engine.group,
                    "journal_path": path,
                    "compacted": True,
                    "live": len(base.live),
                    "covers": base.covers,
                    "version": base.version,
                }
            )
        else:
            say(
                args,
                f"compacted {where(path)}: {len(base.live)} live message(s) as of "
                f"version {base.covers}, written at version {base.version}; a rebuild now "
                f"reads from version {base.covers + 1}",
            )
    finally:
        engine.close()
    return 0


@click.command(
    "stats", cls=IdemCommand, help="Show scheduled / retrying counts, the cursor, the journal."
)
@_RETRY
@json_option
@handler
def _stats(args: Args) -> int:
    engine = RetryEngine(_config(args))
    try:
        stats = asdict(engine.stats())
    finally:
        engine.close()
    if args.json:
        emit_json(stats)
        return 0
    rows = [(name, value) for name, value in _flat(stats)]
    table(["", "value"], rows)
    return 0


@click.command(
    "audit",
    cls=IdemCommand,
    help="Check that no message is both retrying and dead, and Redis matches the journal; "
    "exit 1 if not.",
)
@_RETRY
@json_option
@handler
def _audit(args: Args) -> int:
    engine = RetryEngine(_config(args))
    try:
        with progress(f"auditing the resend path of group {engine.group}"):
            audit = audit_group(engine)
    finally:
        engine.close()
    doubled = sorted(audit.doubled)
    mismatch = sorted(audit.redis_journal_mismatch)
    if args.json:
        emit_json(
            {
                "group": engine.group,
                "retrying": len(audit.retrying),
                "journal_retrying": len(audit.journal_retrying),
                "dead": len(audit.dead),
                "retrying_and_dead": doubled,
                "redis_vs_journal": mismatch,
                "ok": audit.ok,
            }
        )
    else:
        rows = [(origin, "retrying and dead") for origin in doubled]
        rows += [
            (origin, "live in Redis only" if origin in audit.retrying else "live in journal only")
            for origin in mismatch
        ]
        if rows:
            table(["origin msg id", "problem"], rows)
        say(
            args,
            f"idem retry audit: {len(audit.retrying)} retrying, {len(audit.dead)} dead; "
            f"{len(doubled)} both retrying and dead, {len(mismatch)} where Redis and the "
            "journal disagree" + ("" if audit.ok else "; idem retry rebuild settles both"),
        )
    return 0 if audit.ok else 1


def _flat(values: dict[str, object], prefix: str = "") -> list[tuple[str, object]]:
    """Nested stats as ``redis.live``-style rows."""
    out: list[tuple[str, object]] = []
    for name, value in values.items():
        if isinstance(value, dict):
            out.extend(_flat(value, f"{prefix}{name}."))
        else:
            out.append((f"{prefix}{name}", value))
    return out


def register(cli: click.Group) -> None:
    """Add ``schedule`` and ``retry`` to the ``idem`` command line."""
    cli.add_command(_schedule)
    retry = IdemGroup("retry", help="The resend path: rebuild, compact, stats, audit.")
    for command in (_rebuild, _compact, _stats, _audit):
        retry.add_command(command)
    cli.add_command(retry)
