"""Writers whose clocks disagree around a boundary of the dedup window's generations.

Redis keeps COMPLETED keys in one hash per generation (``completed_at // window``).
A writer whose clock runs a few milliseconds ahead completes a key just past a
boundary, into the next generation, while another writer's clock is still before
it: that writer's claim must find the key there (a real redis-server, a real Delta
ledger: the ledger then holds the key once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.hotstore_types import KeyStatus
from idem.keys import group_by_bucket
from idem.outcome import DuplicateCause
from idem.redis_server import RedisServer

pytestmark = pytest.mark.integration

WINDOW_MS = 7 * 24 * 3600 * 1000
BOUNDARY_MS = (1_700_000_000_000 // WINDOW_MS + 1) * WINDOW_MS


def _writer(tmp_path: Path, url: str, now_ms: int) -> tuple[Dedup, ManualClock]:
    clock = ManualClock(now_ms)
    config = IdemConfig(group="orders", redis_url=url, data_dir=str(tmp_path), buckets=1)
    return Dedup(config, clock=clock), clock


def test_a_key_completed_past_a_generation_boundary_by_a_clock_ahead_is_a_duplicate(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    ahead, _ = _writer(tmp_path, redis_server.url, BOUNDARY_MS + 5)
    behind, _ = _writer(tmp_path, redis_server.url, BOUNDARY_MS - 15)
    behind.complete(behind.begin(["WARM"], owner="b:0"), batch_id=0, app_id="b")
    ahead.complete(ahead.begin(["K"], owner="a:1"), batch_id=1, app_id="a")

    claim = behind.begin(["K"], owner="b:1")

    assert claim.fresh == ()
    assert claim.duplicates == {0: DuplicateCause.COMPLETED}
    assert behind.hot.lookup(group_by_bucket(["K"], 1))["K"].status is KeyStatus.COMPLETED
    assert behind.ledger.audit() == []
