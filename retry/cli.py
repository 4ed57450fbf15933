"""``idem schedule`` and ``idem retry {rebuild,compact,stats}``.

``idem schedule --group G`` runs the group's schedule service in the
foreground until interrupted (SIGINT / SIGTERM); it exits 1 if the service's
thread ever ends on its own (the service outlives Redis's errors, so that is a
bug, and a supervisor should restart the process). ``idem retry rebuild``
clears the group's Redis side and rebuilds it from the Delta retry journal;
``idem retry compact`` snapshots the live messages into the journal so that
rebuilds start from the snapshot instead of version 0; ``idem retry stats``
prints what is scheduled, in the retry topic and in the journal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import asdict
from types import FrameType
from typing import Any

from idem.cli import EXIT_INTERRUPTED
from idem.cli_args import check_not_a_file, path_flag, port_number, positive_int, redis_url
from idem.config import IdemConfig
from idem.errors import ConfigError, StoreUnavailable, UnsafeRedisConfig
from idem.metrics import MetricsServer, StateCollector, serve
from idem.redis_client import redacted
from idem.retry.engine import RetryEngine
from idem.retry.group_state import read_group
from idem.retry.schedule import DEFAULT_BATCH_SIZE, DEFAULT_MAX_IDLE_MS, ScheduleService

log = logging.getLogger(__name__)

_CONFIG_OPTIONS = {
    "group": "group",
    "redis_url": "redis_url",
    "delay_levels": "delay_levels",
    "data_dir": "data_dir",
    "journal_path": "journal_path",
    "dlq_path": "dlq_path",
}


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--group",
        required=not os.environ.get("IDEM_GROUP"),
        help="consumer group (default: IDEM_GROUP)",
    )
    parser.add_argument(
        "--redis-url", type=redis_url, help="redis:// or rediss:// URL (IDEM_REDIS_URL)"
    )
    parser.add_argument("--delay-levels", help='messageDelayLevel, e.g. "1s 5s 10s 30s 1m ... 2h"')
    parser.add_argument("--data-dir", help="where the group's Delta tables live by default")
    parser.add_argument("--journal-path", help="the retry journal's Delta table")
    parser.add_argument("--dlq-path", help="the %%DLQ%%<group> Delta table")


def _config(args: argparse.Namespace) -> IdemConfig:
    overrides: dict[str, Any] = {
        setting: getattr(args, attr)
        for attr, setting in _CONFIG_OPTIONS.items()
        if getattr(args, attr, None) is not None
    }
    config = IdemConfig.from_env(**overrides)
    # a file where a Delta table belongs fails deep in delta-rs with a bare OSError
    check_not_a_file(config.resolved_journal_path, name=path_flag(args, "journal_path"))
    check_not_a_file(config.resolved_dlq_path, name=path_flag(args, "dlq_path"))
    return config


def _schedule(args: argparse.Namespace) -> int:
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


def _rebuild(args: argparse.Namespace) -> int:
    engine = RetryEngine(_config(args))
    try:
        if engine.journal.latest_version() is None:
            # a mistyped path: the rebuild would clear Redis and rebuild it from nothing
            print(
                f"idem retry rebuild: no retry journal at {engine.journal.path} yet, "
                "nothing to rebuild from; Redis left as it is"
            )
            return 0
        result = engine.rebuild()
        print(
            f"rebuilt {engine.group} from {engine.journal.path}: "
            f"{result.scheduled} scheduled, {result.removed} removed, "
            f"{engine.pending()} pending"
        )
    finally:
        engine.close()
    return 0


def _compact(args: argparse.Namespace) -> int:
    engine = RetryEngine(_config(args))
    try:
        base = engine.compact_journal()
        if base is None:
            print(f"{engine.group}: no retry journal at {engine.journal.path} yet")
        else:
            print(
                f"compacted {engine.journal.path}: {len(base.live)} live message(s) as of "
                f"version {base.covers}, written at version {base.version}; a rebuild now "
                f"reads from version {base.covers + 1}"
            )
    finally:
        engine.close()
    return 0


def _stats(args: argparse.Namespace) -> int:
    engine = RetryEngine(_config(args))
    try:
        stats = engine.stats()
        print(json.dumps(asdict(stats), indent=2, default=str))
    finally:
        engine.close()
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``schedule`` and ``retry`` to the ``idem`` command line."""
    schedule = subparsers.add_parser(
        "schedule", help="run the schedule service of a consumer group until interrupted"
    )
    _add_config_options(schedule)
    schedule.add_argument(
        "--batch-size",
        type=positive_int,
        default=DEFAULT_BATCH_SIZE,
        help="messages moved per Lua call",
    )
    schedule.add_argument(
        "--max-idle-ms",
        type=positive_int,
        default=DEFAULT_MAX_IDLE_MS,
        help="longest wait without looking at the queues",
    )
    schedule.add_argument(
        "--metrics-port",
        type=port_number,
        help="serve /metrics, /healthz and /readyz on this port (0: any free one)",
    )
    schedule.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics port listens on (default 127.0.0.1; 0.0.0.0 in a pod)",
    )
    schedule.set_defaults(func=_schedule)

    retry = subparsers.add_parser("retry", help="the resend path: rebuild, compact, stats")
    commands = retry.add_subparsers(dest="retry_command", metavar="ACTION", required=True)
    rebuild = commands.add_parser(
        "rebuild", help="clear the group's Redis side and rebuild it from the retry journal"
    )
    _add_config_options(rebuild)
    rebuild.set_defaults(func=_rebuild)
    compact = commands.add_parser(
        "compact",
        help="snapshot the live messages into the retry journal so rebuilds start there",
    )
    _add_config_options(compact)
    compact.set_defaults(func=_compact)
    stats = commands.add_parser("stats", help="scheduled / retrying counts, cursor, journal")
    _add_config_options(stats)
    stats.set_defaults(func=_stats)
