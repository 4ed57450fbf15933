"""How an ``idem`` command runs: its exit codes, its arguments, ``-v`` anywhere.

Every command of every layer is an :class:`IdemCommand` in an :class:`IdemGroup`, so
each accepts ``-v``/``--verbose`` and ``-h``/``--help`` wherever they stand on the
command line, and lists its commands in the order they were added. A command's
function is wrapped by :func:`handler`: it gets its arguments as one namespace and
returns its exit code; an :class:`IdemError` it raises becomes one line naming the
flag (see :func:`idem.cli_args.in_flags`) and the code of the table below.

Exit codes, the same for every command: 0 done; 1 an idem error (the message says
which) or, for ``ledger audit``, keys held more than once (``retry audit``: messages
both retrying and dead); 2 bad arguments or settings
(the message names the flag and the limit); 3 Redis unreachable or failing; 4 the
exactly-once check failed (``demo``, ``run --check``); 130 interrupted.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import click
import redis

from idem.cli_args import in_flags
from idem.errors import ConfigError, IdemError, StoreUnavailable

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_REDIS = 3
EXIT_CHECK_FAILED = 4
EXIT_INTERRUPTED = 130

EXIT_CODES = (
    "Exit codes: 0 done; 1 an idem error (ledger audit: keys held more than once; "
    "retry audit: messages both retrying and dead); "
    "2 bad arguments or settings; 3 Redis unreachable; 4 the exactly-once check failed; "
    "130 interrupted."
)

Args = SimpleNamespace
"""A command's arguments, by their Python names (``--data-dir`` is ``args.data_dir``)."""

Handler = Callable[[Args], int]
"""A command's function: takes its arguments, returns its exit code."""

CONTEXT_SETTINGS: dict[str, Any] = {
    "help_option_names": ["-h", "--help"],
    "max_content_width": 100,
    "show_default": True,
}

PARSE_ONLY = "idem.parse_only"
"""A context ``meta`` flag: commands store their arguments under :data:`PARSED` instead
of running (:func:`idem.cli.parse_args`)."""
PARSED = "idem.parsed"


def exit_code(error: IdemError) -> int:
    """The exit code of a failure the user can act on (see the module's table)."""
    if isinstance(error, ConfigError):
        return EXIT_USAGE
    if isinstance(error, StoreUnavailable):
        return EXIT_REDIS
    return EXIT_ERROR


def fail(code: int, message: str) -> int:
    """Print ``idem: error: message`` to stderr and return ``code``."""
    print(f"idem: error: {message}", file=sys.stderr)
    return code


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


_HANDLERS: list[logging.Handler] = []
"""The one stderr handler of this process, made on first use (on the stderr of then)."""


def configure_logging(*, verbose: bool) -> None:
    """INFO to stderr, an explained failure in one line; ``verbose``: DEBUG, tracebacks.

    Called by :func:`idem.cli.main` before a command runs, and again by ``-v``; a process
    whose logging is set up already (an embedding application, a test run) keeps its
    own handlers.
    """
    if not _HANDLERS:
        _HANDLERS.append(logging.StreamHandler())
        logging.basicConfig(level=logging.INFO, handlers=_HANDLERS)
    _HANDLERS[0].setFormatter((logging.Formatter if verbose else _Formatter)(_LOG_FORMAT))
    if verbose:
        logging.getLogger().setLevel(logging.DEBUG)


def _verbose(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        configure_logging(verbose=True)


def _verbose_option() -> click.Option:
    return click.Option(
        ["-v", "--verbose"],
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=_verbose,
        help="Log at DEBUG level, with tracebacks (accepted after any command).",
    )


class IdemCommand(click.Command):
    """A command that takes ``-v`` and ``-h`` as every other one does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("context_settings", CONTEXT_SETTINGS)
        super().__init__(*args, **kwargs)
        self.params.append(_verbose_option())


class IdemGroup(click.Group):
    """A group of commands, listed in the order they were added (as a layer adds them)."""

    command_class = IdemCommand

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("context_settings", CONTEXT_SETTINGS)
        super().__init__(*args, **kwargs)
        self.params.append(_verbose_option())

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


IdemGroup.group_class = IdemGroup


def handler(func: Handler) -> Callable[..., int]:
    """A click callback running ``func`` with the command's arguments as one namespace.

    An :class:`IdemError` is printed in one line naming the flag the setting came from,
    and returned as its exit code; under :func:`idem.cli.parse_args` nothing runs.
    """

    @functools.wraps(func)
    def callback(**params: Any) -> int:
        args = Args(**params)
        ctx = click.get_current_context()
        if ctx.meta.get(PARSE_ONLY):
            ctx.meta[PARSED] = args
            return EXIT_OK
        try:
            return int(func(args))
        except IdemError as exc:
            return fail(exit_code(exc), in_flags(args, exc))

    return callback
