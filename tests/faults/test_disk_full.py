"""A full disk under running consumers: the ledger, the retry journal and the DLQ, and Redis.

The test mounts small tmpfs filesystems of its own (as root, or through ``sudo -n``;
the fixture unmounts them whatever happens, and fails under CI, skips elsewhere,
when mounting is not permitted): one holds the group's data directory (the Delta
ledger, retry journal and dead-letter table), the other the data directory of the
redis-server holding idem's claims, retry engine and offsets. The topic lives on a
second redis-server and the sink on the ordinary disk. Two consumers with the
dedup hook consume a first batch normally; then a filler file takes every free
byte of the tables' filesystem (every Delta commit fails with ENOSPC), of Redis's
(its background save fails and, with ``stop-writes-on-bgsave-error yes``, it
refuses writes with MISCONF), or of both, while a second batch is produced.

Checked from what the processes really left: while the disk is full, no consume
offset passes a key the ledger does not hold, at no moment is a message
acknowledged without its key in the ledger or its send-back in the journal, and
the errors idem logs say the device is full and name the table (or carry Redis's
MISCONF). Once the filler is deleted: every key is in the ledger exactly once and
in the sink (a function sink sees a key again whose ledger commit failed after its
write, as the guarantees say; only keys consumed on the full disk), nothing is
dead-lettered, and the resend path's audit holds.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from enum import StrEnum
from functools import partial
from pathlib import Path

import pytest
import redis
from checks import AckWatch, ledger_keys
from harness import FAST, TOPIC, keys
from seeds import Seed
from small_fs import Filler, free_bytes, small_filesystem
from split_group import SplitGroup
from waiting import eventually

from idem.config import IdemConfig, LedgerEngine
from idem.redis_server import RedisServer
from idem.retry import FaultTolerance, RetryEngine, SendBackStatus
from idem.retry.audit import audit_states
from idem.retry.consumer import MessageQueue, consumer_offsets
from idem.retry.message import MessageExt

pytestmark = pytest.mark.faults

PER_BATCH = 20
FULL_FOR_S = 4.0
"""How long the consumers work against the full disk."""


@pytest.fixture
def tables_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs for the group's Delta tables."""
    with small_filesystem(tmp_path / "tables-fs", 16) as path:
        yield path


@pytest.fixture
def redis_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs for the store's snapshots."""
    with small_filesystem(tmp_path / "redis-fs", 16) as path:
        yield path


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    """The topic's redis-server, on the ordinary disk."""
    with RedisServer(directory=tmp_path / "broker") as server:
        yield server


@pytest.fixture
def store(redis_fs: Path) -> Iterator[RedisServer]:
    """idem's redis-server, its snapshots on the small filesystem, refusing writes once a
    background save failed."""
    server = RedisServer(
        directory=redis_fs / "redis",
        extra={"save": "1 1", "stop-writes-on-bgsave-error": "yes"},
    )
    with server:
        yield server


def _bgsave_status(client: redis.Redis) -> str:
    return str(client.info("persistence")["rdb_last_bgsave_status"])


def _save_now(client: redis.Redis) -> str:
    """Run a background save that starts now (after any running one) and return its outcome,
    ``ok`` or ``err``."""

    def idle() -> bool:
        return not client.info("persistence")["rdb_bgsave_in_progress"]

    for _ in range(20):
        eventually(idle, timeout=30, what="the running background save ended")
        try:
            client.bgsave()
        except redis.ResponseError:  # Redis's own schedule started one meanwhile
            continue
        eventually(idle, timeout=30, what="the background save ended")
        return _bgsave_status(client)
    raise AssertionError("no background save could be started")


class Full(StrEnum):
    """Which filesystem the filler fills."""

    TABLES = "delta-tables"
    """The ledger, the retry journal and the DLQ: every Delta commit fails with ENOSPC."""
    REDIS = "redis"
    """The store's snapshots: a background save fails and Redis refuses writes (MISCONF)."""
    BOTH = "both"


def _logged(records: list[logging.LogRecord]) -> list[str]:
    """Each record as a handler would write it, traceback included."""
    formatter = logging.Formatter("%(levelname)s %(name)s %(message)s")
    return [formatter.format(r) for r in records]


@pytest.mark.parametrize("full", list(Full))
def test_a_full_disk_acknowledges_nothing_and_loses_and_repeats_nothing_once_freed(  # noqa: PLR0917 (fixtures and parameters)
    full: Full,
    broker: RedisServer,
    store: RedisServer,
    tables_fs: Path,
    redis_fs: Path,
    tmp_path: Path,
    seed: Seed,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = IdemConfig(
        group=f"full-{uuid.uuid4().hex[:8]}",
        redis_url=store.url,
        data_dir=str(tables_fs / "data"),
        delay_levels="1s 1s 1s",
        lease_ms=3_000,
        consume_timeout_ms=10_000,
        engine=LedgerEngine.DELTA_RS,
    )
    store_url = f"{store.url}?socket_timeout=1&socket_connect_timeout=1"
    group = SplitGroup(
        config, broker_url=broker.url, store_url=store_url, settings=FAST, base=tmp_path
    )
    reader = store.client(socket_timeout=2)
    fills = {Full.TABLES: [tables_fs], Full.REDIS: [redis_fs], Full.BOTH: [tables_fs, redis_fs]}
    fillers = [Filler(path) for path in fills[full]]
    first, second = keys("A-", PER_BATCH), keys("B-", PER_BATCH)
    group.fail_first.update(seed.rng.sample(first, PER_BATCH // 4))
    group.fail_first.update(seed.rng.sample(second, PER_BATCH // 4))
    caplog.set_level(logging.WARNING)
    try:
        for name in ("c1", "c2"):
            group.consumer(name)
        group.produce(first)
        eventually(
            partial(group.settled, first, reader),
            timeout=60,
            what=seed.tag("the first batch consumed on disks with room"),
        )
        before = consumer_offsets(reader, group.name)
        for filler in fillers:
            filler.fill()
            assert free_bytes(filler.path.parent) < 4096, f"{filler.path}: space left"
        if full is not Full.TABLES:
            assert _save_now(reader) == "err", "a background save on the full disk must fail"
            with pytest.raises(redis.ResponseError, match="MISCONF"):
                reader.set(f"probe-{group.name}", 1)
        caplog.clear()
        with AckWatch(reader, config, []) as watch:
            group.produce(second)
            watch.messages[:] = group.messages()
            time.sleep(FULL_FOR_S)
            while_full = consumer_offsets(reader, group.name)
            unwritten = set(second) - set(ledger_keys(config))
            passed = [
                m.keys
                for m in watch.messages
                if m.keys in unwritten
                and m.queue_offset < while_full.get(MessageQueue(m.topic, m.queue_id), 0)
            ]
            logged = _logged(caplog.records)
            for filler in fillers:
                filler.free()
            if full is not Full.TABLES:
                assert _save_now(reader) == "ok", "a background save with room must succeed"
            eventually(
                partial(group.settled, first + second, reader),
                timeout=90,
                what=seed.tag("every key consumed once the disks have room"),
            )
            watch.check_now()
        engine = group.engines[0]
        dead = engine.dlq.count()
        in_ledger = ledger_keys(config)
        messages = group.messages()
        audit = audit_states(
            engine,
            expected={m.msg_id for m in messages},
            done={m.msg_id for m in messages if in_ledger[m.keys] > 0},
        )
    finally:
        for filler in fillers:
            filler.free()
        group.close()
        reader.close()
    rows = group.sink.rows()
    counts = Counter(row["key"] for row in rows)
    repeats = {k: n for k, n in counts.items() if n > 1}
    print(
        f"{full} full: offsets {sorted(before.values())} -> {sorted(while_full.values())}, "
        f"{len(logged)} warnings; sink {len(rows)} rows for {len(first + second)} keys, "
        f"repeats {repeats}"
    )
    # a consume offset may pass a message whose send-back was journaled (it is recorded);
    # the watch checks that at every moment, this checks the offsets of the unwritten keys
    assert not passed, seed.tag(f"offsets passed keys not in the ledger: {passed}")
    if full is Full.REDIS:
        assert any("MISCONF" in e for e in logged), seed.tag(f"no MISCONF logged: {logged[:3]}")
    else:
        no_space = [e for e in logged if "No space left on device" in e]
        assert no_space, seed.tag(f"no error said the device is full: {logged[:3]}")
        assert any(str(tables_fs) in e for e in no_space), seed.tag(
            f"no error named the table on the full disk: {no_space[:3]}"
        )
    assert not watch.violations, seed.tag(f"acknowledged without a record: {watch.violations}")
    assert in_ledger == Counter(first + second), seed.tag(
        f"ledger: {sorted(k for k, n in in_ledger.items() if n != 1)[:10]} not once"
    )
    assert set(counts) == set(first + second), seed.tag("every key in the sink, nothing else")
    # a key whose ledger commit failed after its sink write is consumed again: a function
    # sink sees it again (the ledger, checked above, holds it once)
    assert set(repeats) <= set(second), seed.tag(f"keys consumed with room repeated: {repeats}")
    assert dead == 0, seed.tag(f"{dead} dead letter(s)")
    assert audit.ok, seed.tag(f"retry audit: {audit.describe()}")


@pytest.mark.parametrize("table", ["journal_path", "dlq_path"])
def test_a_send_back_on_a_full_disk_names_the_table_it_could_not_write(
    table: str,
    tables_fs: Path,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = str(tables_fs / "table")
    config = IdemConfig(
        group=f"full-{uuid.uuid4().hex[:8]}",
        redis_url=redis_server.url,
        data_dir=str(tables_fs / "data"),
        **{table: path},  # type: ignore[arg-type]
    )
    engine = RetryEngine(config, client=real_redis, faults=FaultTolerance(delta_attempts=1))
    message = MessageExt(topic=TOPIC, msg_id="M1", keys="K1", body=b"{}")
    filler = Filler(tables_fs)
    try:
        filler.fill()
        with caplog.at_level(logging.WARNING, logger="idem.retry.engine"):
            if table == "journal_path":
                result = engine.send_back([message])
            else:
                result = engine.dead_letter([message], reason="a bad row")
    finally:
        filler.free()
        engine.close()
    assert [o.status for o in result.outcomes] == [SendBackStatus.RESUBMIT_LATER]
    failures = [str(r.exc_info[1]) for r in caplog.records if r.exc_info and r.exc_info[1]]
    assert failures, "the failed write was not logged"
    assert "No space left on device" in failures[-1], failures[-1]
    assert path in failures[-1], f"the error does not name {path}: {failures[-1]}"
