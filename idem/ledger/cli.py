"""``idem ledger {version,audit,expire,compact}``: look after a group's Delta ledger.

``audit`` lists keys the ledger holds more than once (the narrow failover
hole of DESIGN §1) and exits 1 when there are any, so a cron job can alert;
``expire --older-than 30d`` deletes whole days older than that and vacuums;
``compact`` merges the small per-batch files of past days.

These run with delta-rs, in this process. A ledger written by delta-spark is
refused, naming what to run instead: its writes (expire, compact) belong to
its own engine, in a Spark job with Delta's jars.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from idem.cli_args import check_table_path, non_negative_int, path_flag, with_ledger_buckets
from idem.clock import SYSTEM_CLOCK
from idem.config import IdemConfig, LedgerEngine, parse_duration_ms
from idem.errors import ConfigError
from idem.ledger.base import Ledger, open_ledger

_CONFIG_OPTIONS = ("group", "data_dir", "ledger_path")


def _config(args: argparse.Namespace) -> IdemConfig:
    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in _CONFIG_OPTIONS if getattr(args, name) is not None
    }
    config = IdemConfig.from_env(**overrides)
    # a file there would read as "no ledger yet": an empty audit that exits 0
    check_table_path(config.resolved_ledger_path, name=path_flag(args, "ledger_path"))
    return with_ledger_buckets(config)


def _open(config: IdemConfig, command: str, call: str) -> Ledger:
    """The ledger, opened with delta-rs; refused when delta-spark writes it."""
    from idem.ledger.deltars import recorded_engine  # noqa: PLC0415 -- delta-rs is heavy

    path = config.resolved_ledger_path
    writer = recorded_engine(path)
    if writer is not None and writer != LedgerEngine.DELTA_RS.value:
        raise ConfigError(
            f"ledger_path: the ledger at {path} is written by {writer}; `idem ledger "
            f"{command}` runs delta-rs. Run it from a Spark job with Delta's jars instead: "
            f"idem.ledger.open_ledger(config, {writer!r}).{call}"
        )
    return open_ledger(config, LedgerEngine.DELTA_RS)


def _version(args: argparse.Namespace) -> int:
    ledger = _open(_config(args), "version", "version()")
    print(json.dumps({"path": ledger.path, "version": ledger.version()}))
    return 0


def _audit(args: argparse.Namespace) -> int:
    since = None  # checked first: a bad flag is an error even where there is no ledger
    if args.since is not None:
        since = SYSTEM_CLOCK.now_ms() - parse_duration_ms(args.since, setting="--since")
    ledger = _open(_config(args), "audit", "audit(since_ms=...)")
    if ledger.version() < 0:  # a mistyped --data-dir should not read as a clean audit
        print(f"idem ledger audit: no ledger at {ledger.path} yet (nothing completed there)")
        return 0
    repeated = ledger.audit(since_ms=since)
    for key, count in repeated:
        print(json.dumps({"key": key, "count": count}))
    print(f"idem ledger audit: {len(repeated)} key(s) held more than once")
    return 1 if repeated else 0


def _expire(args: argparse.Namespace) -> int:
    config = _config(args)
    older = parse_duration_ms(args.older_than, setting="--older-than")
    if older < config.dedup_window_ms:
        raise ConfigError(
            f"--older-than: {args.older_than} is inside the dedup window "
            f"({config.dedup_window_ms} ms); a Redis rebuild would miss those keys"
        )
    ledger = _open(config, "expire", "expire(older_than_ms, vacuum_retention_hours=...)")
    deleted = ledger.expire(
        SYSTEM_CLOCK.now_ms() - older, vacuum_retention_hours=args.vacuum_retention_hours
    )
    print(json.dumps({"deleted_rows": deleted, "version": ledger.version()}))
    return 0


def _compact(args: argparse.Namespace) -> int:
    ledger = _open(_config(args), "compact", "compact()")
    result = ledger.compact()
    print(json.dumps({"files_removed": result.files_removed, "files_added": result.files_added}))
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``idem ledger ...`` to the ``idem`` command line."""
    ledger = subparsers.add_parser("ledger", help="inspect and maintain a group's Delta ledger")
    commands = ledger.add_subparsers(dest="ledger_command", metavar="ACTION", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help_text)
        parser.add_argument("--group", help="consumer group (IDEM_GROUP)")
        parser.add_argument("--data-dir", help="where the group's tables live (IDEM_DATA_DIR)")
        parser.add_argument("--ledger-path", help="the ledger table (IDEM_LEDGER_PATH)")
        return parser

    command("version", "print the ledger's current Delta version").set_defaults(func=_version)
    audit = command("audit", "list keys held more than once; exit 1 if any")
    audit.add_argument("--since", help="only rows completed within this long, e.g. 7d")
    audit.set_defaults(func=_audit)
    expire = command("expire", "delete days older than --older-than, then vacuum")
    expire.add_argument("--older-than", required=True, help="e.g. 30d (keep the dedup window)")
    expire.add_argument(
        "--vacuum-retention-hours",
        type=non_negative_int,
        default=168,
        help="keep unreferenced files this long for readers still on old versions (168)",
    )
    expire.set_defaults(func=_expire)
    command("compact", "merge the small per-batch files of past days").set_defaults(func=_compact)
