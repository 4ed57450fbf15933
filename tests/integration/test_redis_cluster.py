"""idem on a real Redis Cluster (3 primaries on loopback ports).

The dedup behaviour suite also runs here (``any_redis``'s ``redis-cluster``
parameter); these tests show what only a Cluster has: buckets spread over
primaries, a slot that moves under a client, a primary that may evict, and the
resend path on a group's one slot.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.errors import ConfigError, UnsafeRedisConfig
from idem.redis_client import connect
from idem.redis_cluster import LocalCluster
from idem.retry import MessageExt, RetryEngine, audit_states

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, cluster: LocalCluster, group: str, **extra: Any) -> IdemConfig:
    return IdemConfig(
        group=group, redis_url=cluster.url, data_dir=str(tmp_path), buckets=16, **extra
    )


def _idem_keys_per_primary(client: Any) -> list[int]:
    return [
        len(client.get_redis_connection(node).keys("idem:*")) for node in client.get_primaries()
    ]


def test_a_batch_over_every_primary_is_processed_once_and_survives_flushall(
    tmp_path: Path, redis_cluster: LocalCluster, cluster_redis: Any
) -> None:
    dd = Dedup(_config(tmp_path, redis_cluster, "orders"))
    keys = [f"ORDERID_{i}" for i in range(10_000)]
    claim = dd.begin(keys, owner="q:0")
    assert len(claim.fresh) == 10_000
    assert dd.complete(claim, batch_id=0).committed == 10_000
    assert all(n > 0 for n in _idem_keys_per_primary(cluster_redis))  # buckets on all three

    again = dd.begin([*keys[:5_000], "ORDERID_new"], owner="q:1")
    assert [again.keys[i] for i in again.fresh] == ["ORDERID_new"]
    assert len(again.duplicates) == 5_000

    cluster_redis.flushall(target_nodes="primaries")  # every primary forgets everything
    after = dd.begin([*keys[5_000:], "ORDERID_other"], owner="q:2")
    assert [after.keys[i] for i in after.fresh] == ["ORDERID_other"]
    assert len(after.duplicates) == 5_000  # rebuilt from the ledger, bucket by bucket


def test_a_slot_moved_under_a_client_is_followed(
    tmp_path: Path, redis_cluster: LocalCluster, cluster_redis: Any
) -> None:
    """A client with a stale slot map: its commands for the moved slot come back MOVED,
    and go to the new owner."""
    dd = Dedup(_config(tmp_path, redis_cluster, "moving"))  # reads the slot map now
    tag = "idem:{moving:0}"
    slot = cluster_redis.keyslot(tag)
    owner = cluster_redis.get_node_from_key(tag)
    target = next(n for n in cluster_redis.get_primaries() if n.name != owner.name)
    target_id = cluster_redis.get_redis_connection(target).execute_command("CLUSTER", "MYID")
    for node in cluster_redis.get_primaries():  # an empty slot can be reassigned directly
        conn = cluster_redis.get_redis_connection(node)
        conn.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    assert dd.hot.client.get_node_from_key(tag).name == owner.name  # its map is stale now
    dd_keys = [f"K{i}" for i in range(2_000)]
    moved_keys = [k for k in dd_keys if dd.hot.claim_hash(k).startswith(tag + ":")]
    assert moved_keys

    claim = dd.begin(dd_keys, owner="q:0")
    assert len(claim.fresh) == 2_000
    dd.complete(claim, batch_id=0)
    target_conn = cluster_redis.get_redis_connection(target)
    assert target_conn.exists(f"{tag}:wm")  # the bucket's index lives on the new owner
    assert dd.begin(moved_keys, owner="q:1").fresh == ()


def test_a_claim_during_a_live_resharding_waits_for_the_slot_instead_of_missing_its_keys(
    tmp_path: Path, redis_cluster: LocalCluster, cluster_redis: Any
) -> None:
    """Resharding moves a slot's keys one at a time. A claim must not run on a node that
    already gave away its bucket's completed-keys hash (it would take completed keys for
    new ones), nor fail: with every name a script touches declared, that node answers
    TRYAGAIN/ASK, the claim waits, and once the slot has moved it finds the keys completed
    on the new owner. (Declaring only the watermark, Redis refused the script with "non
    local key" and the claim failed.)"""
    config = IdemConfig(
        group="resharding", redis_url=redis_cluster.url, data_dir=str(tmp_path), buckets=1
    )
    dd = Dedup(config)
    keys = [f"ORDERID_{i}" for i in range(100)]
    dd.complete(dd.begin(keys, owner="q:0"), batch_id=0)

    tag = "idem:{resharding:0}"
    slot = cluster_redis.keyslot(tag)
    source = cluster_redis.get_node_from_key(tag)
    target = next(n for n in cluster_redis.get_primaries() if n.name != source.name)
    src = cluster_redis.get_redis_connection(source)
    dst = cluster_redis.get_redis_connection(target)
    src_id = src.execute_command("CLUSTER", "MYID")
    dst_id = dst.execute_command("CLUSTER", "MYID")

    def migrate(names: list[Any]) -> None:
        src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *names)

    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    completed = src.keys(f"{tag}:c:*")
    assert completed
    migrate(completed)  # the completed keys are gone from the source, its watermark is not
    assert src.exists(f"{tag}:wm")

    def finish() -> None:
        time.sleep(1.0)
        rest = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        if rest:
            migrate(rest)
        for node in cluster_redis.get_primaries():
            conn = cluster_redis.get_redis_connection(node)
            conn.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)

    mover = threading.Thread(target=finish)
    mover.start()
    try:
        started = time.monotonic()
        claim = dd.begin([*keys, "ORDERID_new"], owner="q:1")
        waited = time.monotonic() - started
    finally:
        mover.join()
    assert [claim.keys[i] for i in claim.fresh] == ["ORDERID_new"]
    assert len(claim.duplicates) == 100
    assert waited > 0.5  # it waited for the migration rather than answering at once
    assert dst.exists(f"{tag}:wm")


def test_one_evicting_primary_is_refused(
    tmp_path: Path, redis_cluster: LocalCluster, cluster_redis: Any
) -> None:
    last = cluster_redis.get_redis_connection(cluster_redis.get_primaries()[-1])
    last.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with pytest.raises(UnsafeRedisConfig, match=r"allkeys-lru.*noeviction"):
            Dedup(_config(tmp_path, redis_cluster, "evict")).check()
    finally:
        last.config_set("maxmemory-policy", "noeviction")
    Dedup(_config(tmp_path, redis_cluster, "evict")).check()


def test_a_cluster_url_names_database_zero_only(redis_cluster: LocalCluster) -> None:
    with pytest.raises(ConfigError, match="only database 0"):
        connect(redis_cluster.url + "/3")
    assert connect(redis_cluster.url + "/0").ping() is True


def test_the_resend_path_runs_on_the_groups_slot(
    tmp_path: Path, redis_cluster: LocalCluster, cluster_redis: Any
) -> None:
    """Send back, schedule, consume from %RETRY%, ack, and dead-letter, on a Cluster."""
    clock = ManualClock()
    config = _config(
        tmp_path, redis_cluster, "CID_cluster", delay_levels="1s 2s", max_reconsume_times=1
    )
    engine = RetryEngine(config, clock=clock)
    messages = [
        MessageExt(topic="TopicTest", msg_id=f"M{i}", keys=f"ORDER_{i}", body=b'{"row": 1}')
        for i in range(50)
    ]
    assert len(engine.send_back(messages, delay_level=1).scheduled) == 50
    clock.advance(1.5)
    assert engine.tick() == 50
    first = engine.poll_retry("c1", 100)
    assert sorted(m.origin_msg_id for m in first) == sorted(m.msg_id for m in messages)
    done = {m.origin_msg_id for m in first[:40]}
    engine.ack(first[:40])
    engine.send_back(first[40:], delay_level=0)  # the ladder is over: dead letters
    assert engine.pending() == 0
    dead = sorted(letter.origin_msg_id for letter in engine.dlq.list())
    assert dead == sorted(m.origin_msg_id for m in first[40:])
    audit = audit_states(engine, {m.msg_id for m in messages}, done)
    assert audit.ok, audit.describe()
