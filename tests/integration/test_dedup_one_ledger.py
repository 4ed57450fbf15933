"""A group's Redis index covers one ledger: a second ledger under the group is refused.

Two ledgers under one group (a Delta sink's table, and a function sink's or a
consumer's own ledger) each rebuild the index from their own keys after Redis
loses data, so a key done through one could be applied again through the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.errors import ConfigError
from idem.redis_server import RedisServer

pytestmark = pytest.mark.integration


def _dedup(tmp_path: Path, url: str, ledger: str | None = None, group: str = "g") -> Dedup:
    return Dedup(
        IdemConfig(
            group=group,
            redis_url=url,
            data_dir=str(tmp_path),
            ledger_path=None if ledger is None else str(tmp_path / ledger),
            buckets=2,
        )
    )


def test_a_second_ledger_under_a_group_is_refused_naming_both(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    sink = _dedup(tmp_path, redis_server.url, ledger="sink")
    sink.complete(sink.begin(["K1"], owner="a:0", hold=False), batch_id=0, app_id="a")
    other = _dedup(tmp_path, redis_server.url)  # <data_dir>/g/ledger
    with pytest.raises(ConfigError, match=r"ledger_path: group 'g' is indexed for the ledger"):
        other.begin(["K2"], owner="b:0")
    # nothing was claimed for it: the first ledger's writer goes on as before
    again = sink.begin(["K1", "K2"], owner="a:1", hold=False)
    assert (again.fresh, list(again.duplicates)) == ((1,), [0])
    # another group, or the same ledger under the same group, is fine
    assert _dedup(tmp_path, redis_server.url, group="h").begin(["K2"], owner="c:0").fresh == (0,)
    assert _dedup(tmp_path, redis_server.url, ledger="sink").begin(["K3"], owner="d:0").fresh == (
        0,
    )


def test_after_a_flush_the_group_is_bound_again_by_whoever_writes_first(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer
) -> None:
    """Before the guard, after a FLUSHALL each side rebuilt the index from its own ledger
    only: the key the other ledger held answered "new" and was applied twice."""
    sink = _dedup(tmp_path, redis_server.url, ledger="sink")
    sink.complete(sink.begin(["K1"], owner="a:0", hold=False), batch_id=0, app_id="a")
    real_redis.flushall()
    other = _dedup(tmp_path, redis_server.url)
    other.complete(other.begin(["K2"], owner="b:0"), batch_id=0, app_id="b")
    with pytest.raises(ConfigError, match="a group has one ledger"):
        _dedup(tmp_path, redis_server.url, ledger="sink").begin(["K2"], owner="a:1", hold=False)
