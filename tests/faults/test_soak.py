"""The chaos soak in its short mode: two seeds, a small topic each (see :mod:`soak`).

``python -m tests.faults.soak --seeds N --messages M`` runs it at scale.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from seeds import Seed
from soak import FAIL_SHARE, Kind, run_seed

pytestmark = pytest.mark.faults

MESSAGES = 90


@pytest.mark.parametrize("run", [1, 2])
def test_consumers_under_chaos_lose_nothing_and_repeat_only_what_the_guarantees_allow(
    run: int, seed: Seed, tmp_path: Path
) -> None:
    report = run_seed(seed.value, MESSAGES, base=tmp_path)
    assert report.ok, report.tag("; ".join(report.problems))
    assert {f.kind for f in report.faults} == set(Kind), report.tag("every kind of fault")
    assert report.redelivered >= FAIL_SHARE * MESSAGES - 1, report.tag(
        f"only {report.redelivered} keys redelivered"
    )
