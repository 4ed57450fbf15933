"""``idem console``: serve the web console of one consumer group until interrupted.

Bound to 127.0.0.1 unless ``--host`` names another address. Replay and discard
need the token: ``--token``, else ``IDEM_CONSOLE_TOKEN``, else one generated at
start and printed to stderr.
"""

from __future__ import annotations

import os
import sys

import click

from idem.cli_args import check_not_a_file, check_table_path, config_of, path_flag
from idem.cli_command import EXIT_INTERRUPTED, EXIT_OK, Args, IdemCommand, handler
from idem.cli_options import PORT, settings
from idem.config import IdemConfig
from idem.errors import ConfigError
from idem.extras import install_hint
from idem.retry.dlq import current_user
from idem.retry.engine import RetryEngine

TOKEN_ENV = "IDEM_CONSOLE_TOKEN"  # noqa: S105 -- a variable's name, not a secret
"""Environment variable the token is read from when ``--token`` is not given."""

MIN_TOKEN_CHARS = 16
"""A shorter token given by the user is refused: it could be guessed."""

DEFAULT_PORT = 8742


def console_config(args: Args) -> IdemConfig:
    """The group's settings from the flags, then ``IDEM_*``; paths checked before use."""
    config = config_of(args)
    check_not_a_file(config.resolved_dlq_path, name=path_flag(args, "dlq_path"))
    check_not_a_file(config.resolved_journal_path, name=path_flag(args, "journal_path"))
    check_table_path(config.resolved_ledger_path, name=path_flag(args, "ledger_path"))
    return config


def console_token(given: str | None) -> tuple[str, bool]:
    """The token, and whether it was generated here (then it must be shown to the user)."""
    from idem.console.server import new_token  # noqa: PLC0415 -- only when serving

    token = given if given is not None else os.environ.get(TOKEN_ENV)
    if token is None or token == "":
        return new_token(), True
    if len(token) < MIN_TOKEN_CHARS:
        source = "--token" if given is not None else TOKEN_ENV
        raise ConfigError(
            f"{source}: the console token must be at least {MIN_TOKEN_CHARS} characters, "
            f"got {len(token)}"
        )
    return token, False


@click.command(
    "console",
    cls=IdemCommand,
    short_help="A web console of one group: retries, dead letters (replay, discard), "
    "duplicates, index lag.",
    help="Serves a web console of one consumer group until interrupted. Reads are open to "
    "whoever reaches the address; replay and discard need the token.",
)
@settings(
    "group", "redis_url", "data_dir", "dlq_path", "journal_path", "ledger_path", "delay_levels"
)
@click.option(
    "--host",
    default="127.0.0.1",
    metavar="ADDRESS",
    help="Address to bind (anything but a loopback address exposes the console).",
)
@click.option("--port", type=PORT, default=DEFAULT_PORT, help="Port (0: any free one).")
@click.option(
    "--token",
    metavar="TOKEN",
    help=f"The token replay and discard need.  [default: {TOKEN_ENV}, else generated and printed]",
)
@click.option(
    "--by",
    metavar="WHO",
    help="Who acts when a form names no one.  [default: user@host of the console]",
)
@click.option(
    "--sample-seconds",
    type=float,
    default=60.0,
    metavar="SECONDS",
    help="How often the duplicate counters are sampled for the page.",
)
@handler
def _console(args: Args) -> int:
    try:
        # the dead letters' rows are decoded, and replayed, by the Spark glue's code
        from idem.console.data import GroupView  # noqa: PLC0415
        from idem.console.server import Console, is_loopback, serve  # noqa: PLC0415
        from idem.spark.run import check_redis  # noqa: PLC0415
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("pyspark"):
            raise
        raise ConfigError(f"idem console needs PySpark: {install_hint('spark')}") from None

    config = console_config(args)
    token, generated = console_token(args.token)
    if args.sample_seconds <= 0:
        raise ConfigError(f"--sample-seconds: must be > 0, got {args.sample_seconds}")
    view = GroupView(config, engine=RetryEngine(config, client=check_redis(config.redis_url)))
    loopback = is_loopback(args.host)
    console = Console(
        view=view, token=token, default_by=args.by or current_user(), loopback_only=loopback
    )
    try:
        server = serve(console, args.host, args.port)
    except OSError as exc:
        view.close()
        raise ConfigError(
            f"--host/--port: cannot listen on {args.host}:{args.port}: {exc}"
        ) from None
    if not loopback:
        print(
            f"idem console: listening on {args.host}, not a loopback address: anyone who can "
            "reach it can read the group's dead letters",
            file=sys.stderr,
        )
    if generated:
        print(f"idem console: token {token}", file=sys.stderr)
    print(f"idem console: group {config.group} at {server.url}", file=sys.stderr, flush=True)
    server.start_sampling(args.sample_seconds)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    finally:
        server.server_close()
        view.close()
    return EXIT_OK


def register(cli: click.Group) -> None:
    """Add ``console`` to the ``idem`` command line."""
    cli.add_command(_console)
