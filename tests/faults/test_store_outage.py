"""A Redis outage of 1, 5 and 30 minutes under running consumers, time scaled.

Two consumers with idem's dedup hook consume a topic on a broker redis-server;
their claims, index, retry engine and offsets live on a second redis-server, the
*store*, which goes away while messages keep arriving: it is frozen (SIGSTOP, a
hung server: connections stay open and nothing answers), or killed (SIGKILL) and
restarted on its AOF (``appendfsync always``, so every write Redis acknowledged
survives). A third of the keys fail their first attempt, so the retry path is busy
before, during and after the outage.

Time is scaled: one configured minute lasts ``IDEM_OUTAGE_SCALE`` seconds of the
test (0.2 by default, so the 30-minute outage lasts 6 s; 60 runs in real time).
Every duration of the configuration is scaled by that same factor from idem's own
defaults: the dedup lease (5 min), the consume timeout (15 min), RocketMQ's delay
ladder ("1s 5s ... 2h"), the re-submit delay of a send-back that reached no store
(5 s), the consumers' offset-persist, rebalance and heartbeat intervals (5 s, 20 s,
30 s), and the store clients' read and connect time-outs (30 s, 5 s). Where the
scaled value would fall below what idem accepts or below a sane floor (a lease or
consume timeout of 1 s, client time-outs of 0.25 s, intervals of 0.1 s) the floor
is used instead. ``IDEM_OUTAGE_MINUTES=1,5,30`` picks the outage lengths::

    IDEM_OUTAGE_SCALE=60 IDEM_OUTAGE_MINUTES=30 pytest -m faults tests/faults/test_store_outage.py

Afterwards, from what the processes really left behind: every key is in the sink
and in the ledger exactly once, nothing is dead-lettered (``max_reconsume_times``
is 3, so an outage counted as the listener's failure would dead-letter), no
message was acknowledged without a record, the resend path's audit holds (every
message done, none retrying or dead, Redis agreeing with the journal), and from
the moment the store is back until everything settled, no key ever had more than
one live retry (entries of the schedule queues and ``%RETRY%<group>`` together).
"""

from __future__ import annotations

import os
import signal
import threading
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
from harness import assert_exactly_once, keys
from seeds import Seed
from split_group import SplitGroup
from waiting import eventually

from idem.config import IdemConfig, LedgerEngine
from idem.delay_levels import DEFAULT_DELAY_LEVELS, DelayLevels
from idem.redis_server import RedisServer
from idem.retry.audit import audit_states
from idem.retry.consumer import ConsumeFromWhere, ConsumerSettings
from idem.retry.consumer.offset_store import DEFAULT_PERSIST_INTERVAL_MS
from idem.retry.consumer.rebalance import (
    DEFAULT_HEARTBEAT_INTERVAL_MS,
    DEFAULT_REBALANCE_INTERVAL_MS,
)
from idem.retry.faults import RESUBMIT_DELAY_MS, FaultTolerance
from idem.retry.store import ScheduleStore

pytestmark = pytest.mark.faults

SCALE_VARIABLE = "IDEM_OUTAGE_SCALE"
"""Seconds of test time per configured minute (60: real time)."""
MINUTES_VARIABLE = "IDEM_OUTAGE_MINUTES"
"""The outage lengths to run, in configured minutes, comma-separated."""

SCALE_S_PER_MINUTE = float(os.environ.get(SCALE_VARIABLE, "0.2"))
OUTAGE_MINUTES = [float(m) for m in os.environ.get(MINUTES_VARIABLE, "1,5,30").split(",")]
FACTOR = SCALE_S_PER_MINUTE / 60.0
"""Test time per unit of configured time."""

MINUTE_MS = 60_000
PER_PHASE = 24
"""Keys produced before, during and after the outage."""


def scaled_ms(ms: float, floor_ms: int) -> int:
    """A configured duration in test time, never below ``floor_ms``."""
    return max(floor_ms, round(ms * FACTOR))


class Outage(StrEnum):
    """How the store goes away."""

    FROZEN = "sigstop"
    """SIGSTOP, SIGCONT at the end: a hung server."""
    CRASHED = "sigkill-restart"
    """SIGKILL, restarted on its AOF at the end."""


def _config(group: str, store_url: str, data_dir: Path) -> IdemConfig:
    ladder = DelayLevels.parse(DEFAULT_DELAY_LEVELS).delays_ms
    levels = " ".join(f"{scaled_ms(ms, 1)}ms" for ms in ladder)
    return IdemConfig(
        group=group,
        redis_url=store_url,
        data_dir=str(data_dir),
        lease_ms=scaled_ms(5 * MINUTE_MS, 1000),
        consume_timeout_ms=scaled_ms(15 * MINUTE_MS, 1000),
        delay_levels=DelayLevels.parse(levels),
        max_reconsume_times=3,
        engine=LedgerEngine.DELTA_RS,
    )


def _settings(config: IdemConfig) -> ConsumerSettings:
    return ConsumerSettings(
        consume_from_where=ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET,
        persist_consumer_offset_interval_ms=scaled_ms(DEFAULT_PERSIST_INTERVAL_MS, 100),
        rebalance_interval_ms=scaled_ms(DEFAULT_REBALANCE_INTERVAL_MS, 100),
        heartbeat_interval_ms=scaled_ms(DEFAULT_HEARTBEAT_INTERVAL_MS, 100),
        consume_timeout_ms=config.consume_timeout_ms,
        pull_block_ms=100,
        consume_thread_nums=4,
    )


def _store_url(store: RedisServer) -> str:
    read_s = max(0.25, 30 * FACTOR)
    connect_s = max(0.25, 5 * FACTOR)
    return f"{store.url}?socket_timeout={read_s:g}&socket_connect_timeout={connect_s:g}"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    """The topic's redis-server (never faulted)."""
    with RedisServer(directory=tmp_path / "broker") as server:
        yield server


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RedisServer]:
    """idem's redis-server, on an AOF fsynced at every write; resumed and stopped at the end
    whatever the test left it in."""
    server = RedisServer(directory=tmp_path / "store", appendonly=True, appendfsync="always")
    server.start()
    try:
        yield server
    finally:
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()


class LiveRetries:
    """Samples the store's live retries (scheduled or in ``%RETRY%<group>``) per key in a
    thread; :attr:`worst` holds the most any key had at once."""

    def __init__(self, group: SplitGroup, client: redis.Redis, key_of: dict[str, str]) -> None:
        self.store = ScheduleStore(client, group.name)
        self.key_of = key_of
        self.worst: Counter[str] = Counter()
        self.seen: dict[str, list[str]] = {}
        """The entries of a key when it had more than one."""
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="live-retries")

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                entries = list(self.store.live_entries())
            except redis.RedisError:
                continue
            per_key: dict[str, list[str]] = {}
            for e in entries:
                key = self.key_of.get(e.origin_msg_id, e.origin_msg_id)
                per_key.setdefault(key, []).append(f"{e.msg_id} {e.state} {e.location}")
            for key, found in per_key.items():
                self.worst[key] = max(self.worst[key], len(found))
                if len(found) > 1:
                    self.seen.setdefault(key, found)
            self.samples += 1

    def __enter__(self) -> LiveRetries:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _produce_over(group: SplitGroup, batch: list[str], seconds: float) -> threading.Thread:
    """Produce ``batch`` spread evenly over ``seconds`` (in a thread)."""

    def run() -> None:
        for key in batch:
            group.produce([key])
            time.sleep(seconds / len(batch))

    thread = threading.Thread(target=run, daemon=True, name="outage-producer")
    thread.start()
    return thread


def _down(store: RedisServer, outage: Outage) -> None:
    pid = store.pid
    assert pid is not None
    if outage is Outage.FROZEN:
        os.kill(pid, signal.SIGSTOP)
    else:
        store.kill()


def _up(store: RedisServer, outage: Outage) -> None:
    if outage is Outage.FROZEN:
        pid = store.pid
        assert pid is not None
        os.kill(pid, signal.SIGCONT)
    else:
        store.start()


def _cases() -> list[object]:
    cases: list[object] = []
    for minutes in OUTAGE_MINUTES:
        for outage in Outage:
            # a full-length run outlasts the suite's default time-out
            marks = [pytest.mark.timeout(600 + 6 * minutes * SCALE_S_PER_MINUTE)]
            cases.append(pytest.param(minutes, outage, marks=marks, id=f"{minutes:g}min-{outage}"))
    return cases


@pytest.mark.parametrize(("minutes", "outage"), _cases())
def test_a_store_outage_dead_letters_nothing_and_leaves_one_live_retry_per_message(  # noqa: PLR0917 (fixtures and parameters)
    minutes: float,
    outage: Outage,
    broker: RedisServer,
    store: RedisServer,
    tmp_path: Path,
    seed: Seed,
) -> None:
    outage_s = minutes * SCALE_S_PER_MINUTE
    config = _config(f"outage-{uuid.uuid4().hex[:8]}", _store_url(store), tmp_path / "data")
    faults = FaultTolerance(resubmit_delay_ms=scaled_ms(RESUBMIT_DELAY_MS, 50))
    group = SplitGroup(
        config,
        broker_url=broker.url,
        store_url=config.redis_url,
        settings=_settings(config),
        base=tmp_path,
        faults=faults,
    )
    watcher = store.client(socket_timeout=0.5, socket_connect_timeout=0.5)
    produced: list[str] = []
    try:
        for name in ("c1", "c2"):
            group.consumer(name)
        phases = {p: keys(f"{p}-", PER_PHASE) for p in ("before", "during", "after")}
        for batch in phases.values():
            group.fail_first.update(seed.rng.sample(batch, PER_PHASE // 3))
        with AckWatch(watcher, config, []) as watch:
            produced += group.produce(phases["before"])
            watch.messages[:] = group.messages()
            # the outage starts with first attempts done and their retries under way
            eventually(
                lambda: group.sink.has_all(set(phases["before"]) - group.fail_first),
                timeout=60,
                what=seed.tag("the first keys consumed before the outage"),
            )
            _down(store, outage)
            began = time.monotonic()
            producing = _produce_over(group, phases["during"], outage_s)
            time.sleep(max(0.0, began + outage_s - time.monotonic()))
            producing.join()
            produced += phases["during"]
            key_of = {m.msg_id: m.keys for m in group.messages()}
            _up(store, outage)
            recovered = time.monotonic()
            with LiveRetries(group, watcher, key_of) as live:
                produced += group.produce(phases["after"])
                messages = group.messages()
                watch.messages[:] = messages
                key_of.update({m.msg_id: m.keys for m in messages})
                eventually(
                    partial(group.settled, list(produced), watcher),
                    timeout=120 + 4 * outage_s,
                    what=seed.tag(f"every key consumed after a {minutes:g}-minute {outage}"),
                )
                settled_s = time.monotonic() - recovered
            watch.check_now()
        engine = group.engines[0]
        dead = engine.dlq.count()
        in_ledger = ledger_keys(config)
        audit = audit_states(
            engine,
            expected={m.msg_id for m in messages},
            done={m.msg_id for m in messages if in_ledger[m.keys] > 0},
        )
    finally:
        group.close()
        watcher.close()
    retried = sum(1 for row in group.sink.rows() if row["reconsume"] > 0)
    print(
        f"{minutes:g}-minute {outage} ({outage_s:.1f}s at {SCALE_S_PER_MINUTE:g}s/min): "
        f"{len(produced)} keys, {len(group.fail_first)} failed once, {retried} written from "
        f"a retry; settled {settled_s:.1f}s after recovery; {live.samples} live-retry samples, "
        f"{watch.checks} acknowledgement checks"
    )
    try:
        assert_exactly_once(group.sink, produced)
    except AssertionError as exc:
        raise AssertionError(seed.tag(str(exc))) from None
    assert in_ledger == Counter(produced), seed.tag(
        f"ledger: {sorted(k for k, n in in_ledger.items() if n != 1)[:10]} not once"
    )
    assert dead == 0, seed.tag(f"{dead} healthy message(s) dead-lettered")
    assert not watch.violations, seed.tag(f"acknowledged without a record: {watch.violations}")
    assert audit.ok, seed.tag(f"retry audit: {audit.describe()}")
    assert live.samples > 0, seed.tag("the live retries were never read after recovery")
    doubled = {k: n for k, n in live.worst.items() if n > 1}
    assert not doubled, seed.tag(
        f"more than one live retry of a key after recovery: {doubled} {live.seen}"
    )
