"""``idem index {status,rebuild}``: look after the Redis index of a group's ledger.

Redis is an index over the Delta ledger (docs/pages/protocol.md, "Step 3"). ``status`` shows,
per bucket, the ledger version Redis has indexed and how many completed keys it
holds; ``rebuild`` reloads the dedup window from the ledger, e.g. to warm a new
or flushed Redis before traffic returns (claims would otherwise rebuild each
bucket on first use, in the batch that touches it). Both print JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from idem.cli import EXIT_ERROR
from idem.cli_args import check_table_path, path_flag, redis_url, with_ledger_buckets
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.hotstore import RedisHotStore
from idem.index_status import index_status, open_index

_CONFIG_OPTIONS = ("group", "data_dir", "ledger_path", "redis_url")


def _dedup(args: argparse.Namespace) -> tuple[Dedup, RedisHotStore]:
    overrides: dict[str, Any] = {
        name: getattr(args, name) for name in _CONFIG_OPTIONS if getattr(args, name) is not None
    }
    config = IdemConfig.from_env(**overrides)
    check_table_path(config.resolved_ledger_path, name=path_flag(args, "ledger_path"))
    return open_index(with_ledger_buckets(config))


def _status(args: argparse.Namespace) -> int:
    status = index_status(*_dedup(args))
    for b in status.buckets:
        print(
            json.dumps(
                {
                    "bucket": b.bucket,
                    "indexed_version": b.indexed_version,
                    "keys": b.keys,
                    "state": b.state,
                }
            )
        )
    version = status.ledger_version
    print(
        f"idem index status: group {status.group!r}, ledger version {version}, "
        f"{status.held} completed key(s) held, {status.to_catch_up} of {len(status.buckets)} "
        "bucket(s) to catch up or rebuild"
    )
    if status.ahead:
        print(
            f"idem index status: {status.ahead} bucket(s) indexed versions past this ledger's "
            f"({version}): Redis indexes another table, or this one was replaced. A Delta "
            f"sink's table is its own ledger: pass --ledger-path TABLE "
            f"(this one is {status.ledger_path})",
            file=sys.stderr,
        )
        return EXIT_ERROR
    return 0


def _rebuild(args: argparse.Namespace) -> int:
    dd, hot = _dedup(args)
    if dd.ledger.version() < 0:  # nothing to load; and --all would drop the real marks
        print(
            f"idem index rebuild: no ledger at {dd.ledger.path} yet, nothing to rebuild from "
            "(a Delta sink's table is its own ledger: pass --ledger-path TABLE)"
        )
        return 0
    if args.all:
        # refused (ConfigError) when the group's index covers another ledger: before the
        # drop, or every bucket would be left to rebuild on the next batch
        hot.bind_ledger(dd.ledger.path)
        for bucket in range(hot.buckets):
            hot.drop_watermark(bucket)
    started = time.perf_counter()
    version = dd.catch_up()
    print(
        json.dumps(
            {
                "ledger_version": version,
                "rebuilt_buckets": dd.stats.rebuilt_buckets,
                "rebuilt_keys": dd.stats.rebuilt_keys,
                "caught_up_versions": dd.stats.caught_up_versions,
                "caught_up_keys": dd.stats.caught_up_keys,
                "seconds": round(time.perf_counter() - started, 3),
            }
        )
    )
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``idem index ...`` to the ``idem`` command line."""
    index = subparsers.add_parser("index", help="inspect and rebuild the Redis index of a ledger")
    commands = index.add_subparsers(dest="index_command", metavar="ACTION", required=True)

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=help_text)
        parser.add_argument("--group", help="consumer group (IDEM_GROUP)")
        parser.add_argument(
            "--redis-url", type=redis_url, help="Redis holding the index (IDEM_REDIS_URL)"
        )
        parser.add_argument("--data-dir", help="where the group's tables live (IDEM_DATA_DIR)")
        parser.add_argument("--ledger-path", help="the ledger table (IDEM_LEDGER_PATH)")
        return parser

    command("status", "indexed ledger version and completed keys held, per bucket").set_defaults(
        func=_status
    )
    rebuild = command(
        "rebuild", "load what Redis misses from the ledger (missing or lagging buckets)"
    )
    rebuild.add_argument(
        "--all", action="store_true", help="rebuild every bucket from the window, not only gaps"
    )
    rebuild.set_defaults(func=_rebuild)
