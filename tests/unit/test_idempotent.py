"""``@idempotent`` on plain callables: runs once per key, replays results, guards payloads."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from deltalake import DeltaTable

from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.errors import ConfigError, InvalidKey, KeyBusy, PayloadMismatch, SerializationError
from idem.idempotent import idempotent
from idem.ledger import read_table


@dataclass
class Order:
    order_id: str
    amount: int


@pytest.fixture
def dedup(tmp_path: Path, any_redis: redis.Redis, clock: ManualClock) -> Dedup:
    return Dedup(
        IdemConfig(group="billing", data_dir=str(tmp_path), buckets=2),
        client=any_redis,
        clock=clock,
    )


def test_runs_once_per_key_and_replays_the_result(dedup: Dedup) -> None:
    charged: list[str] = []

    @idempotent(key="order.order_id", dedup=dedup, replay_result=True)
    def charge(order: Order) -> dict[str, object]:
        charged.append(order.order_id)
        return {"receipt": f"R-{order.order_id}", "amount": order.amount}

    first = charge(Order("ORDERID_100", 5))
    again = charge(Order("ORDERID_100", 5))
    other = charge(Order("ORDERID_101", 7))
    assert charged == ["ORDERID_100", "ORDERID_101"]
    assert first == again == {"receipt": "R-ORDERID_100", "amount": 5}
    assert other == {"receipt": "R-ORDERID_101", "amount": 7}


def test_without_replay_a_repeat_returns_none(dedup: Dedup) -> None:
    calls: list[str] = []

    @idempotent(key=lambda order_id: order_id, dedup=dedup)
    def ship(order_id: str) -> str:
        calls.append(order_id)
        return "shipped"

    assert ship("A") == "shipped"
    assert ship("A") is None
    assert calls == ["A"]


def test_a_failure_releases_the_key_so_a_retry_runs(dedup: Dedup) -> None:
    attempts: list[int] = []

    @idempotent(key="order_id", dedup=dedup)
    def flaky(order_id: str) -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise TimeoutError("downstream timed out")
        return "ok"

    with pytest.raises(TimeoutError):  # the user's exception passes through untouched
        flaky("A")
    assert flaky("A") == "ok"
    assert flaky("A") is None
    assert len(attempts) == 2


def test_the_function_can_receive_its_idempotency_key(dedup: Dedup) -> None:
    seen: list[str] = []

    @idempotent(key="order.order_id", dedup=dedup, pass_key_as="idempotency_key")
    def pay(order: Order, idempotency_key: str = "") -> None:
        seen.append(idempotency_key)

    pay(Order("ORDERID_7", 1))
    assert seen == ["ORDERID_7"]


def test_payload_mismatch_policies(dedup: Dedup) -> None:
    @idempotent(key="order.order_id", dedup=dedup, on_mismatch="raise")
    def strict(order: Order) -> None:
        return None

    strict(Order("A", 1))
    strict(Order("A", 1))  # same payload: a plain repeat
    with pytest.raises(PayloadMismatch, match="'A'") as mismatch:
        strict(Order("A", 2))
    # the error names both fingerprints: the completed call's and this one's
    assert len(mismatch.value.stored) == len(mismatch.value.seen) == 32
    assert mismatch.value.stored != mismatch.value.seen

    dead: list[str] = []

    @idempotent(
        key="order.order_id",
        dedup=dedup,
        on_mismatch="dead_letter",
        on_dead_letter=lambda key, _err: dead.append(key),
    )
    def lenient(order: Order) -> str:
        return "done"

    assert lenient(Order("B", 1)) == "done"
    assert lenient(Order("B", 9)) is None
    assert dead == ["B"]


def test_bad_keys_are_refused_by_field_and_limit(dedup: Dedup) -> None:
    @idempotent(key="order.order_id", dedup=dedup)
    def handle(order: Order) -> None:
        return None

    with pytest.raises(InvalidKey, match="empty"):
        handle(Order("", 1))
    with pytest.raises(InvalidKey, match=r"order\.order_id.*limit is 512 bytes"):
        handle(Order("x" * 513, 1))


def test_a_key_held_by_a_running_call_is_busy(dedup: Dedup) -> None:
    dedup.begin(["A"], owner="another-worker")

    @idempotent(key="order_id", dedup=dedup)
    def handle(order_id: str) -> None:
        return None

    with pytest.raises(KeyBusy):
        handle("A")


def test_misconfiguration_is_refused() -> None:
    with pytest.raises(ConfigError, match="exactly one of config= or dedup="):
        idempotent(key="x")
    with pytest.raises(ConfigError, match="pass_key_as"):
        idempotent(key="x", config=IdemConfig(group="g"), pass_key_as="nope")(lambda x: x)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        # a plain ValueError: 'drop' is not a valid MismatchPolicy
        ({"key": "x", "on_mismatch": "drop"}, "on_mismatch: 'drop' is not one of accept, warn"),
        # failed at the first call: 'int' object has no attribute 'split'
        ({"key": 5}, "key: expected a dotted path into the arguments .* got 5"),
        ({"key": None}, "key: expected a dotted path .* got None"),
        ({"key": ""}, "key: expected a dotted path .* got ''"),
        # failed at the first call, and said so of every call
        ({"key": "order.order_id"}, "key: 'order.order_id' names the argument 'order', which"),
    ],
    ids=["on-mismatch", "key-int", "key-none", "key-empty", "key-no-such-argument"],
)
def test_a_bad_decorator_setting_is_refused_when_decorating(
    dedup: Dedup, settings: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        idempotent(dedup=dedup, **settings)(lambda payment: payment)  # type: ignore[arg-type]


def test_a_key_in_a_defaulted_argument_is_read_from_the_default(dedup: Dedup) -> None:
    """A call leaning on the default is not told the function 'does not take' it."""
    calls: list[str] = []

    @idempotent(key="order.order_id", dedup=dedup)
    def charge(order: Order = Order("ORDERID_1", 5)) -> str:  # noqa: B008 - a fixed test default
        calls.append(order.order_id)
        return "charged"

    assert charge() == "charged"
    assert charge() is None
    assert calls == ["ORDERID_1"]


def test_an_async_function_is_refused_instead_of_completed_before_it_runs(dedup: Dedup) -> None:
    with pytest.raises(ConfigError, match="charge is async"):

        @idempotent(key="order_id", dedup=dedup)
        async def charge(order_id: str) -> None:
            raise RuntimeError("never reached")

    def sneaky(order_id: str) -> object:
        async def later() -> None:
            return None

        return later()

    wrapped = idempotent(key="order_id", dedup=dedup)(sneaky)
    with pytest.raises(ConfigError, match="returned an awaitable"):
        wrapped("ORDER-1")
    # The key was given back, not completed: a proper retry runs.
    assert dedup.begin(["ORDER-1"], owner="retry").fresh == (0,)


def test_a_result_that_is_not_json_still_completes_the_key_so_the_body_never_runs_twice(
    dedup: Dedup,
) -> None:
    runs: list[str] = []

    @idempotent(key="order_id", dedup=dedup, replay_result=True)
    def charge(order_id: str) -> object:
        runs.append(order_id)
        return object()

    with pytest.raises(SerializationError, match="the call ran and key 'ORDER-1' is completed"):
        charge("ORDER-1")
    assert charge("ORDER-1") is None  # a repeat: not run again
    assert runs == ["ORDER-1"]


def _txn_app_ids(table_path: str) -> set[str]:
    """The app ids of every Delta app transaction in the table's log (state Delta keeps)."""
    apps: set[str] = set()
    for entry in sorted(Path(table_path, "_delta_log").glob("*.json")):
        for line in entry.read_text().splitlines():
            action = json.loads(line)
            if "txn" in action:
                apps.add(action["txn"]["appId"])
    return apps


def test_calls_share_an_app_transaction_per_thread_so_the_table_state_stays_small(
    dedup: Dedup,
) -> None:
    """Delta keeps the last version of every app id in the table's state for ever: an app
    id per call grew every snapshot and checkpoint by one entry per call."""

    @idempotent(key=lambda order_id: order_id, dedup=dedup)
    def ship(order_id: str) -> str:
        return "shipped"

    for i in range(20):
        assert ship(f"A{i}") == "shipped"
    worker = threading.Thread(target=lambda: [ship(f"B{i}") for i in range(5)])
    worker.start()
    worker.join()
    assert ship("A3") is None  # still once per key
    assert len(_txn_app_ids(dedup.ledger.path)) == 2  # this thread's, and the worker's
    keys = read_table(DeltaTable(dedup.ledger.path), ["key"]).column("key").to_pylist()
    assert sorted(keys) == sorted([f"A{i}" for i in range(20)] + [f"B{i}" for i in range(5)])
