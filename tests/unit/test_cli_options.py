"""The options every ``idem`` command shares: ``-v`` anywhere, help naming ``IDEM_*``."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from idem.cli import build_cli, main

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _no_idem_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("IDEM_")]:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _root_level_restored() -> Iterator[None]:
    """``-v`` sets the process's root logger to DEBUG, as it should for a command; the
    tests after these run in the same process and must not log at DEBUG (redis-py's
    debug line on a failed call reads connection details a fake client lacks)."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


def _leaves(command: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(command, click.Group):
        return [
            leaf for name, sub in command.commands.items() for leaf in _leaves(sub, (*path, name))
        ]
    return [path]


@pytest.mark.parametrize(
    "argv",
    [
        ["-v", "ledger", "version"],
        ["ledger", "-v", "version"],
        ["ledger", "version", "-v"],
        ["ledger", "version", "--verbose", "--json"],
    ],
    ids=" ".join,
)
def test_verbose_is_accepted_anywhere(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    code = main([*argv, "--group", "g", "--data-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "no ledger at" in out + err


@pytest.mark.parametrize("path", _leaves(build_cli()), ids=" ".join)
def test_every_command_takes_verbose_and_short_help(
    capsys: pytest.CaptureFixture[str], path: tuple[str, ...]
) -> None:
    assert main([*path, "-h"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Usage: idem {' '.join(path)} ")
    assert "-v, --verbose" in out


@pytest.mark.parametrize(
    ("command", "variable"),
    [
        (["ledger", "audit"], "IDEM_LEDGER_PATH"),
        (["index", "status"], "IDEM_REDIS_URL"),
        (["retry", "stats"], "IDEM_DELAY_LEVELS"),
        (["dlq", "ls"], "IDEM_DLQ_PATH"),
        (["run"], "IDEM_ENGINE"),
    ],
)
def test_help_names_the_variable_and_default_of_a_setting(
    capsys: pytest.CaptureFixture[str], command: list[str], variable: str
) -> None:
    assert main([*command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"[env: {variable}; default: " in out
    assert "[env: IDEM_GROUP]" in out


def test_a_setting_flag_wins_over_its_variable(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IDEM_GROUP", "from-env")
    monkeypatch.setenv("IDEM_DATA_DIR", str(tmp_path / "env"))
    assert main(["ledger", "version", "--json"]) == 0
    assert f"{tmp_path}/env/from-env/ledger" in capsys.readouterr().out
    assert main(["ledger", "version", "--json", "--group", "flag"]) == 0
    assert f"{tmp_path}/env/flag/ledger" in capsys.readouterr().out
