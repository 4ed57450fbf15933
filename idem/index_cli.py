"""``idem index {status,rebuild}``: look after the Redis index of a group's ledger.

Redis is an index over the Delta ledger (docs/pages/protocol.md, "Step 3"). ``status`` shows,
per bucket, the ledger version Redis has indexed and how many completed keys it
holds; ``rebuild`` reloads the dedup window from the ledger, e.g. to warm a new
or flushed Redis before traffic returns (claims would otherwise rebuild each
bucket on first use, in the batch that touches it). Both print JSON with ``--json``.
"""

from __future__ import annotations

import time

import click

from idem.cli_args import check_table_path, config_of, path_flag, with_ledger_buckets
from idem.cli_command import EXIT_ERROR, Args, IdemCommand, IdemGroup, handler
from idem.cli_options import json_option, settings
from idem.cli_output import emit_json, progress, say, table, warn, where
from idem.dedup import Dedup
from idem.hotstore import RedisHotStore
from idem.index_status import index_status, open_index


def _dedup(args: Args) -> tuple[Dedup, RedisHotStore]:
    config = config_of(args)
    check_table_path(config.resolved_ledger_path, name=path_flag(args, "ledger_path"))
    return open_index(with_ledger_buckets(config))


_INDEX = settings("group", "redis_url", "data_dir", "ledger_path")


@click.command(
    "status",
    cls=IdemCommand,
    help="Show the indexed ledger version and the completed keys held, per bucket.",
)
@_INDEX
@json_option
@handler
def _status(args: Args) -> int:
    status = index_status(*_dedup(args))
    version = status.ledger_version
    buckets = [
        {
            "bucket": b.bucket,
            "indexed_version": b.indexed_version,
            "keys": b.keys,
            "state": b.state,
        }
        for b in status.buckets
    ]
    if args.json:
        emit_json(
            {
                "group": status.group,
                "ledger_path": status.ledger_path,
                "ledger_version": version,
                "keys": status.held,
                "to_catch_up": status.to_catch_up,
                "ahead": status.ahead,
                "buckets": buckets,
            }
        )
    else:
        table(
            ["bucket", "indexed version", "keys", "state"],
            [
                (
                    b["bucket"],
                    "-" if b["indexed_version"] is None else b["indexed_version"],
                    b["keys"],
                    b["state"],
                )
                for b in buckets
            ],
        )
    say(
        args,
        f"idem index status: group {status.group!r}, ledger version {version}, "
        f"{status.held} completed key(s) held, {status.to_catch_up} of {len(status.buckets)} "
        "bucket(s) to catch up or rebuild",
    )
    if status.ahead:
        warn(
            f"idem index status: {status.ahead} bucket(s) indexed versions past this ledger's "
            f"({version}): Redis indexes another table, or this one was replaced. A Delta "
            f"sink's table is its own ledger: pass --ledger-path TABLE "
            f"(this one is {where(status.ledger_path)})"
        )
        return EXIT_ERROR
    return 0


@click.command(
    "rebuild",
    cls=IdemCommand,
    help="Load what Redis misses from the ledger (missing or lagging buckets).",
)
@_INDEX
@click.option(
    "--all", "all", is_flag=True, help="Rebuild every bucket from the window, not only gaps."
)
@json_option
@handler
def _rebuild(args: Args) -> int:
    dd, hot = _dedup(args)
    if dd.ledger.version() < 0:  # nothing to load; and --all would drop the real marks
        say(
            args,
            f"idem index rebuild: no ledger at {where(dd.ledger.path)} yet, nothing to rebuild "
            "from (a Delta sink's table is its own ledger: pass --ledger-path TABLE)",
        )
        if args.json:
            emit_json({"ledger_path": dd.ledger.path, "ledger_version": -1, **_NOTHING_DONE})
        return 0
    if args.all:
        # refused (ConfigError) when the group's index covers another ledger: before the
        # drop, or every bucket would be left to rebuild on the next batch
        hot.bind_ledger(dd.ledger.path)
        for bucket in range(hot.buckets):
            hot.drop_watermark(bucket)
    started = time.perf_counter()
    with progress(f"rebuilding the index of group {hot.group} from {where(dd.ledger.path)}"):
        version = dd.catch_up()
    report = {
        "ledger_path": dd.ledger.path,
        "ledger_version": version,
        "rebuilt_buckets": dd.stats.rebuilt_buckets,
        "rebuilt_keys": dd.stats.rebuilt_keys,
        "caught_up_versions": dd.stats.caught_up_versions,
        "caught_up_keys": dd.stats.caught_up_keys,
        "seconds": round(time.perf_counter() - started, 3),
    }
    if args.json:
        emit_json(report)
    else:
        say(
            args,
            f"rebuilt the index of group {hot.group} to ledger version {version}: "
            f"{report['rebuilt_keys']} key(s) in {report['rebuilt_buckets']} bucket(s) "
            f"rebuilt, {report['caught_up_keys']} key(s) of {report['caught_up_versions']} "
            f"version(s) caught up, in {report['seconds']} s",
        )
    return 0


_NOTHING_DONE = {
    "rebuilt_buckets": 0,
    "rebuilt_keys": 0,
    "caught_up_versions": 0,
    "caught_up_keys": 0,
    "seconds": 0.0,
}


def register(cli: click.Group) -> None:
    """Add ``idem index ...`` to the ``idem`` command line."""
    index = IdemGroup("index", help="Inspect and rebuild the Redis index of a ledger.")
    index.add_command(_status)
    index.add_command(_rebuild)
    cli.add_command(index)
