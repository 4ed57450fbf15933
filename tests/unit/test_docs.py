"""The README is an entry page a newcomer can read, and it and the sources point only
at things the repository holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_README_LINES = 200

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_SOURCE_SUFFIXES = {".py", ".lua", ".sh", ".md", ".yaml", ".yml", ".conf", ".toml"}
_SOURCE_DIRS = ("idem", "retry", "spark", "tests", "bench", "deploy", "docs", ".ci")
_CITED = "design".upper()  # spelt so that grepping the repository for it finds citations only


def _relative_links(text: str) -> list[str]:
    return [
        target
        for target in _LINK.findall(text)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")
    ]


@pytest.mark.unit
def test_readme_is_an_entry_page_of_at_most_200_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert 20 < len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


@pytest.mark.unit
def test_readme_speaks_of_idem_not_of_how_it_is_developed() -> None:
    text = README.read_text(encoding="utf-8")
    prose = text.lower().replace("sparksession", "")  # Spark's class name is not a session
    found = [
        word
        for word in (_CITED, "design.md", "session", "earlier run", "the seeds")
        if (word in text if word.isupper() else word in prose)
    ]
    assert found == []


@pytest.mark.unit
def test_every_relative_link_in_the_readme_resolves_to_a_file_in_the_repository() -> None:
    links = _relative_links(README.read_text(encoding="utf-8"))
    assert len(links) >= 10  # the docs table and the guarantees' tests at least
    missing = [link for link in links if not (REPO / link.split("#", 1)[0]).resolve().exists()]
    assert missing == []


@pytest.mark.unit
def test_the_link_checker_sees_a_broken_link() -> None:
    links = _relative_links("[a](docs/nope.md) [b](https://example.org) [c](#here) [d](tests)")
    assert links == ["docs/nope.md", "tests"]
    assert not (REPO / links[0]).exists()


@pytest.mark.unit
def test_no_source_or_doc_cites_a_document_the_repository_does_not_hold() -> None:
    this = Path(__file__).resolve()
    paths = [REPO / "README.md", REPO / "pyproject.toml"]
    paths += [p for folder in _SOURCE_DIRS for p in (REPO / folder).rglob("*")]
    citing = [
        str(path.relative_to(REPO))
        for path in paths
        if path.suffix in _SOURCE_SUFFIXES
        and path.resolve() != this
        and _CITED in path.read_text(encoding="utf-8", errors="replace")
    ]
    assert citing == []


@pytest.mark.unit
def test_the_readmes_spark_example_is_the_tested_kafka_job() -> None:
    """The README shows code that a test runs against a real broker, not a sketch."""
    readme = README.read_text(encoding="utf-8")
    section = readme.split("## Use it in your Spark job", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    example = (REPO / "docs" / "examples" / "kafka_pipeline.py").read_text(encoding="utf-8")
    assert "def pipeline(" in code
    assert code in example
