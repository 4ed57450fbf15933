"""C3: the consumer crashes after consuming, before its offset persist (seed 004).

A consumer *process* consumes; the offsets of a first phase are persisted; it
then consumes a second phase and is killed with SIGKILL right after a message
was written to the sink (and, with dedup, completed) — before the next persist.
Its successor starts from the last persisted offsets and receives the second
phase again.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from harness import Group, keys
from waiting import eventually

from idem.retry.consumer import consumer_offsets

pytestmark = pytest.mark.scenarios

CHILD = Path(__file__).with_name("crash_consumer.py")


def test_c3_crash_before_offset_persist(group: Group) -> None:
    first = group.produce(keys("C3-A", 8))
    crash_key = "C3-B0007"
    spec = {
        "redis_url": group.redis_url,
        "base": str(group.base),
        "group": group.name,
        "dedup": group.dedup,
        "crash_key": crash_key,
        "persist_ms": 300,
    }
    child = subprocess.Popen([sys.executable, str(CHILD), json.dumps(spec)])
    try:
        eventually(
            lambda: sum(consumer_offsets(group.client, group.name).values()) == 8,
            timeout=30,
            what="the first phase consumed and its offsets persisted",
        )
        second = group.produce(keys("C3-B", 8))
        assert child.wait(timeout=30) == -9  # SIGKILL: no shutdown, no final persist
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    written = group.sink.counts()
    assert written[crash_key] == 1, "the crash came after the sink write"
    persisted = sum(consumer_offsets(group.client, group.name).values())
    assert persisted < 16, "the crash came before the offsets of the second phase persisted"

    group.consumer("successor")
    wanted = first + second
    if not group.dedup:
        eventually(lambda: group.sink.duplicates().get(crash_key), what="the crash key again")
        rows = group.sink.rows_of(crash_key)
        assert [r["by"] for r in rows] == ["child", "successor"]
        assert rows[0]["msg_id"] == rows[1]["msg_id"]  # the same message, delivered again
        eventually(lambda: group.settled(wanted), what="every key written")
        return
    eventually(
        lambda: group.settled(wanted) and group.duplicates_by_cause()["completed"],
        what="the second phase redelivered and absorbed",
    )
    group.assert_exactly_once(wanted)
    redelivered = {
        r.key for mw in group.middlewares for r in mw.stats.duplicate_records("completed")
    }
    assert crash_key in redelivered
    assert redelivered <= set(second)
