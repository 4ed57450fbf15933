"""Which dead letters ``idem dlq replay | discard | show`` select, and which names match none."""

from __future__ import annotations

import pytest

from idem.retry import MessageExt
from idem.retry.dlq import DeadLetter
from idem.spark.dlq import Selection

pytestmark = pytest.mark.unit


def _letter(key: str | None, msg_id: str) -> DeadLetter:
    message = MessageExt(topic="orders", msg_id=msg_id, keys=key, body=b"{}")
    return DeadLetter.of("g", message, reason="key is null", dead_at_ms=0)


def test_an_empty_key_names_no_dead_letter_whose_key_is_null() -> None:
    """A bad-key row dead-lettered with a null key is not selected by ``--key ""``, so that
    name matches nothing and must be reported (it said nothing and exited 0)."""
    letters = [_letter(None, "M1"), _letter("ORDER_1", "M2")]
    selection = Selection(keys=("",))
    assert [d.msg_id for d in letters if selection.matches(d)] == []
    assert selection.unknown(letters) == ("",)


def test_an_empty_key_selects_the_dead_letter_whose_key_is_empty() -> None:
    letters = [_letter("", "M1"), _letter(None, "M2")]
    selection = Selection(keys=("",))
    assert [d.msg_id for d in letters if selection.matches(d)] == ["M1"]
    assert selection.unknown(letters) == ()


def test_a_null_key_row_is_found_by_its_msg_id() -> None:
    letters = [_letter(None, "M1")]
    selection = Selection(msg_ids=("M1",))
    assert [d.msg_id for d in letters if selection.matches(d)] == ["M1"]
    assert selection.unknown(letters) == ()
