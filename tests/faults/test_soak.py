"""The chaos soak in its short mode: two seeds, a small topic each (see :mod:`soak`).

``python -m tests.faults.soak --seeds N --messages M`` runs it at scale.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from seeds import Seed
from soak import CONSUMER_KINDS, FAIL_SHARE, Injected, Kind, Report, _repeats, run_seed

from idem.config import IdemConfig

pytestmark = pytest.mark.faults

MESSAGES = 90


@pytest.mark.parametrize("run", [1, 2])
def test_consumers_under_chaos_lose_nothing_and_repeat_only_what_the_guarantees_allow(
    run: int, seed: Seed, tmp_path: Path
) -> None:
    report = run_seed(seed.value, MESSAGES, base=tmp_path)
    assert report.ok, report.tag("; ".join(report.problems))
    assert {f.kind for f in report.faults} == set(CONSUMER_KINDS), report.tag("every kind of fault")
    assert report.redelivered >= FAIL_SHARE * MESSAGES - 1, report.tag(
        f"only {report.redelivered} keys redelivered"
    )


def _row(key: str, by: str, at: float) -> dict[str, Any]:
    return {"key": key, "by": f"{by} {at:.3f}", "reconsume": 0}


def test_the_soak_tells_an_allowed_repeat_from_a_duplicate() -> None:
    config = IdemConfig(group="g", redis_url="redis://127.0.0.1:1/0", lease_ms=3_000)
    now = time.time()
    report = Report(seed=7, messages=3)
    report.faults.append(Injected(Kind.FLUSHALL, started=time.monotonic() - 100, ended=0.0))
    rows = [
        _row("A", "c0.1", now - 50),  # c0.1 killed before its commit: c1.1's write counts
        _row("A", "c1.1", now - 40),
        _row("B", "c0.2", now - 30),  # nobody killed, no store fault near: a duplicate
        _row("B", "c1.1", now - 20),
        _row("C", "c1.1", now - 10),
    ]
    owners = {"A": "c1.1", "B": "c0.2", "C": "c1.1"}
    found = _repeats(report, rows, owners=owners, killed={"c0.1"}, config=config)
    assert found == ["B written by ['c0.2', 'c1.1'] (ledger: c0.2)"]
    assert report.repeats == Counter({"writer killed before its commit": 1})
    # the same repeat of B right after a FLUSHALL: the store may have lost c0.2's claim
    report.faults.append(Injected(Kind.FLUSHALL, started=time.monotonic() - 25, ended=0.0))
    assert _repeats(report, rows, owners=owners, killed={"c0.1"}, config=config) == []
