"""``idem ledger {version,audit,expire,compact}``: look after a group's Delta ledger.

``audit`` lists keys the ledger holds more than once (the narrow failover
hole of docs/pages/guarantees.md) and exits 1 when there are any, so a cron job can alert;
``expire --older-than 30d`` deletes whole days older than that and vacuums;
``compact`` merges the small per-batch files of past days.

These run with delta-rs, in this process. A ledger written by delta-spark is
refused, naming what to run instead: its writes (expire, compact) belong to
its own engine, in a Spark job with Delta's jars.
"""

from __future__ import annotations

import click

from idem.cli_args import check_table_path, config_of, path_flag, with_ledger_buckets
from idem.cli_command import Args, IdemCommand, IdemGroup, handler
from idem.cli_options import NON_NEGATIVE, json_option, settings
from idem.cli_output import emit_json, progress, say, table, where
from idem.clock import SYSTEM_CLOCK
from idem.config import IdemConfig, LedgerEngine, parse_duration_ms
from idem.errors import ConfigError
from idem.ledger.base import Ledger, open_ledger


def _config(args: Args) -> IdemConfig:
    config = config_of(args)
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


def _no_ledger(args: Args, command: str, ledger: Ledger) -> None:
    """Say where a command looked and found no ledger: a mistyped ``--data-dir`` should
    not read as an empty ledger."""
    say(
        args,
        f"idem ledger {command}: no ledger at {where(ledger.path)} yet (nothing completed there)",
    )


_LEDGER = settings("group", "data_dir", "ledger_path")


@click.command("version", cls=IdemCommand, help="Print the ledger's current Delta version.")
@_LEDGER
@json_option
@handler
def _version(args: Args) -> int:
    ledger = _open(_config(args), "version", "version()")
    version = ledger.version()
    if version < 0:
        _no_ledger(args, "version", ledger)
    if args.json:
        emit_json({"path": ledger.path, "version": version})
    elif version >= 0:
        say(args, f"ledger at {where(ledger.path)}: version {version}")
    return 0


@click.command("audit", cls=IdemCommand, help="List keys held more than once; exit 1 if any.")
@_LEDGER
@click.option("--since", metavar="DURATION", help="Only rows completed within this long, e.g. 7d.")
@json_option
@handler
def _audit(args: Args) -> int:
    since = None  # checked first: a bad flag is an error even where there is no ledger
    if args.since is not None:
        since = SYSTEM_CLOCK.now_ms() - parse_duration_ms(args.since, setting="--since")
    ledger = _open(_config(args), "audit", "audit(since_ms=...)")
    exists = ledger.version() >= 0
    if not exists:
        _no_ledger(args, "audit", ledger)
    repeated = ledger.audit(since_ms=since) if exists else []
    if args.json:
        emit_json(
            {
                "path": ledger.path,
                "exists": exists,
                "since_ms": since,
                "repeated": [{"key": key, "count": count} for key, count in repeated],
            }
        )
    elif repeated:
        table(["key", "count"], repeated)
    if exists:
        say(args, f"idem ledger audit: {len(repeated)} key(s) held more than once")
    return 1 if repeated else 0


@click.command("expire", cls=IdemCommand, help="Delete days older than --older-than, then vacuum.")
@_LEDGER
@click.option(
    "--older-than",
    required=True,
    metavar="DURATION",
    help="Delete whole days older than this, e.g. 30d (keep the dedup window).",
)
@click.option(
    "--vacuum-retention-hours",
    type=NON_NEGATIVE,
    default=168,
    help="Keep unreferenced files this long for readers still on old versions.",
)
@json_option
@handler
def _expire(args: Args) -> int:
    config = _config(args)
    older = parse_duration_ms(args.older_than, setting="--older-than")
    if older < config.dedup_window_ms:
        raise ConfigError(
            f"--older-than: {args.older_than} is inside the dedup window "
            f"({config.dedup_window_ms} ms); a Redis rebuild would miss those keys"
        )
    ledger = _open(config, "expire", "expire(older_than_ms, vacuum_retention_hours=...)")
    if ledger.version() < 0:  # a mistyped --data-dir should not read as "0 rows deleted"
        _no_ledger(args, "expire", ledger)
        if args.json:
            emit_json({"path": ledger.path, "deleted_rows": 0, "version": -1})
        return 0
    with progress(f"expiring days older than {args.older_than}, then vacuuming"):
        deleted = ledger.expire(
            SYSTEM_CLOCK.now_ms() - older, vacuum_retention_hours=args.vacuum_retention_hours
        )
    version = ledger.version()
    if args.json:
        emit_json({"path": ledger.path, "deleted_rows": deleted, "version": version})
    else:
        say(
            args,
            f"expired {where(ledger.path)}: {deleted} row(s) deleted, now at version {version}",
        )
    return 0


@click.command("compact", cls=IdemCommand, help="Merge the small per-batch files of past days.")
@_LEDGER
@json_option
@handler
def _compact(args: Args) -> int:
    ledger = _open(_config(args), "compact", "compact()")
    if ledger.version() < 0:
        _no_ledger(args, "compact", ledger)
        if args.json:
            emit_json({"path": ledger.path, "files_removed": 0, "files_added": 0})
        return 0
    with progress("compacting the files of past days"):
        result = ledger.compact()
    if args.json:
        emit_json(
            {
                "path": ledger.path,
                "files_removed": result.files_removed,
                "files_added": result.files_added,
            }
        )
    else:
        say(
            args,
            f"compacted {where(ledger.path)}: {result.files_removed} file(s) merged into "
            f"{result.files_added}",
        )
    return 0


def register(cli: click.Group) -> None:
    """Add ``idem ledger ...`` to the ``idem`` command line."""
    ledger = IdemGroup("ledger", help="Inspect and maintain a group's Delta ledger.")
    for command in (_version, _audit, _expire, _compact):
        ledger.add_command(command)
    cli.add_command(ledger)
