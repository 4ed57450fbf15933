"""C8: the pull offset is reset to the server's lower offset (seed 004).

The group's offsets are moved back on the server (``resetOffsetByTime`` to the
start of the second phase) while the consumer runs; the server tells the
running instance (RocketMQ's ``RESET_CONSUMER_CLIENT_OFFSET``), which drops its
queues and pulls again from the server's lower offsets.

When the instance misses that notice (its pub/sub connection was down at that
moment), its next offset persist must not write the old offsets back over the
reset: the persist learns of the reset, and the instance applies it then.
"""

from __future__ import annotations

import time

import pytest
from harness import FAST, TOPIC, Group, keys
from waiting import eventually

from idem.retry.consumer import reset_offset_by_time

pytestmark = pytest.mark.scenarios


@pytest.mark.parametrize("notice", ["heard", "lost"])
def test_c8_offset_reset_backwards(group: Group, notice: str) -> None:
    first = group.produce(keys(f"C8{notice}-A", 8))
    # No timed rebalance within the test: the reset queues must come back at once.
    consumer = group.consumer("c", settings=FAST.with_changes(rebalance_interval_ms=120_000))
    eventually(group.caught_up, what="the first phase consumed")
    time.sleep(0.01)
    second_started_ms = int(time.time() * 1000)
    second = group.produce(keys(f"C8{notice}-B", 8))
    eventually(lambda: group.settled(first + second), what="the second phase consumed")

    if notice == "lost":
        assert consumer.rebalance_service is not None
        consumer.rebalance_service.on_notice = None
    moved = reset_offset_by_time(group.client, group.name, TOPIC, second_started_ms)
    assert sum(moved.values()) == 8  # every queue back to the start of the second phase

    wanted = first + second
    if not group.dedup:
        eventually(
            lambda: set(group.sink.duplicates()) == set(second),
            timeout=10,
            what="the second phase written again",
        )
        return
    eventually(
        lambda: group.settled(wanted) and group.duplicates_by_cause()["completed"] == len(second),
        timeout=10,
        what="the second phase redelivered and absorbed",
    )
    group.assert_exactly_once(wanted)
