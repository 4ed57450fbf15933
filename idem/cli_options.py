"""The options ``idem`` commands share, each declared once here.

A setting of :class:`idem.IdemConfig` is a flag named after it (``data_dir`` is
``--data-dir``); its help shows the ``IDEM_*`` variable it falls back to and the
default after that. The variables are read by :meth:`IdemConfig.from_env`, not by the
command line, so a bad value names the variable it came from and a flag always wins.
``--group`` is required the same way by every command that works on a group: a flag,
else ``IDEM_GROUP``, else exit 2 saying both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, TypeVar

import click

from idem.config import IdemConfig, LedgerEngine
from idem.delay_levels import DEFAULT_MAX_RECONSUME_TIMES, DelayLevels
from idem.redis_client import redis_url_problem

F = TypeVar("F", bound=Callable[..., Any])


class RedisUrl(click.ParamType[str]):
    """``--redis-url``: a URL :func:`idem.redis_client.connect` takes."""

    name = "URL"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        problem = redis_url_problem(str(value))
        if problem is not None:
            self.fail(problem, param, ctx)
        return str(value)


class WholeNumber(click.ParamType[int]):
    """A whole number ``>= low`` (a batch size, a wait in ms, a retention in hours)."""

    name = "N"

    def __init__(self, low: int) -> None:
        self.low = low

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value >= self.low:
            return value
        try:
            number = int(str(value))
        except ValueError:
            number = self.low - 1
        if number < self.low:
            self.fail(f"{str(value)!r} is not a whole number >= {self.low}", param, ctx)
        return number


POSITIVE = WholeNumber(1)
NON_NEGATIVE = WholeNumber(0)


class PortNumber(click.ParamType[int]):
    """A TCP port, 0 to 65535 (0: any free port)."""

    name = "PORT"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535:
            return value
        try:
            number = int(str(value))
        except ValueError:
            number = -1
        if not 0 <= number <= 65535:
            self.fail(f"{str(value)!r} is not a port number (0 to 65535)", param, ctx)
        return number


PORT = PortNumber()


def _default(setting: str) -> str:
    """A setting's default as :class:`IdemConfig` declares it."""
    found = next(f for f in fields(IdemConfig) if f.name == setting)
    return str(found.default)


def _setting_help(text: str, setting: str, default: str | None) -> str:
    shown = f"; default: {default}" if default else ""
    return f"{text}  [env: IDEM_{setting.upper()}{shown}]"


def _path_default(table: str) -> str:
    return f"<data_dir>/<group>/{table}"


_SETTINGS: dict[str, Callable[[], click.Option]] = {
    "group": lambda: click.Option(
        ["--group"],
        metavar="G",
        help=_setting_help(
            "The consumer group (required: this flag or the variable).", "group", None
        ),
    ),
    "redis_url": lambda: click.Option(
        ["--redis-url"],
        type=RedisUrl(),
        help=_setting_help(
            "Redis of the group: redis://, rediss://, unix:// or redis+cluster://.",
            "redis_url",
            _default("redis_url"),
        ),
    ),
    "data_dir": lambda: click.Option(
        ["--data-dir"],
        metavar="DIR",
        help=_setting_help(
            "Where the group's Delta tables live (a relative one is taken from the "
            "working directory).",
            "data_dir",
            _default("data_dir"),
        ),
    ),
    "ledger_path": lambda: click.Option(
        ["--ledger-path"],
        metavar="TABLE",
        help=_setting_help("The group's Delta ledger.", "ledger_path", _path_default("ledger")),
    ),
    "journal_path": lambda: click.Option(
        ["--journal-path"],
        metavar="TABLE",
        help=_setting_help(
            "The retry journal's Delta table.", "journal_path", _path_default("retry-journal")
        ),
    ),
    "dlq_path": lambda: click.Option(
        ["--dlq-path"],
        metavar="TABLE",
        help=_setting_help("The %DLQ%<group> Delta table.", "dlq_path", _path_default("dlq")),
    ),
    "delay_levels": lambda: click.Option(
        ["--delay-levels"],
        metavar="LEVELS",
        help=_setting_help(
            'messageDelayLevel, e.g. "1s 5s 10s 30s 1m".', "delay_levels", str(DelayLevels.parse())
        ),
    ),
    "max_reconsume_times": lambda: click.Option(
        ["--max-reconsume-times"],
        type=int,
        metavar="N",
        help=_setting_help(
            "Retries before the DLQ.", "max_reconsume_times", str(DEFAULT_MAX_RECONSUME_TIMES)
        ),
    ),
    "engine": lambda: click.Option(
        ["--engine"],
        type=click.Choice([e.value for e in LedgerEngine]),
        help=_setting_help(
            "The ledger's Delta engine: delta-rs (in this process, no JVM jars), delta-spark "
            "(through the Spark session, which needs Delta's jars), or auto (delta-spark on a "
            "Spark session with Delta's extension and jars, else delta-rs).",
            "engine",
            LedgerEngine.AUTO.value,
        ),
    ),
}


Decorator = Callable[[Any], Any]


def apply(*decorators: Decorator) -> Decorator:
    """Several option decorators as one, applied so that help lists them in this order."""

    def add(func: Any) -> Any:
        for decorate in reversed(decorators):
            func = decorate(func)
        return func

    return add


def settings(*names: str) -> Callable[[F], F]:
    """Add the flags of these :class:`IdemConfig` settings to a command, in this order."""
    unknown = set(names) - set(_SETTINGS)
    if unknown:
        raise ValueError(f"no shared option for {sorted(unknown)}")

    def add(func: F) -> F:
        params: list[click.Parameter] = getattr(func, "__click_params__", [])
        # click reverses the decorators' list: add in reverse for the help to read in order
        params.extend(_SETTINGS[name]() for name in reversed(names))
        func.__click_params__ = params  # type: ignore[attr-defined]
        return func

    return add


SETTING_NAMES = tuple(_SETTINGS)
"""The settings a command can take as flags, in :class:`IdemConfig`'s spelling."""


json_option = click.option(
    "--json",
    "json",
    is_flag=True,
    help="Print one JSON document on stdout (messages and progress go to stderr).",
)
"""``--json``: for every command that prints data."""


def metrics_options(host_help: str) -> Decorator:
    """``--metrics-port`` and ``--metrics-host``: for a command that serves ``/metrics``,
    ``/healthz`` and ``/readyz`` while it runs (no port: nothing is served)."""
    return apply(
        click.option(
            "--metrics-port",
            type=PORT,
            help="Serve /metrics, /healthz and /readyz on this port while running "
            "(0: any free one).",
        ),
        click.option("--metrics-host", metavar="ADDRESS", default="127.0.0.1", help=host_help),
    )
