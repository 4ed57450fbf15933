"""``idem stats --group G [--json]``: one snapshot of everything idem knows about a group.

Each layer contributes its part through a ``stats_section(config, client)`` function
(the resend path, dead letters and the ledger's index from ``idem.retry.group_state``;
the Spark batch totals from ``idem.spark.stats``). The layers are looked up by name,
as the command line's are, so the core does not import the layers built on it; a
layer whose optional dependency is missing (PySpark) is left out and named under
``unavailable``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast

import click

from idem.cli_args import check_not_a_file, check_table_path, config_of, path_flag
from idem.cli_command import Args, IdemCommand, handler
from idem.cli_options import json_option, settings
from idem.cli_output import emit_json
from idem.config import IdemConfig
from idem.redis_client import connect, redacted
from idem.redis_cluster import RedisClient

SECTIONS = ("idem.retry.group_state", "idem.spark.stats")
"""Modules that contribute a part of the snapshot; a missing one is listed as unavailable."""

Section = Callable[[IdemConfig, RedisClient], dict[str, Any]]


def stats_snapshot(config: IdemConfig, *, client: RedisClient | None = None) -> dict[str, Any]:
    """Everything idem knows about ``config.group`` now, as plain JSON-able values.

    Keys: ``group``; ``retry`` (scheduled per delay level, the retry topic, the
    journal's version); ``dlq`` (dead letters by status, and by original topic);
    ``index`` (ledger version and how far Redis's index lags); ``spark`` (the
    group's batch totals: messages, applied, duplicates by cause, retried by level,
    dead, replays); ``unavailable`` (parts left out for a missing dependency).
    """
    own = client is None
    redis_client = connect(config.redis_url) if client is None else client
    snapshot: dict[str, Any] = {"group": config.group}
    unavailable: dict[str, str] = {}
    try:
        for name in SECTIONS:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as exc:
                if exc.name is not None and name.startswith(exc.name):
                    continue  # the layer itself is not installed: it has nothing to say
                unavailable[name] = str(exc)
                continue
            section = cast(Section, module.stats_section)
            snapshot.update(section(config, redis_client))
    finally:
        if own:
            redis_client.close()
    snapshot["unavailable"] = unavailable
    return snapshot


def format_snapshot(snapshot: dict[str, Any]) -> str:
    """The snapshot for a person: one line per part."""
    lines = [f"group {snapshot['group']}"]
    spark = snapshot.get("spark")
    if spark is not None:
        dups = ", ".join(f"{c} {n}" for c, n in sorted(spark["duplicates"].items())) or "none"
        lines.append(
            f"  spark:  {spark['batches']} batch(es), {spark['messages']} message(s), "
            f"{spark['applied']} applied, {spark['duplicates_total']} duplicate(s) ({dups}), "
            f"{spark['busy']} busy, {spark['failed']} failed, {spark['dead']} dead, "
            f"{spark['replayed_batches']} replayed batch(es), "
            f"{spark['dlq_replayed']} replayed from the DLQ"
        )
    retry = snapshot.get("retry")
    if retry is not None:
        levels = ", ".join(f"L{k}: {v}" for k, v in retry["scheduled_by_level"].items()) or "none"
        lines.append(
            f"  retry:  {retry['scheduled']} scheduled ({levels}), "
            f"{retry['retry_topic_undelivered']} waiting in the retry topic, "
            f"{retry['retry_topic_delivered_unacked']} delivered and not acknowledged"
        )
    dlq = snapshot.get("dlq")
    if dlq is not None:
        by_status = ", ".join(f"{s} {n}" for s, n in dlq["by_status"].items()) or "empty"
        lines.append(f"  dlq:    {by_status}")
    index = snapshot.get("index")
    if index is not None:
        lines.append(
            f"  index:  ledger version {index['ledger_version']}, "
            f"{index['buckets_behind']} of {index['buckets']} bucket(s) behind "
            f"(by up to {index['lag_versions']} version(s)), {index['buckets_missing']} "
            f"not indexed yet, {index['held_keys']} key(s) held"
        )
    for name, why in snapshot.get("unavailable", {}).items():
        lines.append(f"  ({name} left out: {why})")
    return "\n".join(lines)


def _config(args: Args) -> IdemConfig:
    config = config_of(args)
    check_table_path(config.resolved_ledger_path, name=path_flag(args, "ledger_path"))
    check_not_a_file(config.resolved_journal_path, name=path_flag(args, "journal_path"))
    check_not_a_file(config.resolved_dlq_path, name=path_flag(args, "dlq_path"))
    return config


@click.command(
    "stats",
    cls=IdemCommand,
    help="Show one snapshot of a group: batches, retries, dead letters, index.",
)
@settings("group", "redis_url", "data_dir", "ledger_path", "journal_path", "dlq_path")
@json_option
@handler
def _stats(args: Args) -> int:
    config = _config(args)
    snapshot = stats_snapshot(config)
    if args.json:
        emit_json(snapshot)
    else:
        print(format_snapshot(snapshot))
        print(f"  (Redis {redacted(config.redis_url)})")
    return 0


def register(cli: click.Group) -> None:
    """Add ``stats`` to the ``idem`` command line."""
    cli.add_command(_stats)
