"""Fixtures of the fault tier: a seed per test, a fault proxy in front of the real Redis.

Every random choice of a fault test comes from ``random.Random(seed)``; the seed is
printed first and named in every failure, and ``IDEM_FAULT_SEED=<seed>`` replays it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# the scenarios' harness (Group, FileSink) is shared, not copied
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scenarios"))

from proxy import FaultProxy
from seeds import Seed, seed_from_env

from idem.redis_server import RedisServer


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> Seed:
    """This test's seed (``IDEM_FAULT_SEED``, or a fresh one), printed before anything runs."""
    chosen = seed_from_env()
    print(f"\n{request.node.nodeid}: seed={chosen.value} (replay: IDEM_FAULT_SEED={chosen.value})")
    return chosen


@pytest.fixture
def proxy(redis_server: RedisServer) -> Iterator[FaultProxy]:
    """A fault proxy in front of the session's redis-server."""
    with FaultProxy(redis_server.port) as running:
        yield running
