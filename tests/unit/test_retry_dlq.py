"""The %DLQ%<group> Delta table: one row per dead message, queryable, replayable."""

from __future__ import annotations

from pathlib import Path

import pytest
from deltalake import DeltaTable

from idem.clock import ManualClock
from idem.retry import (
    DeadLetter,
    DeadLetterStatus,
    DeadLetterTable,
    MessageConst,
    MessageExt,
    SendBackProcessor,
)
from idem.retry.sendback import DeadLettered

pytestmark = pytest.mark.unit


def _letters(clock: ManualClock, n: int) -> list[DeadLetter]:
    processor = SendBackProcessor("CID_dlq", clock=clock)
    out = []
    for i in range(n):
        message = MessageExt(
            topic="TopicTest",
            msg_id=f"M{i}",
            keys=f"ORDER_{i}",
            body=f"body {i}".encode(),
            reconsume_times=16,
            properties={MessageConst.PROPERTY_ORIGIN_MESSAGE_ID: f"O{i}"},
        )
        decision = processor.process(message, error=ValueError(f"bad {i}"))
        assert isinstance(decision, DeadLettered)
        out.append(decision.letter)
    return out


def test_a_dead_letter_written_twice_is_one_row(tmp_path: Path, clock: ManualClock) -> None:
    table = DeadLetterTable(str(tmp_path / "dlq"), "CID_dlq", clock=clock)
    assert table.write(_letters(clock, 3)) == 3
    clock.advance(86_400)  # the retry after a crash happens the next day: new dead_at
    assert table.write(_letters(clock, 4)) == 1
    rows = table.list()
    assert sorted(r.origin_msg_id for r in rows) == ["O0", "O1", "O2", "O3"]
    assert DeltaTable(str(tmp_path / "dlq")).metadata().partition_columns == ["dead_date"]
    assert DeltaTable(str(tmp_path / "dlq")).metadata().name == "%DLQ%CID_dlq"


def test_a_replayed_message_that_dies_again_is_dead_again_not_left_as_replayed(
    tmp_path: Path, clock: ManualClock
) -> None:
    """A replay walks the same msg ids as the message's first life, so its second death
    matches the REPLAYED row: that row must be DEAD again (listed, replayable), or the
    message is in neither the sink, the retry topic nor the DLQ's dead letters."""
    table = DeadLetterTable(str(tmp_path / "dlq"), "CID_dlq", clock=clock)
    [first] = _letters(clock, 1)
    assert table.write([first]) == 1
    clock.advance(60)
    assert table.mark_replayed([first], by="ops@host") == 1
    assert table.write([first]) == 0  # the same death written twice stays one replayed row
    clock.advance(3600)
    [again] = _letters(clock, 1)  # the replay failed all the way down the ladder again
    assert (again.origin_msg_id, again.msg_id) == (first.origin_msg_id, first.msg_id)
    assert table.write([again]) == 1
    [row] = table.list()
    assert row.status is DeadLetterStatus.DEAD
    assert row.dead_at_ms == again.dead_at_ms
    assert row.replayed_by == "ops@host"  # who replayed it last is kept
    assert [r.origin_msg_id for r in table.list(status=DeadLetterStatus.DEAD)] == ["O0"]


def test_a_transaction_already_committed_writes_nothing(tmp_path: Path, clock: ManualClock) -> None:
    table = DeadLetterTable(str(tmp_path / "dlq"), "CID_dlq", clock=clock)
    assert table.write(_letters(clock, 2), app_id="q", txn_version=3) == 2
    version = DeltaTable(str(tmp_path / "dlq")).version()
    assert table.write(_letters(clock, 2), app_id="q", txn_version=3) == 0
    assert DeltaTable(str(tmp_path / "dlq")).version() == version


def test_rows_carry_the_documented_schema(tmp_path: Path, clock: ManualClock) -> None:
    table = DeadLetterTable(str(tmp_path / "dlq"), "CID_dlq", clock=clock)
    table.write(_letters(clock, 1))
    (row,) = table.list()
    assert (row.group, row.topic, row.key, row.msg_id, row.origin_msg_id) == (
        "CID_dlq",
        "TopicTest",
        "ORDER_0",
        "M0",
        "O0",
    )
    assert row.body == b"body 0"
    assert row.reconsume_times == 16
    assert row.last_error == "ValueError: bad 0"
    assert [(e.type, e.message) for e in row.errors] == [("ValueError", "bad 0")]
    assert row.dead_at_ms == clock.now_ms()
    assert row.status is DeadLetterStatus.DEAD
    assert row.replayed_at_ms is None
    assert "reconsume times reached max" in row.reason
    names = DeltaTable(str(tmp_path / "dlq")).schema().to_arrow().names
    assert names == [
        "group",
        "topic",
        "key",
        "msg_id",
        "origin_msg_id",
        "body",
        "properties",
        "reconsume_times",
        "first_failed_at",
        "dead_at",
        "last_error",
        "errors",
        "status",
        "replayed_at",
        "dead_date",
        "replayed_by",
    ]


def test_replay_and_discard_change_status_once(tmp_path: Path, clock: ManualClock) -> None:
    table = DeadLetterTable(str(tmp_path / "dlq"), "CID_dlq", clock=clock)
    letters = _letters(clock, 3)
    table.write(letters)
    clock.advance(60)
    assert table.mark_replayed([letters[0]]) == 1
    assert table.mark_replayed([letters[0]]) == 0  # only DEAD rows change
    assert table.mark_discarded([("O1", "M1")]) == 1
    by_origin = {r.origin_msg_id: r for r in table.list()}
    assert by_origin["O0"].status is DeadLetterStatus.REPLAYED
    assert by_origin["O0"].replayed_at_ms == clock.now_ms()
    assert by_origin["O1"].status is DeadLetterStatus.DISCARDED
    assert [r.origin_msg_id for r in table.list(status=DeadLetterStatus.DEAD)] == ["O2"]
    assert [r.msg_id for r in table.show("O2")] == ["M2"]
    replay = by_origin["O0"].to_message()
    assert (replay.topic, replay.keys, replay.body, replay.origin_msg_id) == (
        "TopicTest",
        "ORDER_0",
        b"body 0",
        "O0",
    )


def test_an_absent_table_reads_as_empty(tmp_path: Path, clock: ManualClock) -> None:
    table = DeadLetterTable(str(tmp_path / "nothing"), "CID_dlq", clock=clock)
    assert table.list() == []
    assert table.mark_discarded([("O", "M")]) == 0


def test_dead_among_names_the_dead_rows_of_the_ids_asked_for(
    tmp_path: Path, clock: ManualClock
) -> None:
    table = DeadLetterTable(str(tmp_path / "dlq"), "CID_dlq", clock=clock)
    assert table.dead_among(["M0"]) == []  # no table yet
    letters = _letters(clock, 5)
    table.write(letters)
    table.mark_replayed([letters[1]])
    table.mark_discarded([letters[2]])
    found = table.dead_among(["M0", "M1", "M2", "M4", "M9"])
    assert sorted((d.msg_id, d.origin_msg_id, d.key, d.reconsume_times) for d in found) == [
        ("M0", "O0", "ORDER_0", 16),
        ("M4", "O4", "ORDER_4", 16),
    ]
    assert table.dead_among([]) == []
