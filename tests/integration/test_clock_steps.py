"""A process whose clock is stepped shares a group with one whose clock is right.

Leases and the dedup window run on Redis's clock. A second process, started under
``faketime`` with its clock 10 minutes behind, 10 minutes ahead or 8 days ahead,
works on the same real redis-server (or Cluster) and the same Delta ledger as this
one: it must not take over a lease this process holds, nor claim a key this
process completed; and the leases and completions it makes itself must hold for
this process as long as they would have with a right clock.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_backends import RealRedis

from idem import server_time
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.errors import StoreUnavailable
from idem.hotstore import RedisHotStore
from idem.hotstore_types import KeyStatus
from idem.keys import bucket_of, group_by_bucket
from idem.redis_server import RedisServer

pytestmark = pytest.mark.integration

JOB = Path(__file__).with_name("clock_step_job.py")
MINUTE_MS = 60_000
LEASE_MS = 5 * MINUTE_MS
WINDOW_MS = 5 * MINUTE_MS  # shorter than the steps: a stepped clock would leave the window
STEPS = ["-10m", "+10m", "+8d"]


@pytest.fixture(scope="module")
def faketime() -> str:
    """The ``faketime`` command (Debian's faketime package)."""
    found = shutil.which("faketime")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("faketime is missing: apt-get install faketime")
        pytest.skip("faketime is not installed")
    return found


@pytest.fixture
def settings(real_backend: RealRedis, tmp_path: Path) -> dict[str, Any]:
    """The group's settings, shared by this process and the stepped one."""
    return {
        "group": "orders",
        "redis_url": real_backend.url,
        "data_dir": str(tmp_path / "idem-data"),
        "buckets": 4,
        "lease_ms": LEASE_MS,
        "dedup_window_ms": WINDOW_MS,
        "delay_levels": "1s",
        "max_reconsume_times": 1,
    }


@pytest.fixture
def here(settings: dict[str, Any]) -> Iterator[Dedup]:
    """This process's dedup, on the system clock."""
    dedup = Dedup(IdemConfig(**settings))
    yield dedup
    dedup.close()


def _stepped(
    faketime: str,
    step: str,
    settings: dict[str, Any],
    *,
    action: str,
    owner: str,
    keys: list[str],
) -> dict[str, Any]:
    """Run one :mod:`clock_step_job` step in a process whose clock is off by ``step``."""
    done = subprocess.run(
        [faketime, "-f", step, sys.executable, str(JOB), json.dumps(settings), action, owner,
         *keys],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reply: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return reply


def _redis_ms(dedup: Dedup) -> int:
    """Redis's clock now."""
    hot = dedup.hot
    assert isinstance(hot, RedisHotStore)
    seconds, micros = hot.client.time()
    return int(seconds) * 1000 + int(micros) // 1000


@pytest.mark.parametrize("step", STEPS)
def test_a_stepped_process_takes_no_live_lease_and_claims_no_completed_key(
    faketime: str, settings: dict[str, Any], here: Dedup, step: str
) -> None:
    done = here.begin(["DONE"], owner="here:0")
    here.complete(done, batch_id=0, app_id="here")
    held = here.begin(["HELD"], owner="here:1")
    assert held.fresh == (0,)

    seen = _stepped(
        faketime, step, settings, action="claim", owner="stepped:0", keys=["HELD", "DONE", "NEW"]
    )

    assert abs(seen["clock_ms"] - _redis_ms(here)) > 9 * MINUTE_MS  # the step took
    assert seen["busy"] == ["HELD"]
    assert seen["duplicates"] == ["DONE"]
    assert seen["fresh"] == ["NEW"]
    # This process still holds its lease and finishes its batch: the sink gets it once.
    outcome = here.complete(held, batch_id=1, app_id="here")
    assert outcome.committed == 1
    assert outcome.fenced == ()


@pytest.mark.parametrize("step", STEPS)
def test_leases_and_completions_of_a_stepped_process_hold_for_the_others(
    faketime: str, settings: dict[str, Any], here: Dedup, step: str
) -> None:
    _stepped(faketime, step, settings, action="complete", owner="stepped:0", keys=["DONE"])
    before = _redis_ms(here)
    _stepped(faketime, step, settings, action="hold", owner="stepped:1", keys=["HELD"])
    after = _redis_ms(here)

    claim = here.begin(["HELD", "DONE", "NEW"], owner="here:0")

    assert [claim.keys[i] for i in claim.busy] == ["HELD"]
    assert [claim.keys[i] for i in claim.duplicates] == ["DONE"]
    assert [claim.keys[i] for i in claim.fresh] == ["NEW"]
    # The lease runs lease_ms from when it was taken on Redis's clock, not the
    # stepped one: a process that died holding it blocks the key no longer.
    state = here.hot.lookup(group_by_bucket(["HELD", "DONE"], here.config.buckets))
    assert state["HELD"].status is KeyStatus.IN_PROGRESS
    assert state["HELD"].lease_until_ms is not None
    assert before + LEASE_MS <= state["HELD"].lease_until_ms <= after + LEASE_MS
    assert state["DONE"].status is KeyStatus.COMPLETED
    assert state["DONE"].completed_at_ms is not None
    assert state["DONE"].completed_at_ms <= before
    assert here.ledger.audit() == []


def test_a_call_named_for_another_time_than_redis_clock_is_refused_and_writes_nothing(
    here: Dedup, real_backend: RealRedis
) -> None:
    # A call whose generations were named for an hour from Redis's clock (Redis's
    # clock was stepped after the caller read it) is refused before it writes: a
    # claim in a generation nobody reads would hide a live lease.
    hot = here.hot
    assert isinstance(hot, RedisHotStore)
    here.catch_up()  # every bucket's index is built: the claim reaches its generations
    off = _redis_ms(here) + 3_600_000
    tag, routing = hot.claim_route(bucket_of("K", hot.buckets), off)
    args = [tag, *hot.claim_arguments("", "stale:0", min_version=-1, mode="hold"), "K"]

    with pytest.raises(StoreUnavailable, match="without declaring it in KEYS"):
        hot.checked(hot.run_claims([(tag, routing, args)]), "claim")

    assert hot.lookup(group_by_bucket(["K"], hot.buckets))["K"].status is KeyStatus.ABSENT
    assert here.begin(["K"], owner="here:1").fresh == (0,)


def test_a_commit_made_while_redis_is_down_still_lands_in_the_ledger(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ledger commit needs no Redis; the time it stamps comes from Redis's clock as
    # last read, carried on, when Redis cannot be asked again (here: at every call).
    monkeypatch.setattr(server_time, "RESYNC_NS", 0)
    with RedisServer() as server:
        settings = {"group": "orders", "redis_url": server.url, "data_dir": str(tmp_path)}
        dedup = Dedup(IdemConfig(**settings, buckets=2))
        claim = dedup.begin(["K"], owner="q:1")
        assert claim.fresh == (0,)
        before = _redis_ms(dedup)
        server.kill()
        outcome = dedup.complete(claim, batch_id=1, app_id="q", defer_index=True)
        dedup.close()  # the Redis update fails and is logged: the next claim catches up
    assert outcome.committed == 1
    found = dedup.ledger.existing(["K"], since_ms=None)
    assert list(found) == ["K"]
    assert dedup.ledger.audit() == []
    assert before <= dedup.hot.now_ms() < before + 60_000
