"""``idem demo`` runs on embedded defaults and its exactly-once check passes."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from idem.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.spark]


def test_idem_demo_prints_the_report_with_the_exactly_once_check_passing(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The demo's own session has no Delta jars, so its auto engine is delta-rs; the shared
    # test session has Delta's extension, where auto would be delta-spark: name it here.
    code = main(
        ["demo", "--workdir", str(tmp_path), "--orders", "150", "--files", "3",
         "--engine", "delta-rs"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert "ledger engine delta-rs" in out
    assert "Redis: private redis-server on 127.0.0.1:" in out
    assert "replayed after a crash: 1" in out  # the staged driver failure was replayed
    assert "dead letters:          6 in %DLQ%demo-orders" in out
    assert "exactly-once check: PASS" in out
