"""The ``idem`` command line.

Subcommands are contributed by each layer through a ``register(subparsers)``
function: the core's own (``ledger``, ``index``), ``idem.retry.cli`` (``schedule``,
``retry``) and ``idem.spark.cli`` (``demo``, ``run``, ``dlq``). The layers are
looked up by name so the core does not import the layers built on it.

Exit codes, the same for every subcommand: 0 done; 1 an idem error (the
message says which) or, for ``ledger audit``, keys held more than once; 2 bad
arguments or settings (the message names the flag and the limit); 3 Redis
unreachable or failing; 4 the exactly-once check failed (``demo``, ``run
--check``); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import redis

from idem.cli_args import in_flags
from idem.errors import ConfigError, IdemError, StoreUnavailable

LAYERS = ("idem.ledger.cli", "idem.index_cli", "idem.acl_cli", "idem.retry.cli", "idem.spark.cli")
"""Modules that may contribute subcommands; a missing one is simply absent."""


class _Registrar(Protocol):
    def __call__(self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None: ...


Handler = Callable[[argparse.Namespace], int]
"""A subcommand: sets ``func`` with ``parser.set_defaults(func=...)`` and returns an exit code."""


EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_REDIS = 3
EXIT_CHECK_FAILED = 4
EXIT_INTERRUPTED = 130

_EPILOG = (
    "exit codes: 0 done; 1 an idem error (ledger audit: keys held more than once); "
    "2 bad arguments or settings; 3 Redis unreachable; 4 the exactly-once check failed; "
    "130 interrupted"
)


def exit_code(error: IdemError) -> int:
    """The exit code of a failure the user can act on (see the module's table)."""
    if isinstance(error, ConfigError):
        return EXIT_USAGE
    if isinstance(error, StoreUnavailable):
        return EXIT_REDIS
    return EXIT_ERROR


_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_EXPLAINED = (IdemError, redis.RedisError)
"""Failures whose message says what went wrong: logged without their traceback (``-v``
shows it); any other exception is a bug, and its traceback is what a report needs."""


class _Formatter(logging.Formatter):
    """One line per record: an explained failure's traceback becomes its type and message."""

    def format(self, record: logging.LogRecord) -> str:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, _EXPLAINED):
            record = logging.makeLogRecord(
                {
                    **record.__dict__,
                    "msg": f"{record.getMessage()} ({type(error).__name__}: {error})",
                    "args": None,
                    "exc_info": None,
                    "exc_text": None,
                }
            )
        return super().format(record)


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every available layer's subcommands."""
    parser = argparse.ArgumentParser(
        prog="idem",
        description="Exactly-once sinks on at-least-once delivery (dedup, retries, DLQ).",
        epilog=_EPILOG,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in LAYERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue
            raise
        register = getattr(module, "register", None)
        if register is not None:
            cast(_Registrar, register)(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``idem`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter((logging.Formatter if args.verbose else _Formatter)(_LOG_FORMAT))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    func = cast("Handler | None", getattr(args, "func", None))
    if func is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        return func(args)
    except IdemError as exc:
        print(f"idem: error: {in_flags(args, exc)}", file=sys.stderr)
        return exit_code(exc)
    except redis.RedisError as exc:
        # a call the command made without wrapping it (a StoreUnavailable would say more);
        # still Redis unreachable or failing, not a bug: exit 3 in one line, as promised
        print(f"idem: error: Redis failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_REDIS
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
