"""``idem acl user``: print the Redis ACL line of a consumer group's user.

The line goes into Redis's ACL file (``aclfile``) or, after the user name, into
``ACL SETUSER``. The password is never invented here: it is read from the
environment variable ``--password-env`` names, or the line carries a
``CHANGE-ME`` placeholder to replace.
"""

from __future__ import annotations

import argparse
import os
import sys

from idem.acl import acl_user_line, producer_user_line
from idem.errors import ConfigError


def _user(args: argparse.Namespace) -> int:
    password = None
    if args.password_env is not None:
        password = os.environ.get(args.password_env)
        if password is None:
            raise ConfigError(f"--password-env: the variable {args.password_env} is not set")
    if args.producer:
        if args.user is None:
            raise ConfigError("--user: a producer's user needs a name")
        line = producer_user_line(args.user, topics=args.topic, password=password)
    else:
        if args.group is None:
            raise ConfigError("--group: required (or --producer with --user and --topic)")
        line = acl_user_line(
            args.group,
            user=args.user,
            topics=args.topic,
            write_topics=args.write_topic,
            password=password,
        )
    print(line)
    if password is None:
        print(
            "idem: the line carries a CHANGE-ME password placeholder: replace it "
            "(or pass --password-env VAR)",
            file=sys.stderr,
        )
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``idem acl user`` to the ``idem`` command line."""
    acl = subparsers.add_parser("acl", help="Redis ACL users that confine a group to its keys")
    commands = acl.add_subparsers(dest="acl_command", metavar="ACTION", required=True)
    user = commands.add_parser(
        "user",
        help="print the ACL file line of a group's user (or a producer's)",
        description=(
            "Print a Redis ACL file line: a user limited to the group's own keys and "
            "channels, read-only on the topics it consumes, and to the commands idem runs "
            "(no SCAN, KEYS or CONFIG)."
        ),
    )
    user.add_argument("--group", help="consumer group whose keys the user may use")
    user.add_argument("--user", help="user name (default idem-<group>)")
    user.add_argument(
        "--topic",
        action="append",
        default=[],
        help="a topic the group consumes (read-only), or a producer sends to; repeatable",
    )
    user.add_argument(
        "--write-topic",
        action="append",
        default=[],
        help="a topic the group's own code also sends to (read and write); repeatable",
    )
    user.add_argument(
        "--producer",
        action="store_true",
        help="a producer's user: read and write on --topic, no group keys",
    )
    user.add_argument(
        "--password-env",
        metavar="VAR",
        help="environment variable holding the password (else a CHANGE-ME placeholder)",
    )
    user.set_defaults(func=_user)
