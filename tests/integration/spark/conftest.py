"""Fixtures of the Spark tests: the ledger's Delta engine."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["delta-rs", "delta-spark"])
def ledger_engine(request: pytest.FixtureRequest) -> str:
    """Each Delta engine in turn: delta-rs in this process, and delta-spark through the
    shared Spark session (which carries Delta's jars and extension)."""
    engine = str(request.param)
    if engine == "delta-spark":
        request.getfixturevalue("spark")  # the session the engine writes through
    return engine
