"""Consumers with idem's dedup hook while the network to Redis fails under them.

Two push consumers of one group (real redis-server behind a :class:`FaultProxy`,
real Delta ledger and retry journal on disk) consume a topic; a third of the keys
fail their first attempt, so the send-back path and the retry topic are busy too.
Each of idem's Redis operations — the claim, the COMPLETED update of a group
commit, a send-back, the offset persist, the group commit's lock — is hit by each
fault in turn (a lost reply, a reply later than the client's time-out, a half-open
connection, a reset). Afterwards every key is in the sink exactly once and in the
ledger exactly once, nothing is dead-lettered, and at no moment was a message
acknowledged (its offset persisted past it) without its key in the ledger or its
send-back in the retry journal.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from functools import partial
from pathlib import Path

import pytest
import redis
from checks import AckWatch, ledger_keys, main_topic_messages
from harness import Group, keys
from proxy import Fault, FaultProxy
from redis_ops import Op, matcher
from seeds import Seed
from waiting import eventually

from idem.retry.consumer import DefaultMessageListenerConcurrently
from idem.retry.consumer.offset_store import offsets_key
from idem.retry.message import MessageExt

pytestmark = pytest.mark.faults

TIMEOUT_S = 0.5
"""The clients' socket time-out: a fault costs a client this long before it retries."""
PER_FAULT = 6
"""Keys produced while one fault is armed."""


def _handler(group: Group, name: str, fail_first: set[str]) -> DefaultMessageListenerConcurrently:
    def handle(message: MessageExt) -> None:
        if message.keys in fail_first and message.reconsume_times == 0:
            raise RuntimeError(f"{message.keys}: the sink refuses its first attempt")
        group.sink.write(message, name)

    return DefaultMessageListenerConcurrently(handle)


GROUP_COMMIT = (Op.COMMIT_LOCK, Op.COMMIT_UNLOCK)
"""A group commit: each fault hits its lock or its unlock (the seed decides)."""


@pytest.mark.parametrize(
    "ops",
    [(Op.CLAIM,), (Op.COMPLETE,), (Op.SEND_BACK,), (Op.OFFSET_PERSIST,), GROUP_COMMIT],
    ids=["claim", "complete", "send-back", "offset-persist", "group-commit"],
)
def test_every_fault_during_an_operation_loses_and_repeats_nothing(
    ops: tuple[Op, ...], proxy: FaultProxy, real_redis: redis.Redis, tmp_path: Path, seed: Seed
) -> None:
    group = Group(proxy.url(socket_timeout=TIMEOUT_S), tmp_path, f"g-{uuid.uuid4().hex[:8]}", True)
    fail_first: set[str] = set()
    for name in ("c1", "c2"):
        group.consumer(name, listener=_handler(group, name, fail_first))
    faults = list(Fault)
    seed.rng.shuffle(faults)
    produced: list[str] = []
    figures: list[str] = []
    try:
        with AckWatch(real_redis, group.config, []) as watch:
            for fault in faults:
                op = seed.rng.choice(ops)
                label = f"{op}/{fault}"
                batch = keys(f"{label}-", PER_FAULT)
                fail_first.update(seed.rng.sample(batch, PER_FAULT // 3))
                rule = proxy.arm(fault, matcher(op), label=label, delay_s=TIMEOUT_S * 3)
                produced += group.produce(batch)
                watch.messages[:] = main_topic_messages(real_redis)
                eventually(partial(getattr, rule, "fired"), what=seed.tag(f"{label} injected"))
                hit_at = proxy.injected_of(label)[0].at
                eventually(
                    partial(group.settled, list(produced), offset_client=real_redis),
                    timeout=60,
                    what=seed.tag(f"every key consumed after {label}"),
                )
                figures.append(f"{label}: recovered in {time.monotonic() - hit_at:.2f}s")
            watch.check_now()
        engine = group.consumers[0].engine
        assert engine is not None
        dead = engine.dlq.count()
    finally:
        group.close()
    sent_back = sum(1 for row in group.sink.rows() if row["reconsume"] > 0)
    print(
        f"{'+'.join(ops)}: {len(produced)} messages, {len(fail_first)} failed once "
        f"({sent_back} written from a retry), {len(proxy.injected)} faults; "
        + "; ".join(figures)
        + f"; {watch.checks} acknowledgement checks"
    )
    assert not watch.violations, seed.tag(f"acknowledged without a record: {watch.violations}")
    try:
        group.assert_exactly_once(produced)
    except AssertionError as exc:
        raise AssertionError(seed.tag(str(exc))) from None
    in_ledger = ledger_keys(group.config)
    assert in_ledger == Counter(produced), seed.tag(
        f"ledger: {sorted(k for k, n in in_ledger.items() if n != 1)} not once"
    )
    assert dead == 0, seed.tag(f"{dead} dead letters")
    assert [i.fault for i in proxy.injected] == faults, seed.tag("each fault injected once")


def test_the_acknowledgement_check_sees_an_offset_persisted_past_an_unrecorded_message(
    real_redis: redis.Redis, tmp_path: Path, seed: Seed
) -> None:
    group = Group(
        f"redis://127.0.0.1:{real_redis.connection_pool.connection_kwargs['port']}/0",
        tmp_path,
        f"g-{uuid.uuid4().hex[:8]}",
        True,
    )
    try:
        group.produce(keys("ACK-", 4))
        messages = main_topic_messages(real_redis)
        watch = AckWatch(real_redis, group.config, messages)
        watch.check_now()
        assert watch.violations == []
        first = min(messages, key=lambda m: (m.queue_id, m.queue_offset))
        real_redis.hset(offsets_key(group.name), f"{first.topic}:{first.queue_id}", 1)
        watch.check_now()
        assert watch.violations == [
            f"{first.keys} (queue {first.queue_id}, offset 0, msg {first.msg_id})"
        ], seed.tag("the check must see an acknowledgement nothing recorded")
    finally:
        group.close()
