"""``idem acl user``: print the Redis ACL line of a consumer group's user.

The line goes into Redis's ACL file (``aclfile``) or, after the user name, into
``ACL SETUSER``. The password is never invented here: it is read from the
environment variable ``--password-env`` names, or the line carries a
``CHANGE-ME`` placeholder to replace.
"""

from __future__ import annotations

import os

import click

from idem.acl import acl_user_line, producer_user_line
from idem.cli_command import Args, IdemCommand, IdemGroup, handler
from idem.cli_options import json_option
from idem.cli_output import emit_json, warn
from idem.errors import ConfigError


@click.command(
    "user",
    cls=IdemCommand,
    short_help="Print the ACL file line of a group's user (or a producer's).",
    help=(
        "Print a Redis ACL file line: a user limited to the group's own keys and "
        "channels, read-only on the topics it consumes, and to the commands idem runs "
        "(no SCAN, KEYS or CONFIG)."
    ),
)
@click.option(
    "--group",
    metavar="G",
    help="Consumer group whose keys the user may use (required unless --producer).",
)
@click.option("--user", help="User name.  [default: idem-<group>]")
@click.option(
    "--topic",
    multiple=True,
    help="A topic the group consumes (read-only), or a producer sends to; repeatable.",
)
@click.option(
    "--write-topic",
    multiple=True,
    help="A topic the group's own code also sends to (read and write); repeatable.",
)
@click.option(
    "--producer", is_flag=True, help="A producer's user: read and write on --topic, no group keys."
)
@click.option(
    "--password-env",
    metavar="VAR",
    help="Environment variable holding the password (else a CHANGE-ME placeholder).",
)
@json_option
@handler
def _user(args: Args) -> int:
    password = None
    if args.password_env is not None:
        password = os.environ.get(args.password_env)
        if password is None:
            raise ConfigError(f"--password-env: the variable {args.password_env} is not set")
    if args.producer:
        if args.user is None:
            raise ConfigError("--user: a producer's user needs a name")
        line = producer_user_line(args.user, topics=list(args.topic), password=password)
    else:
        if args.group is None:
            raise ConfigError("--group: required (or --producer with --user and --topic)")
        line = acl_user_line(
            args.group,
            user=args.user,
            topics=list(args.topic),
            write_topics=list(args.write_topic),
            password=password,
        )
    if args.json:
        emit_json({"line": line, "password_placeholder": password is None})
    else:
        print(line)
    if password is None:
        warn(
            "idem: the line carries a CHANGE-ME password placeholder: replace it "
            "(or pass --password-env VAR)"
        )
    return 0


def register(cli: click.Group) -> None:
    """Add ``idem acl user`` to the ``idem`` command line."""
    acl = IdemGroup("acl", help="Redis ACL users that confine a group to its keys.")
    acl.add_command(_user)
    cli.add_command(acl)
