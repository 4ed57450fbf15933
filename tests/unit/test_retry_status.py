"""Consume statuses and contexts: RocketMQ's ackIndex, listener and orderly rules."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from idem.retry import (
    ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus,
    ConsumeOrderlyContext,
    ConsumeOrderlyStatus,
    MessageExt,
    MessageModel,
    OrderlyAction,
    orderly_outcome,
    run_listener,
    split_consume_result,
)

pytestmark = pytest.mark.unit

BATCH = [MessageExt(topic="t", msg_id=f"m{i}", queue_offset=i) for i in range(4)]


def test_success_acks_the_whole_batch_by_default() -> None:
    result = split_consume_result(
        BATCH, ConsumeConcurrentlyStatus.CONSUME_SUCCESS, ConsumeConcurrentlyContext()
    )
    assert result.acked == tuple(BATCH)
    assert result.send_back == ()


def test_ack_index_sends_back_the_rest() -> None:
    context = ConsumeConcurrentlyContext(ack_index=1)
    result = split_consume_result(BATCH, ConsumeConcurrentlyStatus.CONSUME_SUCCESS, context)
    assert [m.msg_id for m in result.acked] == ["m0", "m1"]
    assert [m.msg_id for m in result.send_back] == ["m2", "m3"]


def test_reconsume_later_sends_back_everything_whatever_ack_index_says() -> None:
    context = ConsumeConcurrentlyContext(ack_index=2)
    result = split_consume_result(BATCH, ConsumeConcurrentlyStatus.RECONSUME_LATER, context)
    assert result.acked == ()
    assert result.send_back == tuple(BATCH)


def test_broadcasting_drops_failures_instead_of_retrying() -> None:
    result = split_consume_result(
        BATCH,
        ConsumeConcurrentlyStatus.RECONSUME_LATER,
        ConsumeConcurrentlyContext(),
        MessageModel.BROADCASTING,
    )
    assert result.send_back == ()
    assert result.dropped == tuple(BATCH)


def test_an_exception_or_none_from_the_listener_means_reconsume_later() -> None:
    def raises(_m: Sequence[MessageExt], _c: ConsumeConcurrentlyContext) -> None:
        raise RuntimeError("db down")

    context = ConsumeConcurrentlyContext()
    assert run_listener(raises, BATCH, context) is ConsumeConcurrentlyStatus.RECONSUME_LATER
    assert run_listener(lambda _m, _c: None, BATCH, context) is (
        ConsumeConcurrentlyStatus.RECONSUME_LATER
    )
    assert (
        run_listener(lambda _m, _c: ConsumeConcurrentlyStatus.CONSUME_SUCCESS, BATCH, context)
        is ConsumeConcurrentlyStatus.CONSUME_SUCCESS
    )


def test_listener_sets_the_delay_level_on_the_context() -> None:
    def listener(_m: Sequence[MessageExt], c: ConsumeConcurrentlyContext) -> str:
        c.delay_level_when_next_consume = -1
        return "RECONSUME_LATER"

    context = ConsumeConcurrentlyContext()
    assert run_listener(listener, BATCH, context) is ConsumeConcurrentlyStatus.RECONSUME_LATER
    assert context.delay_level_when_next_consume == -1


def test_orderly_retries_locally_then_dead_letters() -> None:
    young = MessageExt(topic="t", msg_id="a", reconsume_times=3)
    old = MessageExt(topic="t", msg_id="b", reconsume_times=16)
    ok = orderly_outcome(
        [young], ConsumeOrderlyStatus.SUCCESS, ConsumeOrderlyContext(), max_reconsume_times=16
    )
    assert ok.action is OrderlyAction.COMMIT
    suspended = orderly_outcome(
        [young],
        ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT,
        ConsumeOrderlyContext(),
        max_reconsume_times=16,
    )
    assert suspended.action is OrderlyAction.SUSPEND
    assert suspended.suspend_ms == 1000
    assert suspended.retry[0].reconsume_times == 4
    dead = orderly_outcome(
        [old],
        ConsumeOrderlyStatus.SUSPEND_CURRENT_QUEUE_A_MOMENT,
        ConsumeOrderlyContext(suspend_current_queue_time_millis=50),
        max_reconsume_times=16,
    )
    assert dead.action is OrderlyAction.DEAD_LETTER
    assert dead.dead == (old,)
