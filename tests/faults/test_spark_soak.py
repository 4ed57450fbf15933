"""The Spark soak in its short mode: one seed, a few hundred keys (see :mod:`spark_soak`).

``python -m tests.faults.spark_soak --seeds N --messages M`` runs it at scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from seeds import Seed
from soak import STORE_FAULTS, Kind
from spark_soak import run_seed, spark_plan

pytestmark = pytest.mark.faults

MESSAGES = 240


def test_idem_run_under_driver_kills_and_store_faults_writes_each_key_once(
    seed: Seed, tmp_path: Path
) -> None:
    """The driver SIGKILLed while it commits and the store faulted once; at the end each
    key is in the Delta sink exactly once, the audits are clean, the DLQ holds the rows
    meant to die."""
    report = run_seed(seed.value, MESSAGES, base=tmp_path, short=True)
    assert report.ok, report.tag("; ".join(report.problems))
    kinds = [f.kind for f in report.faults]
    assert Kind.KILL_DRIVER in kinds, report.tag(f"no driver kill: {kinds}")
    assert STORE_FAULTS & set(kinds), report.tag(f"no store fault: {kinds}")
    assert report.driver_starts >= 2, report.tag("the drain is a restart on the checkpoint")
    assert report.redelivered >= 0.3 * MESSAGES, report.tag(
        f"only {report.redelivered} keys redelivered"
    )
    plan = spark_plan(seed.value, MESSAGES, short=True)
    assert report.sink_rows == MESSAGES - len(plan.poison), report.tag("sink rows")
    assert report.dead == len(plan.poison), report.tag("dead letters")
