"""What the package promises its installer: the name, the extras, and a core without PySpark.

The installed wheel itself is checked by ``.ci/wheel`` (fresh virtualenvs, with and
without extras); these tests keep the sources consistent with it and show, in a child
Python where ``pyspark`` cannot be imported, what a user without PySpark gets.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import idem
from idem.cli import _OPTIONAL, build_cli, main
from idem.cli_command import IdemGroup
from idem.extras import DISTRIBUTION
from idem.spark.cli import register as register_spark_commands

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().relative_to(ROOT).as_posix()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]

# Run in a child Python: the import system refuses pyspark as if it were not installed.
WITHOUT_PYSPARK = textwrap.dedent(
    """
    import sys
    from importlib.abc import MetaPathFinder

    class NoPySpark(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "pyspark" or name.startswith("pyspark."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoPySpark())
    """
)


def _without_pyspark(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_PYSPARK + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_distribution_name_is_the_one_the_messages_name() -> None:
    assert PROJECT["name"] == DISTRIBUTION
    extras = PROJECT["optional-dependencies"]
    for layer in _OPTIONAL.values():
        for extra in {layer.extra, *layer.extra_of.values()}:
            assert extra in extras, f"the CLI names the extra {extra!r}, which is not declared"


def test_the_core_dependencies_leave_pyspark_and_fakeredis_to_the_extras() -> None:
    core = " ".join(PROJECT["dependencies"]).lower()
    assert "pyspark" not in core
    assert "fakeredis" not in core
    extras = PROJECT["optional-dependencies"]
    assert any(d.startswith("pyspark") for d in extras["spark"])
    assert any(d.startswith("fakeredis[lua]") for d in extras["demo"])
    assert any(d.startswith("pyspark") for d in extras["demo"])


def test_idem_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"idem {idem.__version__}"


def test_the_commands_listed_without_pyspark_are_the_ones_the_spark_layer_adds() -> None:
    group = IdemGroup("idem")
    register_spark_commands(group)
    commands = group.commands
    assert set(commands) == set(_OPTIONAL["idem.spark.cli"].commands)
    # and with PySpark installed the full command line has the real ones, which take --help
    real = build_cli().commands
    for name in commands:
        ctx = real[name].make_context(name, [], resilient_parsing=True)
        assert any("-h" in p.opts for p in real[name].get_params(ctx)), name


def test_the_core_imports_without_pyspark() -> None:
    done = _without_pyspark(
        """
        import idem
        from idem import Dedup, IdemConfig, idempotent
        import idem.retry
        from idem.retry.consumer import PushConsumer
        import idem.ledger
        import idem.cli
        assert "pyspark" not in sys.modules
        try:
            import idem.spark
        except ModuleNotFoundError as exc:
            print(exc)
        """
    )
    assert done.returncode == 0, done.stderr
    assert f"pip install '{DISTRIBUTION}[spark]'" in done.stdout


@pytest.mark.parametrize(
    ("command", "extra"),
    [
        (["demo"], "demo"),
        (["run", "--source", "x", "--key", "k"], "spark"),
        (["dlq", "ls"], "spark"),
    ],
)
def test_a_spark_command_without_pyspark_names_what_to_install(
    command: list[str], extra: str
) -> None:
    done = _without_pyspark(f"from idem.cli import main; sys.exit(main({command!r}))")
    assert done.returncode == 2, done.stderr
    assert f"needs PySpark: pip install '{DISTRIBUTION}[{extra}]'" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_other_commands_work_without_pyspark() -> None:
    done = _without_pyspark(
        """
        from idem.cli import main
        for argv in (
            ["--help"], ["schedule", "--help"], ["index", "status", "--help"], ["stats", "--help"]
        ):
            assert main(argv) == 0, argv
        """
    )
    assert done.returncode == 0, done.stderr
    assert "needs PySpark" in done.stdout  # --help lists demo, run and dlq with the hint


def test_every_package_directory_is_in_the_wheels_package_list() -> None:
    """pyproject names the packages (a remapped namespace is not discovered from it);
    a package directory left out would be missing from the installed wheel."""
    roots = {"idem": ROOT / "idem", "idem.retry": ROOT / "retry", "idem.spark": ROOT / "spark"}
    on_disk = {
        ".".join([name, *init.parent.relative_to(folder).parts])
        for name, folder in roots.items()
        for init in folder.rglob("__init__.py")
    }
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"][
        "setuptools"
    ]
    assert sorted(setuptools["packages"]) == sorted(on_disk)


def test_install_commands_name_the_distribution_not_the_import_name() -> None:
    """``pip install 'idem[...]'`` would install PyPI's unrelated ``idem`` package."""
    found = subprocess.run(
        # this file spells the wrong form on purpose
        ["git", "-C", str(ROOT), "grep", "-nE", r"(^|[^-\w.])idem\[", "--", ".", f":!{HERE}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode > 1:  # not a git checkout: nothing to compare against
        pytest.skip(f"git grep failed: {found.stderr.strip()}")
    assert found.stdout == "", f"use '{DISTRIBUTION}[extra]':\n{found.stdout}"


def test_without_prometheus_client_the_core_counts_and_the_metrics_port_names_the_extra(
    tmp_path: Path,
) -> None:
    """Counting is the core's; only exposing needs the ``metrics`` extra."""
    no_prometheus = WITHOUT_PYSPARK.replace('"pyspark"', '"prometheus_client"').replace(
        '"pyspark."', '"prometheus_client."'
    )
    code = f"""
        from idem import metrics
        from idem.cli import main
        import idem.retry.consumer
        metrics.count("messages", "g", 3)
        assert "prometheus_client" not in sys.modules
        try:
            metrics.serve(0)
        except ModuleNotFoundError as exc:
            print(exc)
        sys.exit(main(["schedule", "--group", "g", "--redis-url", "redis://127.0.0.1:1/0",
                       "--data-dir", {str(tmp_path)!r}, "--metrics-port", "0"]))
    """
    done = subprocess.run(
        [sys.executable, "-c", no_prometheus + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    hint = f"pip install '{DISTRIBUTION}[metrics]'"
    assert hint in done.stdout, done.stderr
    assert done.returncode == 2, done.stderr
    assert f"idem: error: --metrics-port: exposing metrics needs prometheus-client: {hint}" in (
        done.stderr
    )
