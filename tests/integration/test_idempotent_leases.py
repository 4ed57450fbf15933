"""``@idempotent`` keeps its key while the call runs, however long, on a real redis-server.

A call slower than ``lease_ms`` renews its lease: a second call of the same key
meanwhile finds it busy instead of running the body again.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from idem.config import IdemConfig
from idem.errors import KeyBusy
from idem.idempotent import idempotent
from idem.redis_server import RedisServer

pytestmark = pytest.mark.integration


def test_a_call_slower_than_its_lease_keeps_its_key_until_it_returns(
    tmp_path: Path, redis_server: RedisServer, real_redis: object
) -> None:
    config = IdemConfig(
        group="payments",
        redis_url=redis_server.url,
        data_dir=str(tmp_path),
        lease_ms=1_000,
        engine="delta-rs",
    )
    ran: list[str] = []
    started = threading.Event()

    @idempotent(key="order_id", config=config)
    def charge(order_id: str) -> str:
        ran.append(order_id)
        started.set()
        time.sleep(3.0)  # three leases long
        return "charged"

    first = threading.Thread(target=charge, args=("ORDERID_100",))
    first.start()
    assert started.wait(30)
    time.sleep(2.0)  # the first lease ran out a second ago
    with pytest.raises(KeyBusy):
        charge("ORDERID_100")
    first.join()
    assert charge("ORDERID_100") is None  # completed now: a repeat does not run
    assert ran == ["ORDERID_100"]
