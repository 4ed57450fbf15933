"""C5: the master fails over to a replica whose offsets lag (seed 004).

RocketMQ's slave copies consumer offsets from its master every 10 s, so a
promoted slave knows older offsets. Here the offset store is a real Redis
master with a real replica; the replication link is cut before the second
phase (the replica's copy lags from then on), the master dies, the consumer
restarts against the promoted replica and receives the second phase again.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import FAST, Group, keys, offset_client
from waiting import eventually

from idem.redis_server import RedisServer
from idem.retry.consumer import consumer_offsets

pytestmark = pytest.mark.scenarios


@pytest.fixture
def master_and_replica() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and a replica following it."""
    master, replica = RedisServer(), RedisServer()
    master.start()
    replica.start()
    replica.client().replicaof("127.0.0.1", master.port)
    yield master, replica
    master.stop()
    replica.stop()


def _linked(replica: RedisServer) -> bool:
    info = replica.client().info("replication")
    return info.get("master_link_status") == "up"


def test_c5_failover_to_a_lagging_replica(
    group: Group, master_and_replica: tuple[RedisServer, RedisServer]
) -> None:
    master, replica = master_and_replica
    eventually(lambda: _linked(replica), what="the replica following the master")
    on_master, on_replica = offset_client(master), offset_client(replica)
    first = group.produce(keys("C5-A", 8))
    a = group.consumer("a", offset_client=on_master)
    eventually(lambda: group.caught_up(on_master), what="the first phase committed")
    eventually(lambda: group.caught_up(on_replica), what="the replica synced the offsets")
    on_replica.replicaof("NO", "ONE")  # the link is cut: the replica's offsets lag from here
    second = group.produce(keys("C5-B", 8))
    eventually(
        lambda: group.sink.has_all(second) and group.caught_up(on_master),
        what="the second phase committed to the master",
    )
    master.kill()
    a.shutdown()  # its final persist cannot reach the dead master
    assert sum(consumer_offsets(on_replica, group.name).values()) == 8  # it lags

    group.consumer("b", offset_client=on_replica)  # failed over to the promoted replica
    wanted = first + second
    if not group.dedup:
        eventually(
            lambda: set(group.sink.duplicates()) == set(second),
            what="the second phase written again",
        )
        for key in second:
            assert [r["by"] for r in group.sink.rows_of(key)] == ["a", "b"]
        return
    eventually(
        lambda: (
            group.settled(wanted, on_replica)
            and group.duplicates_by_cause()["completed"] == len(second)
        ),
        what="the second phase redelivered and absorbed",
    )
    group.assert_exactly_once(wanted)


def test_c5_a_redis_back_from_an_older_snapshot_hands_offsets_out_again(
    dedup: bool, tmp_path: Path
) -> None:
    """One Redis holds the topic and the offsets, and comes back from a snapshot older
    than its last writes (an AOF tail lost, a lagging replica promoted) while the
    consumer runs, with RocketMQ's 5 s offset persist. Its queues hand the lost offsets
    out again, to new messages: the consumer must notice before it pulls or persists
    again, and start the queues where the restored offsets say, skipping nothing."""
    server = RedisServer()
    server.start()
    group = Group(server.url, tmp_path, f"g-{uuid.uuid4().hex[:8]}", dedup)
    try:
        group.consumer("a", settings=FAST.with_changes(persist_consumer_offset_interval_ms=5000))
        first = group.produce(keys("C5-S", 12))
        eventually(lambda: group.sink.has_all(first) and group.caught_up(), what="first phase")
        group.client.save()  # the snapshot Redis will come back from
        lost = group.produce(keys("C5-T", 8))
        eventually(lambda: group.sink.has_all(lost) and group.caught_up(), what="second phase")
        server.restart()
        # the lost offsets again, and past where the consumer was: new messages
        after = group.produce(keys("C5-U", 40))
        eventually(lambda: group.sink.has_all(after), what="the messages sent after consumed")
        assert set(group.sink.duplicates()) <= set(first)  # at most the snapshot's again
        if dedup:
            group.assert_exactly_once(first + lost + after)
    finally:
        group.close()
        server.stop()
