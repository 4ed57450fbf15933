"""C4: the broker crashes before persisting the offsets it received (seed 004).

The group's offsets live on their own Redis (RocketMQ keeps them in the broker's
``consumerOffset.json``, persisted every 5 s). The broker persists (``SAVE``)
after the first phase; the consumer then commits the second phase to it; the
broker is killed before its next persist and comes back with the older file.
The consumer was restarted meanwhile, so the new instance reads the older
offsets and receives the second phase again.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import Group, keys, offset_client
from waiting import eventually

from idem.redis_server import RedisServer
from idem.retry.consumer import consumer_offsets

pytestmark = pytest.mark.scenarios


@pytest.fixture
def offsets_broker() -> Iterator[RedisServer]:
    """The broker's offset store: snapshots only when it persists (``SAVE``)."""
    server = RedisServer()
    server.start()
    yield server
    server.stop()


def test_c4_broker_loses_its_last_offset_writes(group: Group, offsets_broker: RedisServer) -> None:
    store = offset_client(offsets_broker)
    first = group.produce(keys("C4-A", 8))
    a = group.consumer("a", offset_client=store)
    eventually(lambda: group.caught_up(store), what="the first phase committed to the broker")
    store.save()  # the broker's periodic persist
    second = group.produce(keys("C4-B", 8))
    eventually(
        lambda: group.sink.has_all(second) and group.caught_up(store),
        what="the second phase consumed and committed to the broker's memory",
    )
    offsets_broker.kill()  # crash before the next persist
    a.shutdown()  # restarted during the outage: its final persist cannot reach the broker
    offsets_broker.start()
    store = offset_client(offsets_broker)
    assert sum(consumer_offsets(store, group.name).values()) == 8  # the older file

    group.consumer("b", offset_client=store)
    wanted = first + second
    if not group.dedup:
        doubled = eventually(
            lambda: set(group.sink.duplicates()) == set(second),
            what="the second phase written again",
        )
        assert doubled
        for key in second:
            assert [r["by"] for r in group.sink.rows_of(key)] == ["a", "b"]
        return
    eventually(
        lambda: (
            group.settled(wanted, store) and group.duplicates_by_cause()["completed"] == len(second)
        ),
        what="the second phase redelivered and absorbed",
    )
    group.assert_exactly_once(wanted)
    assert {
        r.key for mw in group.middlewares for r in mw.stats.duplicate_records("completed")
    } == set(second)
