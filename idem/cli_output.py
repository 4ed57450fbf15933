"""What ``idem`` commands print: data, prose, tables and progress.

With ``--json`` a command's stdout holds exactly one JSON document, for ``jq`` and
scripts; everything else it says (prose, warnings, progress) goes to stderr. Without
it, data is shown as tables and prose to stdout. Progress bars are drawn on stderr,
and only when stderr is a terminal: a cron job's log or a pipe gets none.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from idem.cli_command import Args

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress


def emit_json(document: Any) -> None:
    """Print ``document`` as the command's one JSON document on stdout."""
    print(json.dumps(document, indent=2, ensure_ascii=False, default=str))


def say(args: Args, text: str) -> None:
    """Prose for the user: stdout, or stderr under ``--json`` (stdout holds only JSON)."""
    print(text, file=sys.stderr if getattr(args, "json", False) else sys.stdout)


def warn(text: str) -> None:
    """A warning: always stderr."""
    print(text, file=sys.stderr)


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """``rows`` as a table on stdout; long cells are folded, never cut."""
    from rich.table import Table  # noqa: PLC0415 -- rich is imported only where it draws
    from rich.text import Text  # noqa: PLC0415

    out = Table(*columns, box=None, header_style="bold", pad_edge=False)
    for row in rows:
        # Text, not str: a key or an error holding "[...]" is shown, not read as markup
        out.add_row(*(Text("" if cell is None else str(cell)) for cell in row))
    _stdout().print(out)


def _stdout() -> Console:
    from rich.console import Console  # noqa: PLC0415 -- see table()

    # a pipe gets the width of COLUMNS or a wide default, so that a cell is not folded
    # to 80 columns for a grep; a terminal gets its own width
    columns = os.environ.get("COLUMNS", "")
    width = None if sys.stdout.isatty() else int(columns) if columns.isdigit() else 200
    return Console(file=sys.stdout, width=width, soft_wrap=False, highlight=False)


def where(path: str) -> str:
    """``path`` as the user should read it in "no table at ...": absolute when local (a
    relative ``--data-dir`` is taken from the working directory, which says where)."""
    if "://" in path:
        return path
    return str(Path(path).resolve())


class Steps:
    """The progress of one long command; each call of :meth:`update` redraws it."""

    def __init__(self, progress: Progress | None, description: str, total: int | None) -> None:
        self._progress = progress
        self._task = None if progress is None else progress.add_task(description, total=total)

    def update(
        self, done: int, total: int | None = None, *, description: str | None = None
    ) -> None:
        """``done`` of ``total`` (``None``: unknown, a spinner); a new ``description``."""
        if self._progress is None or self._task is None:
            return
        fields: dict[str, Any] = {"completed": done}
        if total is not None:
            fields["total"] = total
        if description is not None:
            fields["description"] = description
        self._progress.update(self._task, **fields)

    def stage(self, description: str) -> None:
        """A new stage of a command whose size is unknown (``expire``: delete, vacuum)."""
        self.update(0, description=description)


@contextmanager
def progress(description: str, total: int | None = None) -> Iterator[Steps]:
    """A progress bar on stderr while the block runs; nothing when stderr is no terminal."""
    if not sys.stderr.isatty():
        yield Steps(None, description, total)
        return
    # rich is imported only where it draws: a command's start-up stays quick
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import (  # noqa: PLC0415
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.text import Text  # noqa: PLC0415

    class _Count(MofNCompleteColumn):
        """``done/total``, or nothing while the total is unknown (a spinner's task)."""

        def render(self, task: Task) -> Text:
            return Text("") if task.total is None else super().render(task)

    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        _Count(),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    )
    with bar:
        yield Steps(bar, description, total)
