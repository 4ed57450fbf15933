"""CallCombiner: concurrent calls share one call; each caller gets its own results or the error."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from idem.retry.combiner import CallCombiner


def _wait_gathered(combiner: CallCombiner[int, Any], items: int) -> None:
    """Until ``items`` items wait in the combiner's open group."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        group = combiner._open
        if group is not None and len(group.items) == items:
            return
        time.sleep(0.01)
    raise AssertionError(f"{items} items never gathered")


def test_calls_made_while_one_runs_share_the_next_call_and_get_their_own_results() -> None:
    combiner: CallCombiner[int, str] = CallCombiner()
    entered, release = threading.Event(), threading.Event()  # the first call holds on
    calls: list[list[int]] = []

    def run(items: list[int]) -> list[str]:
        calls.append(list(items))
        if items == [0]:
            entered.set()
            release.wait(5)
        return [f"r{i}" for i in items]

    results: dict[int, list[str]] = {}

    def caller(items: list[int]) -> None:
        results[items[0]] = combiner.call(items, run)

    first = threading.Thread(target=caller, args=([0],))
    first.start()
    assert entered.wait(5)
    others = [threading.Thread(target=caller, args=([n, n + 1],)) for n in (10, 20, 30)]
    for t in others:
        t.start()
    _wait_gathered(combiner, 6)  # the three wait for the first call, in one group
    release.set()
    for t in (first, *others):
        t.join(5)
    assert len(calls) == 2
    assert sorted(calls[1]) == [10, 11, 20, 21, 30, 31]
    assert results == {
        0: ["r0"],
        10: ["r10", "r11"],
        20: ["r20", "r21"],
        30: ["r30", "r31"],
    }


def test_every_member_of_a_failed_call_gets_its_error() -> None:
    combiner: CallCombiner[int, int] = CallCombiner()
    entered, release = threading.Event(), threading.Event()  # the first call holds on

    def run(items: list[int]) -> list[int]:
        if items == [0]:
            entered.set()
            release.wait(5)
            return [0]
        raise OSError("journal unavailable")

    errors: list[BaseException] = []

    def caller(item: int) -> None:
        try:
            combiner.call([item], run)
        except OSError as exc:
            errors.append(exc)

    first = threading.Thread(target=caller, args=(0,))
    first.start()
    assert entered.wait(5)
    others = [threading.Thread(target=caller, args=(n,)) for n in (1, 2, 3)]
    for t in others:
        t.start()
    _wait_gathered(combiner, 3)
    release.set()
    for t in (first, *others):
        t.join(5)
    assert [str(e) for e in errors] == ["journal unavailable"] * 3


def test_a_call_alone_runs_at_once_and_a_wrong_result_count_is_an_error() -> None:
    combiner: CallCombiner[int, int] = CallCombiner()
    assert combiner.call([1, 2], lambda items: [i * 2 for i in items]) == [2, 4]
    with pytest.raises(RuntimeError, match="1 results for 2 items"):
        combiner.call([1, 2], lambda items: [0])
