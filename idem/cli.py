"""The ``idem`` command line.

Commands are contributed by each layer through a ``register(group)`` function that
adds its click commands to the ``idem`` group: the core's own (``ledger``, ``index``,
``acl``, ``stats``), ``idem.retry.cli`` (``schedule``, ``retry``), ``idem.spark.cli``
(``demo``, ``run``, ``dlq``) and ``idem.console.cli`` (``console``). The layers are
looked up by name so the core does not import the layers built on it. When a layer's
optional dependency is not installed (PySpark for ``idem.spark.cli``), its commands are
still listed, and running one says what to install (exit 2).

Exit codes, the same for every command: 0 done; 1 an idem error (the message says
which) or, for ``ledger audit``, keys held more than once; 2 bad arguments or settings
(the message names the flag and the limit); 3 Redis unreachable or failing; 4 the
exactly-once check failed (``demo``, ``run --check``); 130 interrupted.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import click
import redis

from idem import __version__
from idem.cli_command import (
    CONTEXT_SETTINGS,
    EXIT_CHECK_FAILED,
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REDIS,
    EXIT_USAGE,
    PARSE_ONLY,
    PARSED,
    Args,
    IdemGroup,
    configure_logging,
    exit_code,
)
from idem.extras import install_hint

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_REDIS",
    "EXIT_USAGE",
    "LAYERS",
    "build_cli",
    "exit_code",
    "main",
    "parse_args",
]

LAYERS = (
    "idem.ledger.cli",
    "idem.index_cli",
    "idem.acl_cli",
    "idem.stats_cli",
    "idem.retry.cli",
    "idem.spark.cli",
    "idem.console.cli",
)
"""Modules that may contribute commands; a missing one is simply absent."""


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
            "demo": "Run the whole pipeline on embedded defaults.",
            "run": "Read JSON-lines files as a stream and write them exactly once.",
            "dlq": "The %DLQ%<group> table: ls, show, replay, discard.",
        },
        extra="spark",
        extra_of={"demo": "demo"},
    ),
}
"""Layers whose commands need more than the core: listed even when that is missing."""


Register = Callable[[click.Group], None]
"""A layer's ``register``: adds its commands to the ``idem`` group."""


def build_cli() -> click.Group:
    """The ``idem`` group with every available layer's commands."""

    @click.group(
        "idem",
        cls=IdemGroup,
        help="Exactly-once sinks on at-least-once delivery (dedup, retries, DLQ).",
        epilog=EXIT_CODES,
        context_settings=CONTEXT_SETTINGS,
    )
    @click.version_option(
        __version__, "--version", prog_name="idem", message="%(prog)s %(version)s"
    )
    def cli() -> None:
        pass

    for name in LAYERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue
            optional = _OPTIONAL.get(name)
            if optional is not None and _missing(exc, optional.module):
                _register_unavailable(cli, optional)
                continue
            raise
        register = getattr(module, "register", None)
        if register is not None:
            cast(Register, register)(cli)
    return cli


def _missing(error: ModuleNotFoundError, module: str) -> bool:
    """Whether ``error`` is ``module`` (or one of its submodules) not being installed."""
    return error.name is not None and (error.name == module or error.name.startswith(module + "."))


def _register_unavailable(cli: click.Group, layer: _OptionalLayer) -> None:
    """List ``layer``'s commands; each one, run, names what to install and exits 2. It
    takes any arguments: it is to say what to install, not that a flag is unknown."""
    for command, text in layer.commands.items():
        hint = install_hint(layer.extra_of.get(command, layer.extra))
        needs = f"needs {layer.what}: {hint}"
        cli.add_command(
            click.Command(
                command,
                help=f"{text} ({needs})",
                short_help=f"{text} ({needs})",
                callback=_unavailable(command, needs),
                add_help_option=False,
                context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
            )
        )


def _unavailable(command: str, needs: str) -> Callable[[], int]:
    def run() -> int:
        print(f"idem: error: idem {command} {needs}", file=sys.stderr)
        return EXIT_USAGE

    return run


def parse_args(argv: Sequence[str]) -> Args:
    """The arguments ``idem argv`` would run its command with, without running it.

    Raises :class:`click.UsageError` where ``idem argv`` would exit 2 on its arguments.
    """
    cli = build_cli()
    with cli.make_context("idem", list(argv)) as ctx:
        ctx.meta[PARSE_ONLY] = True
        cli.invoke(ctx)
        parsed = ctx.meta.get(PARSED)
    if not isinstance(parsed, Args):
        raise click.UsageError(f"idem {' '.join(argv)}: no command to run")
    return parsed


def _usage_message(error: click.UsageError) -> str:
    """Click's refusal in idem's words: the flag first, then what is wrong with it."""
    if isinstance(error, click.MissingParameter) and error.param is not None:
        return f"{_param_name(error.param)}: required"
    if isinstance(error, click.BadParameter) and error.param is not None:
        return f"{_param_name(error.param)}: {error.message}"
    message = error.format_message()
    return message[:1].lower() + message[1:]


def _param_name(param: click.Parameter) -> str:
    if isinstance(param, click.Option):
        return max(param.opts, key=len)
    return param.human_readable_name


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0911 -- a return per exit code
    """Entry point of the ``idem`` console script: runs ``argv`` (default: the process's
    arguments) and returns the exit code, never exiting the process itself."""
    configure_logging(verbose=False)
    args = list(sys.argv[1:] if argv is None else argv)
    cli = build_cli()
    try:
        result = cli.main(args=args, prog_name="idem", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        if exc.ctx is not None:
            print(exc.ctx.get_help())
        return EXIT_USAGE
    except click.UsageError as exc:
        if exc.ctx is not None:
            print(exc.ctx.get_usage(), file=sys.stderr)
            print(f"Try '{exc.ctx.command_path} --help' for help.", file=sys.stderr)
        print(f"idem: error: {_usage_message(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except click.exceptions.Abort:  # click's word for Ctrl-C (and EOF) while it runs
        return EXIT_INTERRUPTED
    except click.ClickException as exc:
        print(f"idem: error: {exc.format_message()}", file=sys.stderr)
        return exc.exit_code
    except redis.RedisError as exc:
        # a call the command made without wrapping it (a StoreUnavailable would say more);
        # still Redis unreachable or failing, not a bug: exit 3 in one line, as promised
        print(f"idem: error: Redis failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_REDIS
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    # --help and --version end in click's Exit, which standalone_mode=False returns as 0
    return result if isinstance(result, int) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
