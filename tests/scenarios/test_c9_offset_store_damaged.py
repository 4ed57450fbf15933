"""C9: the offset store is damaged (seed 004: "offset.json文件意外损坏或删除").

A broadcasting consumer keeps its offsets in a local file (``offsets.json`` and
its ``.bak``). Both are damaged while it is down; on restart it has no offsets
and starts from ``CONSUME_FROM_FIRST_OFFSET`` — everything is delivered again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import FAST, Group, keys
from waiting import eventually

from idem.retry.consumer import LocalFileOffsetStore
from idem.retry.status import MessageModel

pytestmark = pytest.mark.scenarios


def test_c9_damaged_offset_file(group: Group, tmp_path: Path) -> None:
    settings = FAST.with_changes(
        message_model=MessageModel.BROADCASTING,
        offset_store_dir=str(tmp_path / "offsets"),
        await_termination_ms=5000,
    )
    dedup_group = f"{group.name}-bc-1"  # broadcasting: every instance consumes every key once
    wanted = group.produce(keys("C9-", 12))
    first = group.consumer("bc-1", settings=settings, dedup_group=dedup_group)
    eventually(lambda: group.sink.has_all(wanted), what="every key consumed")
    first.shutdown()  # persists offsets.json
    store = first.offset_store
    assert isinstance(store, LocalFileOffsetStore)
    assert '"orders:0": 3' in store.path.read_text()
    store.path.write_text('{"offsetTable": {"orders:0": ')  # a torn write
    store.backup.write_text("\x00\x00garbage")

    again = group.consumer("bc-1", settings=settings, dedup_group=dedup_group)
    if not group.dedup:
        eventually(
            lambda: set(group.sink.duplicates()) == set(wanted), what="everything written again"
        )
        return
    eventually(
        lambda: sum(mw.stats.duplicates["completed"] for mw in group.middlewares) == len(wanted),
        what="every redelivery absorbed",
    )
    eventually(lambda: again.stats.snapshot()["consumed_ok"] == len(wanted))
    group.assert_exactly_once(wanted)
