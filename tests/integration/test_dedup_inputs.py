"""Bad input to the dedup protocol is refused naming the field, and leaves nothing held.

Real redis-server and real Delta tables: a claim's calls stream to the server
while the batch is prepared, so a refusal after they went out must read them
back and give the leases up (or the keys stay busy for a lease, and the
connection never returns to the pool).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.redis_server import RedisServer

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, url: str) -> IdemConfig:
    return IdemConfig(group="orders", redis_url=url, data_dir=str(tmp_path / "data"), buckets=4)


@pytest.mark.parametrize(
    ("prints", "message"),
    [
        (["00", None], r"row 1's fingerprint None is not text"),
        ([b"00", "11"], r"row 0's fingerprint b'00' is not text"),
        (["00", "ab\ud800"], r"row 1's fingerprint 'ab\\ud800' is not valid Unicode text"),
    ],
)
def test_a_fingerprint_that_is_not_text_is_refused_naming_its_row_and_nothing_stays_held(
    tmp_path: Path,
    real_redis: Any,
    redis_server: RedisServer,
    prints: list[object],
    message: str,
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    pool = dd.hot.client.connection_pool  # type: ignore[attr-defined]
    in_use = len(pool._in_use_connections)
    with pytest.raises(ValueError, match=f"fingerprints: {message}"):
        dd.begin(["A", "B"], owner="q:1", fingerprints=prints)  # type: ignore[arg-type]
    # The claims that went out were read back (the connection is free again) and their
    # leases given up: another owner takes both keys now, not a lease later.
    assert len(pool._in_use_connections) == in_use
    other = Dedup(_config(tmp_path, redis_server.url)).begin(["A", "B"], owner="o:1")
    assert (other.fresh, other.busy) == ((0, 1), ())
    assert dd.ledger.version() == -1


@pytest.mark.parametrize("batch_id", [-1, "3", 1.5, True, 2**63])
def test_a_batch_id_that_is_no_txn_version_is_refused_before_anything_lands(
    tmp_path: Path, real_redis: Any, redis_server: RedisServer, batch_id: object
) -> None:
    dd = Dedup(_config(tmp_path, redis_server.url))
    dd.complete(dd.begin(["A"], owner="q:1"), batch_id=1)
    claim = dd.begin(["B"], owner="q:2")
    with pytest.raises(ValueError, match=r"batch_id: .* must be a whole number 0\.\.2\*\*63-1"):
        dd.complete(claim, batch_id=batch_id)  # type: ignore[arg-type]
    assert dd.ledger.version() == 0  # nothing committed, not even as a "replay" of batch 1
    assert dd.complete(claim, batch_id=2).committed == 1
