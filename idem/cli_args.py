"""Checks of command-line values shared by the ``idem`` subcommands.

The argparse ``type=`` callables refuse a bad value while the command line is
parsed (exit 2, argparse names the flag). The path checks run once a command has
resolved its settings, before it touches Redis, Delta or Spark, and raise
:class:`ConfigError` naming the flag (or the setting the path came from).
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from pathlib import Path

from idem.config import IdemConfig, LedgerEngine
from idem.errors import ConfigError
from idem.redis_client import redis_url_problem


def redis_url(text: str) -> str:
    """``--redis-url``: a URL :func:`idem.redis_client.connect` takes."""
    problem = redis_url_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def positive_int(text: str) -> int:
    """A whole number >= 1 (a batch size, a wait in ms)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def port_number(text: str) -> int:
    """A TCP port, 0..65535 (0: any free port)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)")
    return value


def non_negative_int(text: str) -> int:
    """A whole number >= 0 (a retention in hours)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def add_engine_option(parser: argparse.ArgumentParser) -> None:
    """``--engine``: the ledger's Delta engine, for a command that opens the ledger (unset:
    ``IDEM_ENGINE``, else ``auto``, as :meth:`IdemConfig.from_env` resolves it)."""
    parser.add_argument(
        "--engine",
        choices=[e.value for e in LedgerEngine],
        help="the ledger's Delta engine: delta-rs (in this process, no JVM jars), "
        "delta-spark (through the Spark session, which needs Delta's jars), or auto "
        "(delta-spark on a Spark session with Delta's extension and jars, else delta-rs); "
        "default: IDEM_ENGINE, else auto",
    )


_SETTING = re.compile(r"([a-z][a-z_]*): ")


def in_flags(args: argparse.Namespace, error: Exception) -> str:
    """``error``'s message as a shell user reads it: a setting given as a flag is named
    by its flag (``delay_levels: ...`` becomes ``--delay-levels: ...``); a setting that
    came from ``IDEM_*`` or its default keeps its own name."""
    message = str(error)
    found = _SETTING.match(message)
    if not isinstance(error, ConfigError) or found is None:
        return message
    setting = found.group(1)
    if getattr(args, setting, None) is None:
        return message
    return f"--{setting.replace('_', '-')}: {message[found.end() :]}"


def with_ledger_buckets(config: IdemConfig) -> IdemConfig:
    """``config`` with the bucket count its ledger was created with, unless ``IDEM_BUCKETS``
    sets one: a command that looks after an existing ledger needs no setting the ledger
    itself records (a wrong one would be refused; see ``LedgerIdentity``)."""
    if "IDEM_BUCKETS" in os.environ:
        return config
    from idem.ledger.deltars import recorded_identity  # noqa: PLC0415 -- delta-rs is heavy

    found = recorded_identity(config.resolved_ledger_path)
    if found is None or found.buckets == config.buckets:
        return config
    return config.with_changes(buckets=found.buckets)


def path_flag(args: argparse.Namespace, setting: str) -> str:
    """The name to blame for a resolved path setting (``dlq_path``): its own flag when
    given (``--dlq-path``), else ``--data-dir`` it defaults under, else the setting itself
    (set by ``IDEM_*`` or the default)."""
    for attr in (setting, "data_dir"):
        if getattr(args, attr, None) is not None:
            return "--" + attr.replace("_", "-")
    return setting


def _is_uri(path: str) -> bool:
    """An object-store location (``s3://...``): nothing to check locally."""
    return "://" in path


def check_not_a_file(path: str, *, name: str) -> None:
    """A table or directory setting must not name an existing file."""
    if _is_uri(path):
        return
    if not path:
        raise ConfigError(f"{name}: the path is empty")
    if _exists(Path(path)) and not _is_dir(Path(path)):
        raise ConfigError(f"{name}: {path} is a file, not a directory")


def check_table_path(path: str, *, name: str) -> None:
    """A table to read: not a file, nor under one (a missing table under a file would
    read as "no table yet", and a command would answer as if all were well)."""
    check_not_a_file(path, name=name)
    if _is_uri(path):
        return
    nearest = next(p for p in (Path(path), *Path(path).parents) if _exists(p))
    if not _is_dir(nearest):
        raise ConfigError(f"{name}: {path} cannot be a table: {nearest} is a file")


def check_writable_dir(path: str, *, name: str) -> None:
    """``path`` is a directory that takes new entries, or one that can be created."""
    check_not_a_file(path, name=name)
    if _is_uri(path):
        return
    target = Path(path)
    nearest = next(p for p in (target, *target.parents) if _exists(p))
    if nearest == target:
        refused = _write_refused(target)
        if refused is not None:
            raise ConfigError(f"{name}: cannot write in {path} ({refused})")
        return
    if not _is_dir(nearest):
        raise ConfigError(f"{name}: cannot create {path}: {nearest} is a file, not a directory")
    refused = _write_refused(nearest)
    if refused is not None:
        raise ConfigError(f"{name}: cannot create {path} in {nearest} ({refused})")


def check_writable_file(path: str, *, name: str) -> None:
    """``path`` can be written as a file: not a directory, in a directory that takes files."""
    if not path:
        raise ConfigError(f"{name}: the path is empty")
    if _is_dir(Path(path)):
        raise ConfigError(f"{name}: {path} is a directory, not a file")
    parent = Path(path).parent
    if not _is_dir(parent):
        raise ConfigError(f"{name}: cannot write {path}: directory {parent} does not exist")
    refused = _write_refused(parent)
    if refused is not None:
        raise ConfigError(f"{name}: cannot write {path} in {parent} ({refused})")


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; one we may not even look at counts as absent (the write
    check in its directory then says why)."""
    try:
        return path.exists()
    except OSError:
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


def _write_refused(directory: Path) -> str | None:
    """Why ``directory`` takes no new entry (``None``: it does), found by creating and
    removing an empty directory there: permission bits say nothing to root, nor about
    /proc or a read-only mount."""
    try:
        Path(tempfile.mkdtemp(prefix=".idem-write-check-", dir=directory)).rmdir()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
