"""Fixtures of the redelivery scenarios: a group per run, on a shared real Redis."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import Group
from redis_backends import RealRedis


@pytest.fixture(params=[False, True], ids=["without-dedup", "with-dedup"])
def dedup(request: pytest.FixtureRequest) -> bool:
    """Each scenario runs twice: without idem's dedup hook, then with it."""
    return bool(request.param)


@pytest.fixture
def group(real_backend: RealRedis, tmp_path: Path, dedup: bool) -> Iterator[Group]:
    """A fresh consumer group with a 4-queue topic, on the shared redis-server and on the
    shared 3-primary Cluster."""
    g = Group(real_backend.url, tmp_path, f"g-{uuid.uuid4().hex[:8]}", dedup)
    yield g
    g.close()
