"""Every ``idem ...`` command line the README and the docs show is one the CLI accepts."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from idem.cli import build_cli, parse_args

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
_FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.DOTALL)


def _examples() -> list[tuple[str, str]]:
    """``(page, command line)`` of each ``idem`` line in a fenced block, continuation
    lines joined, the comment, a pipe and ``[optional]`` parts left out."""
    commands = set(build_cli().commands)
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for block in _FENCE.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                words = line.split()
                if len(words) < 2 or words[0] != "idem" or words[1] not in commands:
                    continue
                command = line.split(" #", 1)[0].split(" | ", 1)[0]
                command = re.sub(r"\[[^\]]*\]", "", command)
                found.append((page.relative_to(REPO).as_posix(), command.strip()))
    return found


EXAMPLES = _examples()


def test_the_pages_show_commands() -> None:
    assert len(EXAMPLES) >= 20


@pytest.mark.parametrize(("page", "line"), EXAMPLES, ids=[line for _, line in EXAMPLES])
def test_a_command_line_the_docs_show_is_accepted(page: str, line: str) -> None:
    argv = shlex.split(line)[1:]
    try:
        parse_args(argv)
    except click.UsageError as exc:
        pytest.fail(f"{page}: `{line}` is refused: {exc.format_message()}")
