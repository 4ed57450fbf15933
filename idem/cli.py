"""The ``idem`` command line.

Subcommands are contributed by each layer through a ``register(subparsers)``
function: the core's own (``ledger``, ``index``, ``acl``, ``stats``), ``idem.retry.cli``
(``schedule``, ``retry``), ``idem.spark.cli`` (``demo``, ``run``, ``dlq``) and
``idem.console.cli`` (``console``). The layers are looked up by name so the core does
not import the layers built on it. When a layer's optional dependency is not installed
(PySpark for ``idem.spark.cli``), its commands are still listed, and running one says
what to install (exit 2).

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
from dataclasses import dataclass
from typing import Protocol, cast

import redis

from idem import __version__
from idem.cli_args import in_flags
from idem.errors import ConfigError, IdemError, StoreUnavailable
from idem.extras import install_hint

LAYERS = (
    "idem.ledger.cli",
    "idem.index_cli",
    "idem.acl_cli",
    "idem.stats_cli",
    "idem.retry.cli",
    "idem.spark.cli",
    "idem.console.cli",
)
"""Modules that may contribute subcommands; a missing one is simply absent."""


@dataclass(frozen=True)
class _OptionalLayer:
    """What a layer needs beyond the core, and the commands it would contribute."""

    module: str
    """The top-level module that may be missing (the ``name`` of the import error)."""
    what: str
    commands: dict[str, str]
    """Each command's name and help line."""
    extra: str
    """The extra that installs ``module``."""
    extra_of: dict[str, str]
    """Commands that need a wider extra than ``extra``."""


_OPTIONAL = {
    "idem.spark.cli": _OptionalLayer(
        module="pyspark",
        what="PySpark",
        commands={
            "demo": "run the whole pipeline on embedded defaults",
            "run": "read JSON-lines files as a stream and write them exactly once",
            "dlq": "the %%DLQ%%<group> table: ls, show, replay, discard",
        },
        extra="spark",
        extra_of={"demo": "demo"},
    ),
}
"""Layers whose commands need more than the core: listed even when that is missing."""


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
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in LAYERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue
            optional = _OPTIONAL.get(name)
            if optional is not None and _missing(exc, optional.module):
                _register_unavailable(subparsers, optional)
                continue
            raise
        register = getattr(module, "register", None)
        if register is not None:
            cast(_Registrar, register)(subparsers)
    return parser


def _missing(error: ModuleNotFoundError, module: str) -> bool:
    """Whether ``error`` is ``module`` (or one of its submodules) not being installed."""
    return error.name is not None and (error.name == module or error.name.startswith(module + "."))


def _register_unavailable(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], layer: _OptionalLayer
) -> None:
    """List ``layer``'s commands; each one, run, names what to install and exits 2."""
    for command, text in layer.commands.items():
        hint = install_hint(layer.extra_of.get(command, layer.extra))
        needs = f"needs {layer.what}: {hint}"
        sub = subparsers.add_parser(
            command, help=f"{text} ({needs})", description=f"{text}; {needs}", add_help=False
        )
        sub.set_defaults(func=_unavailable(command, needs), takes_any_arguments=True)


def _unavailable(command: str, needs: str) -> Handler:
    def run(args: argparse.Namespace) -> int:
        print(f"idem: error: idem {command} {needs}", file=sys.stderr)
        return EXIT_USAGE

    return run


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``idem`` console script."""
    parser = build_parser()
    # an unavailable command takes any arguments: it is to say what to install, not that
    # a flag of the command it stands in for is unknown
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "takes_any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
