"""Per-group Redis ACL users on a real redis-server: group A's credentials reach none of
group B's keys or channels, and every part of idem still works under A's user alone.

Users are created from the lines :mod:`idem.acl` generates (``ACL SETUSER`` through the
server's default user, standing in for the admin). A refused command shows in Redis's
``ACL LOG``; the working side asserts that log holds no refusal of the group's user
beyond the one idem expects (``CONFIG GET``, whose refusal only logs a warning).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from waiting import FAST, eventually

from idem.acl import acl_user_line, producer_user_line, setuser_args
from idem.cli import main as idem_main
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.errors import IdemError
from idem.hotstore import RedisHotStore
from idem.redis_server import RedisServer
from idem.retry import MessageExt, RetryEngine, RetryKeys, ScheduleStore
from idem.retry.consumer import DedupMiddleware, Producer, PushConsumer, TopicStore, new_message
from idem.retry.consumer.offset_store import offsets_key, reset_epoch_key, reset_marks_key
from idem.retry.consumer.orderly import lock_key
from idem.retry.consumer.rebalance import Membership
from idem.retry.consumer.topics import MessageQueue
from idem.retry.status import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
)
from idem.spark.stats import StatsStore

pytestmark = pytest.mark.integration

EXPECTED_REFUSALS = {"config|get"}
"""What idem asks of a group's user and copes without: the start-up eviction check."""


@dataclass(frozen=True)
class Group:
    """A consumer group with its own ACL user and topic."""

    name: str
    user: str
    password: str
    topic: str
    url: str

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)

    def config(self, data_dir: Path, **changes: Any) -> IdemConfig:
        settings: dict[str, Any] = {
            "group": self.name,
            "redis_url": self.url,
            "data_dir": str(data_dir),
            "delay_levels": "1s 1s 1s",
            "engine": "delta-rs",
        }
        return IdemConfig(**{**settings, **changes})


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as started:
        yield started


def _group(server: RedisServer, admin: redis.Redis, label: str) -> Group:
    name = f"{label}-{uuid.uuid4().hex[:6]}"
    password = uuid.uuid4().hex
    topic = f"topic-{name}"
    line = acl_user_line(name, topics=[topic], password=password)
    admin.execute_command("ACL", "SETUSER", *setuser_args(line))
    user = f"idem-{name}"
    url = f"redis://{user}:{password}@127.0.0.1:{server.port}/0"
    return Group(name, user, password, topic, url)


def _producer(server: RedisServer, admin: redis.Redis, *groups: Group) -> Producer:
    password = uuid.uuid4().hex
    line = producer_user_line("shop", topics=[g.topic for g in groups], password=password)
    admin.execute_command("ACL", "SETUSER", *setuser_args(line))
    return Producer("p", redis_url=f"redis://shop:{password}@127.0.0.1:{server.port}/0")


def _refusals(admin: redis.Redis, user: str) -> set[str]:
    """The commands or keys ``ACL LOG`` shows refused to ``user``."""
    return {
        f"{e['reason']}:{e['object']}" if e["reason"] != "command" else e["object"]
        for e in admin.acl_log(count=1000)
        if e["username"] == user
    }


class _FailOnce:
    """A listener that asks for one retry of each message, then takes it."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.done: list[str] = []

    def __call__(
        self, messages: list[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        keys = [m.keys or "" for m in messages]
        if any(k not in self.seen for k in keys):
            self.seen |= set(keys)
            return ConsumeConcurrentlyStatus.RECONSUME_LATER
        self.done += keys
        return ConsumeConcurrentlyStatus.CONSUME_SUCCESS


def _run_idem(group: Group, data_dir: Path, producer: Producer) -> dict[str, Any]:
    """Dedup, the resend path and a push consumer, all under ``group``'s user."""
    dedup = Dedup(group.config(data_dir))
    claim = dedup.begin(["ORDERID_1", "ORDERID_2"], owner="batch-1")
    assert sorted(claim.fresh_keys()) == ["ORDERID_1", "ORDERID_2"]
    assert dedup.complete(claim, batch_id=1, app_id=f"acl:{group.name}").committed == 2
    again = dedup.begin(["ORDERID_1", "ORDERID_3"], owner="batch-2")
    assert again.fresh_keys() == ["ORDERID_3"]
    dedup.release(again)
    dedup.close()

    engine = RetryEngine(group.config(data_dir))
    messages = [
        MessageExt(topic=group.topic, msg_id=f"M{i}", keys=f"K{i}", body=b"{}") for i in range(3)
    ]
    assert engine.send_back(messages, delay_level=1).acknowledged
    assert engine.pending() == 3
    assert engine.rebuild().scheduled == 3  # a forced rebuild clears the group's keys first
    delivered: list[MessageExt] = []
    with engine.schedule_service():

        def poll() -> bool:
            delivered.extend(engine.poll_retry("c1", 10))
            return len(delivered) >= 3

        eventually(poll, timeout=20)
    assert sorted(m.origin_msg_id for m in delivered) == ["M0", "M1", "M2"]
    assert engine.ack(delivered) == 3
    assert engine.pending() == 0

    listener = _FailOnce()
    consumer = PushConsumer(group.config(data_dir), settings=FAST)
    consumer.subscribe(group.topic)
    consumer.use(DedupMiddleware(Dedup(group.config(data_dir)), key="keys"))
    consumer.register_message_listener_concurrently(listener)
    consumer.start()
    try:
        for key in ("ORDERID_7", "ORDERID_8"):
            producer.send(new_message(group.topic, b"{}", keys=key))
        eventually(lambda: sorted(listener.done) == ["ORDERID_7", "ORDERID_8"], timeout=60)
        engine = consumer.engine
        assert engine is not None
        eventually(lambda: engine.pending() == 0, timeout=30)
        assert engine.dlq.count() == 0
    finally:
        consumer.shutdown()

    ordered: list[str] = []

    def in_order(
        messages: Sequence[MessageExt], context: ConsumeOrderlyContext
    ) -> ConsumeOrderlyStatus:
        ordered.extend(m.keys or "" for m in messages)
        return ConsumeOrderlyStatus.SUCCESS

    orderly = PushConsumer(group.config(data_dir), settings=FAST)  # takes queue locks
    orderly.subscribe(group.topic)
    orderly.register_message_listener_orderly(in_order)
    orderly.start()
    try:
        producer.send(new_message(group.topic, b"{}", keys="ORDERID_9"))
        eventually(lambda: ordered == ["ORDERID_9"], timeout=30)
    finally:
        orderly.shutdown()
    return {"consumed": sorted(listener.done), "in order": ordered}


def test_each_group_works_under_its_own_acl_user(server: RedisServer, tmp_path: Path) -> None:
    admin = server.client(decode_responses=True)
    a, b = _group(server, admin, "a"), _group(server, admin, "b")
    producer = _producer(server, admin, a, b)
    for topic in (a.topic, b.topic):
        TopicStore(admin).create_topic(topic, 2)
    admin.acl_log_reset()
    for group in (a, b):
        assert _run_idem(group, tmp_path / group.name, producer) == {
            "consumed": ["ORDERID_7", "ORDERID_8"],
            "in order": ["ORDERID_9"],
        }
        common = ["--group", group.name, "--redis-url", group.url]
        common += ["--data-dir", str(tmp_path / group.name)]
        for command in (
            ["retry", "stats"],
            ["retry", "compact"],
            ["retry", "rebuild"],
            ["index", "status"],
            ["index", "rebuild", "--all"],
        ):
            assert idem_main([*command, *common]) == 0, command
    producer.shutdown()
    assert _refusals(admin, a.user) == EXPECTED_REFUSALS
    assert _refusals(admin, b.user) == EXPECTED_REFUSALS
    assert _refusals(admin, "shop") == set()


def _b_keys(admin: redis.Redis, b: Group) -> list[str]:
    """Every key group B's run left, found by the admin."""
    return sorted(k for k in admin.scan_iter(count=1000) if b.name in k)


def test_a_groups_user_cannot_touch_another_groups_keys_or_channels(
    server: RedisServer, tmp_path: Path
) -> None:
    admin = server.client(decode_responses=True)
    a, b = _group(server, admin, "a"), _group(server, admin, "b")
    producer = _producer(server, admin, a, b)
    for topic in (a.topic, b.topic):
        TopicStore(admin).create_topic(topic, 2)
    _run_idem(b, tmp_path / "b", producer)  # B's keys as idem leaves them
    producer.shutdown()
    b_keys = _b_keys(admin, b)
    kinds = {admin.type(k) for k in b_keys}
    assert {"hash", "stream", "string"} <= kinds, b_keys
    assert any(k.startswith(f"rmq:topic:{{{b.topic}}}") for k in b_keys)

    before = {k: admin.dump(k) for k in b_keys}
    client = a.client()
    refused: list[tuple[str, Callable[[], object]]] = []
    for key in b_keys:
        refused += [
            (f"GET {key}", lambda k=key: client.get(k)),
            (f"SET {key}", lambda k=key: client.set(k, "x")),
            (f"HGETALL {key}", lambda k=key: client.hgetall(k)),
            (f"XADD {key}", lambda k=key: client.xadd(k, {"m": "{}"})),
            (f"XRANGE {key}", lambda k=key: client.xrange(k, count=1)),
            (f"DEL {key}", lambda k=key: client.delete(k)),
            (f"EXISTS {key}", lambda k=key: client.exists(k)),
        ]
    own = f"rmq:{{{a.name}}}:live"
    b_live = f"rmq:{{{b.name}}}:live"
    refused += [
        ("SCAN", lambda: client.scan(0)),
        ("KEYS", lambda: client.keys("*")),
        ("CONFIG GET", lambda: client.config_get("masterauth")),
        ("EVAL on B's key", lambda: client.eval("return redis.call('HLEN', KEYS[1])", 1, b_live)),
        # a script that names only A's key but reaches for B's
        (
            "EVAL reaching B's key",
            lambda: client.eval(f"return redis.call('HLEN', '{b_live}')", 1, own),
        ),
        ("EVAL SCAN", lambda: client.eval("return redis.call('SCAN', '0')", 0)),
        ("PUBLISH B's wake channel", lambda: client.publish(f"rmq:{{{b.name}}}:schedule:wake", 1)),
        ("PUBLISH B's notices", lambda: client.publish(f"rmq:cg:{{{b.name}}}:notify", "x")),
        ("SUBSCRIBE B's notices", lambda: _subscribe(a, f"rmq:cg:{{{b.name}}}:notify")),
        ("SUBSCRIBE B's wake", lambda: _subscribe(a, f"rmq:{{{b.name}}}:schedule:wake")),
        ("XADD to A's own topic", lambda: client.xadd(f"rmq:topic:{{{a.topic}}}:q:0", {"m": "x"})),
        ("HSET A's topic meta", lambda: client.hset(f"rmq:topic:{{{a.topic}}}:meta", "q", 9)),
    ]
    # idem's own scripts and calls aimed at B's keys with A's credentials
    as_b = b.config(tmp_path / "a-as-b", redis_url=a.url)
    b_store = ScheduleStore(client, b.name)
    refused += [
        ("Dedup claim", lambda: Dedup(as_b).begin(["ORDERID_1"], owner="x")),
        ("retry poll", lambda: RetryEngine(as_b).poll_retry("c1", 10)),
        ("schedule move", lambda: b_store.move_due(2**40, 10)),
        ("purge", b_store.purge),
    ]
    allowed = [what for what, call in refused if not _refused(admin, a.user, call)]
    assert allowed == [], "group A's user may do these to B or beyond its rights"
    # and B's keys are as B left them
    still = [k for k in _b_keys(admin, b) if k in before]
    assert len(still) >= len([k for k in b_keys if admin.pttl(k) == -1])
    assert {k: admin.dump(k) for k in still} == {k: before[k] for k in still}
    client.close()


def _subscribe(group: Group, channel: str) -> object:
    pubsub = group.client().pubsub()
    pubsub.subscribe(channel)
    return pubsub.get_message(timeout=1.0)


def _refused(admin: redis.Redis, user: str, call: Callable[[], object]) -> bool:
    """Whether ``call`` fails and Redis's ``ACL LOG`` shows it refused ``user`` (a refusal
    inside a script comes back as a script error, not ``NOPERM``)."""
    admin.acl_log_reset()
    try:
        call()
    except (redis.RedisError, IdemError):
        return any(e["username"] == user for e in admin.acl_log(count=1000))
    return False


def _names_of(group: str, topic: str, admin: redis.Redis, tmp_path: Path) -> list[str]:
    """Every Redis key name idem's code builds for ``group`` (and ``topic``'s queues)."""
    keys = RetryKeys(group)
    mq = MessageQueue(topic, 3)
    config = IdemConfig(group=group, redis_url="redis://127.0.0.1:1/0", data_dir=str(tmp_path))
    hot = RedisHotStore.from_config(config, client=admin)
    members = Membership(admin, group, "c1", expire_ms=1000)
    stats = StatsStore(admin, group, marker_ttl_ms=1000)
    return [
        *keys.fixed,
        keys.journal,
        keys.compacted,
        keys.queue("0"),
        keys.queue("timer"),
        offsets_key(group),
        reset_marks_key(group),
        reset_epoch_key(group),
        lock_key(group, mq),
        f"rmq:lock:{{{group}}}:ledger-commit",  # the group commit's lock
        members.members_key,
        members.epoch_key,
        hot.claim_hash("ORDERID_1"),
        *hot._wm,
        stats.totals_key,
        stats.marker_key("q", 1),
        stats.attempts_key("q", 1),
        TopicStore.meta_key(topic),
        TopicStore.queue_key(mq),
    ]


def _dryrun(admin: redis.Redis, user: str, *command: str) -> bool:
    return bool(admin.execute_command("ACL", "DRYRUN", user, *command) == "OK")


def test_patterns_separate_groups_whose_names_share_a_prefix(
    server: RedisServer, tmp_path: Path
) -> None:
    admin = server.client(decode_responses=True)
    groups = {"a": "t*", "a-b": "tx", "a.b": "t?", "ab": "t[x]"}  # topics: glob characters
    for group, topic in groups.items():
        line = acl_user_line(group, topics=[topic], password="pw")
        admin.execute_command("ACL", "SETUSER", *setuser_args(line))
    for group, topic in groups.items():
        own = _names_of(group, topic, admin, tmp_path)
        for name in own[:-2]:
            assert _dryrun(admin, f"idem-{group}", "HSET", name, "f", "v"), name
        for name in own[-2:]:  # its topic: read, not write
            assert _dryrun(admin, f"idem-{group}", "XRANGE", name, "-", "+"), name
            assert not _dryrun(admin, f"idem-{group}", "XADD", name, "*", "f", "v"), name
        for channel in (RetryKeys(group).wake_channel, f"rmq:cg:{{{group}}}:notify"):
            assert _dryrun(admin, f"idem-{group}", "PUBLISH", channel, "x"), channel
        for other, other_topic in groups.items():
            if other == group:
                continue
            reachable = [
                name
                for name in _names_of(other, other_topic, admin, tmp_path)
                if _dryrun(admin, f"idem-{group}", "XRANGE", name, "-", "+")
            ]
            assert reachable == [], f"group {group}'s user reaches group {other}'s keys"
            for channel in (RetryKeys(other).wake_channel, f"rmq:cg:{{{other}}}:notify"):
                assert not _dryrun(admin, f"idem-{group}", "PUBLISH", channel, "x"), channel
