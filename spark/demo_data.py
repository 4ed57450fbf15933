"""The demo's order stream: JSON-lines files with at-least-once redelivery patterns baked in.

The files are what a file-based consumer would have received from a broker
that delivers at least once:

- producer retries (C1): a send timed out after the broker stored it, so the
  same message (same key, same msg id) is stored twice, sometimes in one file;
- redeliveries (C3-C9): a consumer crash, a broker failover or an offset reset
  delivers a slice of already-consumed messages again, in a later file;
- transient sink failures: some orders hit an "inventory timeout" on their
  first one or two deliveries and succeed on a later delay level;
- poison messages: orders with a negative amount, which the sink rejects every
  time (they end in ``%DLQ%<group>``);
- bad input: rows whose key is null, empty or too long (dead-lettered at once).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from idem.errors import ConfigError

KEY_FIELD = "order_id"
"""The business key of the demo's orders."""

DEMO_GROUP = "demo-orders"
"""The demo's consumer group."""

DEMO_DELAY_LEVELS = "1s 1s 1s 2s 2s 3s"
"""Short levels so the demo's retries finish in seconds (RocketMQ's start at 1s 5s 10s ...)."""

DEMO_MAX_RECONSUME_TIMES = 3
"""Retries before a poison order is dead-lettered in the demo."""


@dataclass(frozen=True)
class DemoData:
    """What :func:`write_demo_data` wrote and what a correct pipeline must end with."""

    directory: str
    files: tuple[str, ...]
    messages: int
    expected_keys: frozenset[str]
    """Keys that must end in the sink exactly once."""
    poison_keys: frozenset[str]
    """Keys the sink always rejects (they must end in the DLQ)."""
    flaky: Mapping[str, int] = field(default_factory=dict)
    """Key -> how many deliveries fail before the sink accepts it."""
    producer_duplicates: int = 0
    redelivered: int = 0
    bad_rows: int = 0


def _order(rng: random.Random, n: int, *, amount: float | None = None) -> dict[str, Any]:
    return {
        KEY_FIELD: f"ORDERID_{n}",
        "customer": f"C{rng.randrange(1, 50):02d}",
        "amount": round(rng.uniform(5, 500), 2) if amount is None else amount,
        "mq_msg_id": f"{n:08X}{rng.getrandbits(64):016X}",
        "created_at": f"2024-05-01T10:{n // 60 % 60:02d}:{n % 60:02d}Z",
    }


def check_sizes(*, orders: int, files: int, poison: int = 3) -> None:
    """Refuse an order count or file count the demo cannot be made of (``--orders``,
    ``--files``): at least one file, and enough orders for the poison ones, a good one,
    and one in every file."""
    if files < 1:
        raise ConfigError(f"--files: the demo needs at least 1 file, got {files}")
    least = max(files, poison + 1)
    if orders < least:
        raise ConfigError(
            f"--orders: the demo needs at least {least} orders ({poison} poison, one good, "
            f"one in each of {files} file(s)), got {orders}"
        )


def write_demo_data(
    directory: str | Path,
    *,
    orders: int = 600,
    files: int = 6,
    poison: int = 3,
    flaky: int = 12,
    producer_duplicates: int = 30,
    redelivered: int = 60,
    seed: int = 7,
) -> DemoData:
    """Write ``files`` JSON-lines files of ``orders`` orders with the patterns above."""
    check_sizes(orders=orders, files=files, poison=poison)
    rng = random.Random(seed)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    numbers = list(range(100, 100 + orders))
    poison_numbers = set(rng.sample(numbers, poison))
    clean = [n for n in numbers if n not in poison_numbers]
    flaky_numbers = rng.sample(clean, min(flaky, len(clean)))
    rows = [
        _order(rng, n, amount=-round(rng.uniform(1, 50), 2) if n in poison_numbers else None)
        for n in numbers
    ]
    # Spread the orders over the files, then add the delivery patterns.
    per_file: list[list[dict[str, Any]]] = [[] for _ in range(files)]
    for i, row in enumerate(rows):
        per_file[i * files // len(rows)].append(row)
    for row in rng.sample(rows, min(producer_duplicates, len(rows))):
        # The resend lands in the same file or the next one (a producer retry is quick).
        home = next(i for i, f in enumerate(per_file) if row in f)
        target = min(files - 1, home + rng.randrange(0, 2))
        per_file[target].insert(rng.randrange(len(per_file[target]) + 1), dict(row))
    for _ in range(redelivered):
        # A later file redelivers an order an earlier file already carried.
        source = rng.randrange(0, max(1, files - 1))
        row = rng.choice(per_file[source])
        target = rng.randrange(source + 1, files) if source + 1 < files else source
        per_file[target].append(dict(row))
    bad = [
        {**_order(rng, 10_000), KEY_FIELD: None},
        {**_order(rng, 10_001), KEY_FIELD: ""},
        {**_order(rng, 10_002), KEY_FIELD: "X" * 600},
    ]
    per_file[files // 2].extend(bad)
    names: list[str] = []
    total = 0
    for i, batch in enumerate(per_file):
        path = out / f"orders-{i:03d}.json"
        path.write_text("".join(json.dumps(r) + "\n" for r in batch), encoding="utf-8")
        names.append(str(path))
        total += len(batch)
    return DemoData(
        directory=str(out),
        files=tuple(names),
        messages=total,
        expected_keys=frozenset(f"ORDERID_{n}" for n in clean),
        poison_keys=frozenset(f"ORDERID_{n}" for n in poison_numbers),
        flaky={f"ORDERID_{n}": 1 + (k % 2) for k, n in enumerate(flaky_numbers)},
        producer_duplicates=producer_duplicates,
        redelivered=redelivered,
        bad_rows=len(bad),
    )
