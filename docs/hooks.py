"""MkDocs hooks: the configuration, command-line and metrics references, made from the code.

A page holding ``<!-- generated: config -->`` gets the table of :class:`idem.IdemConfig`'s
settings (name, type, default, ``IDEM_*`` variable, meaning); one holding
``<!-- generated: cli -->`` gets the help of every ``idem`` subcommand, taken from the
click command tree the console script runs; one holding ``<!-- generated: metrics -->``
gets the table of every Prometheus metric ``idem.metrics`` defines. All three are made at
build time, so they say what the installed code does, never what it did when a page was
written.

The repository's deployment guide, ``deploy/README.md``, is added to the site as the
page ``deploy-recipes.md``, so the site carries it as shipped beside the files it
describes.

A setting's meaning is its docstring in ``idem/config.py`` when it has one, else its
comment in ``deploy/env.example`` (the deployment template, kept field for field in
step with ``IdemConfig`` by the test suite). A setting with neither is a build
warning, which fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import itertools
import logging
import re
from pathlib import Path
from typing import Any

import click
from mkdocs.structure.files import File

from idem import config as idem_config
from idem.cli import build_cli

log = logging.getLogger("mkdocs.hooks.idem")

REPO = Path(__file__).resolve().parent.parent
CONFIG_MARK = "<!-- generated: config -->"
CLI_MARK = "<!-- generated: cli -->"
METRICS_MARK = "<!-- generated: metrics -->"
HELP_WIDTH = 100


RECIPES_PAGE = "deploy-recipes.md"


def on_files(files: Any, config: Any) -> Any:
    """Called by MkDocs once the pages are collected: adds ``deploy/README.md`` as a page."""
    guide = (REPO / "deploy" / "README.md").read_text(encoding="utf-8")
    intro = (
        "!!! note\n"
        "    This page is `deploy/README.md` of the repository; the files it names are in\n"
        "    the repository's `deploy/` folder.\n\n"
    )
    title, _, body = guide.partition("\n")
    files.append(File.generated(config, RECIPES_PAGE, content=f"{title}\n\n{intro}{body}"))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Called by MkDocs for every page before it is rendered: fills in the marks."""
    if CONFIG_MARK in markdown:
        markdown = markdown.replace(CONFIG_MARK, config_table())
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    if METRICS_MARK in markdown:
        markdown = markdown.replace(METRICS_MARK, metrics_table())
    return markdown


def metrics_table() -> str:
    """Every metric idem exposes: name, type, labels, meaning (from ``idem.metrics``)."""
    from idem import metrics  # noqa: PLC0415 -- only the page that asks for it

    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]

    def row(name: str, kind: str, spec: Any) -> None:
        labels = ", ".join(f"`{label}`" for label in spec.labels)
        meaning = spec.help.replace("<", "&lt;")  # %RETRY%<group> is not an HTML tag
        rows.append(f"| `{metrics.PREFIX}{name}` | {kind} | {labels} | {meaning} |")

    for name, spec in metrics.COUNTERS.items():
        row(f"{name}_total", "counter", spec)
    for name, (spec, _buckets) in metrics.HISTOGRAMS.items():
        row(name, "histogram", spec)
    for name, spec in metrics.GAUGES.items():
        row(name, "gauge (group state)", spec)
    return "\n".join(rows)


_ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):<code>(~?)([^<]+)</code>")


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    """Called by MkDocs with each page's HTML: Sphinx roles in docstrings become plain code.

    The docstrings cross-reference with ``:class:`~idem.x.Name``` for readers of the
    source and of ``help()``; on the site the role's name would show as text.
    """
    return _ROLE.sub(
        lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>",
        html,
    )


# -- configuration ---------------------------------------------------------------------


def _field_docstrings(source: str, class_name: str) -> dict[str, str]:
    """Attribute docstrings (a string right after ``name: type = ...``) of one class."""
    tree = ast.parse(source)
    found: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            body = node.body
            for here, after in itertools.pairwise(body):
                if (
                    isinstance(here, ast.AnnAssign)
                    and isinstance(here.target, ast.Name)
                    and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)
                ):
                    found[here.target.id] = " ".join(after.value.value.split())
    return found


def _env_comments(text: str) -> dict[str, str]:
    """The comment block above each ``IDEM_*`` line of ``deploy/env.example``."""
    found: dict[str, str] = {}
    block: list[str] = []
    for line in text.splitlines():
        match = re.match(r"^#?\s*(IDEM_[A-Z_]+)=", line)
        if match:
            found.setdefault(match.group(1), " ".join(block))
            block = []
        elif line.startswith("#"):
            block.append(line.lstrip("#").strip())
        else:
            block = []
    return found


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "*(required)*"
    if value is None:
        return "*(see meaning)*"
    if isinstance(value, enum.Enum):
        value = value.value
    text = f"`{value}`"
    if field.name.endswith("_ms") and isinstance(value, int):
        text += f" ({_human_ms(value)})"
    return text


def _human_ms(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size} {unit}"
    return f"{ms} ms"


def _type_name(field: dataclasses.Field[Any]) -> str:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
    return f"`{kind}`"


def _cell(text: str) -> str:
    """Text for a table cell: ``|`` escaped, and ``<group>`` shown, not taken for HTML."""
    parts = re.split(r"(`+[^`]*`+)", text)  # leave code spans as they are
    return "".join(
        part if part.startswith("`") else part.replace("<", "&lt;").replace(">", "&gt;")
        for part in parts
    ).replace("|", "\\|")


def config_table() -> str:
    """The settings of ``IdemConfig`` as a Markdown table."""
    module = idem_config
    source = Path(module.__file__).read_text(encoding="utf-8")
    docstrings = _field_docstrings(source, "IdemConfig")
    env_file = REPO / "deploy" / "env.example"
    comments = _env_comments(env_file.read_text(encoding="utf-8")) if env_file.exists() else {}
    rows = [
        "| setting | type | default | environment variable | meaning |",
        "|---|---|---|---|---|",
    ]
    for field in dataclasses.fields(module.IdemConfig):
        variable = f"IDEM_{field.name.upper()}"
        meaning = docstrings.get(field.name) or comments.get(variable, "")
        if not meaning:
            log.warning("IdemConfig.%s has no docstring and no comment in env.example", field.name)
        rows.append(
            f"| `{field.name}` | {_cell(_type_name(field))} | {_cell(_default(field))} "
            f"| `{variable}` | {_cell(meaning)} |"
        )
    return "\n".join(rows)


# -- command line ----------------------------------------------------------------------


def cli_reference() -> str:
    """Every ``idem`` command's ``--help``, one section each, in the order of ``idem --help``."""
    out: list[str] = []

    def walk(command: click.Command, path: list[str], depth: int, parent: Any) -> None:
        name = " ".join(path)
        # a fixed width: click wraps to the terminal otherwise
        ctx = command.make_context(
            path[-1],
            [],
            parent=parent,
            resilient_parsing=True,  # no required flag is missing: only help is wanted
            terminal_width=HELP_WIDTH,
            max_content_width=HELP_WIDTH,
        )
        out.append(f"{'#' * min(depth, 4)} `{name}`\n")
        out.append(f"```text\n{command.get_help(ctx).rstrip()}\n```\n")
        if isinstance(command, click.Group):
            for sub_name in command.list_commands(ctx):
                sub = command.get_command(ctx, sub_name)
                if sub is not None:
                    walk(sub, [*path, sub_name], depth + 1, ctx)

    walk(build_cli(), ["idem"], 2, None)
    return "\n".join(out)
