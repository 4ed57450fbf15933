"""Build big, realistic ledgers fast, for benchmarks (never for the test suite).

A ledger that has run for days looks like this: the past days' rows compacted
into one file per ``(bucket, completed_date)`` partition, and today's rows
still in the files their batches wrote (one commit per batch). ``build_ledger``
writes exactly that with pyarrow arrays made in bulk (no Python loop per row
except the CRC-32 bucket of each key), so 10M keys take well under a minute.

    from bench._ledger_fixture import build_ledger, fresh_keys
    info = build_ledger("/tmp/l10m", 10_000_000, now_ms=now)
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake

from idem.keys import bucket_of
from idem.ledger.schema import LEDGER_SCHEMA, PARTITION_COLUMNS, conform

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
_MULTIPLIER = 0x9E3779B97F4A7C15 % (1 << 40) | 1  # odd, so i -> i*m mod 2**40 is a bijection


@dataclass(frozen=True)
class LedgerInfo:
    """What :func:`build_ledger` wrote."""

    path: str
    keys: int
    old_keys: int
    recent_keys: int
    recent_batches: int
    version: int
    files: int
    now_ms: int


def key_strings(start: int, count: int, *, prefix: str = "ORDER_") -> pa.Array:
    """``count`` distinct, scattered business keys numbered from ``start`` (unique per number)."""
    ids = (np.arange(start, start + count, dtype=np.uint64) * np.uint64(_MULTIPLIER)) % np.uint64(
        1 << 40
    )
    return pc.binary_join_element_wise(prefix, pa.array(ids).cast(pa.string()), "")


def buckets_of(keys: pa.Array, buckets: int) -> pa.Array:
    """``idem.keys.bucket_of`` for every key (CRC-32 of UTF-8 modulo ``buckets``)."""
    crc = zlib.crc32
    return pa.array([crc(k.encode()) % buckets for k in keys.to_pylist()], pa.int32())


ExtraColumns = Callable[[int, int], Mapping[str, pa.Array]]
"""``extra(start, count)``: user columns for the rows of key numbers ``start`` onwards,
written next to the ledger's (a sink table that is its own ledger)."""


FRESH_START = 1 << 39
"""Key numbers from here on are never written by :func:`build_ledger` (it stays below)."""


def fresh_keys(count: int, *, round_: int = 0) -> list[str]:
    """``count`` keys the ledger does not hold, interleaved with its keys in sort order.

    Same ``ORDER_`` prefix as the ledger's keys on purpose: keys with another
    prefix (``NEW_...``) sort outside the ledger's min/max key statistics, and
    a MERGE then skips every file by statistics alone, which no real batch
    would enjoy.
    """
    return key_strings(FRESH_START + round_ * count, count).to_pylist()  # type: ignore[no-any-return]


def _hex_pool(rng: np.random.Generator, size: int) -> pa.Array:
    return pa.array([rng.bytes(16).hex() for _ in range(size)], pa.string())


def ledger_chunk(
    *,
    group: str,
    start: int,
    count: int,
    times_ms: np.ndarray,
    buckets: int,
    rng: np.random.Generator,
    pool: pa.Array,
    batch_id: int,
    prefix: str = "ORDER_",
    extra: ExtraColumns | None = None,
) -> pa.Table:
    """``count`` ledger rows with keys numbered from ``start`` completed at ``times_ms``
    (and the ``extra`` user columns of those keys)."""
    keys = key_strings(start, count, prefix=prefix)
    picks = pa.array(rng.integers(0, len(pool), size=(2, count)).reshape(-1))
    hexes = pool.take(picks)
    micros = pa.array(times_ms.astype(np.int64) * 1000, pa.int64())
    completed_at = micros.cast(pa.timestamp("us", tz="UTC"))
    columns = {
        "group": pa.array(np.full(count, group, dtype=object), pa.string()),
        "bucket": buckets_of(keys, buckets),
        "key": keys,
        "msg_id": hexes.slice(0, count),
        "origin_msg_id": pa.nulls(count, pa.string()),
        "topic": pa.array(np.full(count, "orders", dtype=object), pa.string()),
        "queue_id": pa.array(rng.integers(0, 8, size=count).astype(np.int32)),
        "queue_offset": pa.array(np.arange(start, start + count, dtype=np.int64)),
        "batch_id": pa.array(np.full(count, batch_id, dtype=np.int64)),
        "owner": pa.array(np.full(count, f"query-1:{batch_id}", dtype=object), pa.string()),
        "fingerprint": hexes.slice(count, count),
        "completed_at": completed_at,
        "completed_date": pc.cast(completed_at, pa.date32()),
        "result": pa.nulls(count, pa.string()),
    }
    table = pa.table(columns, schema=LEDGER_SCHEMA)
    for name, values in (extra(start, count) if extra else {}).items():
        table = table.append_column(name, values)
    return table


def build_ledger(
    path: str,
    n_keys: int,
    *,
    now_ms: int | None = None,
    group: str = "bench",
    buckets: int = 16,
    days: float = 6.0,
    recent_keys: int | None = None,
    recent_batch: int = 100_000,
    recent_span_ms: int = 12 * HOUR_MS,
    recent_gap_ms: int = 10 * 60_000,
    seed: int = 7,
    extra: ExtraColumns | None = None,
) -> LedgerInfo:
    """Write an ``n_keys`` ledger at ``path`` (which must not exist yet).

    ``recent_keys`` (default: 5 % of the keys, at most 1M) were completed in
    batches of ``recent_batch`` over the last ``recent_span_ms`` but not in the
    last ``recent_gap_ms`` (so they are older than a lease); each batch is its
    own commit and files. The rest are spread evenly over ``days`` before
    that and written one day at a time, i.e. one file per ``(bucket, date)``
    partition, as a compacted ledger would be. ``now_ms`` defaults to the
    wall clock. ``extra`` adds user columns to every row (a Delta sink table).
    """
    if now_ms is None:
        now_ms = time.time_ns() // 1_000_000
    rng = np.random.default_rng(seed)
    pool = _hex_pool(rng, 1 << 14)
    recent = min(n_keys // 20, 1_000_000) if recent_keys is None else recent_keys
    old = n_keys - recent
    recent_start = now_ms - recent_span_ms
    old_start = recent_start - int(days * DAY_MS)

    written = 0
    # Old rows: ordered by time, cut at UTC day boundaries, one write per day.
    old_times = np.sort(rng.integers(old_start, recent_start, size=old, dtype=np.int64))
    day_index = (old_times // DAY_MS).astype(np.int64)
    cuts = np.flatnonzero(np.diff(day_index)) + 1
    for batch_id, segment in enumerate(np.split(np.arange(old), cuts)):
        if not len(segment):
            continue
        chunk = ledger_chunk(
            group=group,
            start=written,
            count=len(segment),
            times_ms=old_times[segment],
            buckets=buckets,
            rng=rng,
            pool=pool,
            batch_id=batch_id,
            extra=extra,
        )
        _write(path, chunk)
        written += len(segment)

    n_batches = -(-recent // recent_batch) if recent else 0
    span = recent_span_ms - recent_gap_ms
    for i in range(n_batches):
        count = min(recent_batch, recent - i * recent_batch)
        at = recent_start + (span * i) // max(n_batches, 1)
        times = np.full(count, at, dtype=np.int64) + rng.integers(0, 1000, size=count)
        chunk = ledger_chunk(
            group=group,
            start=written,
            count=count,
            times_ms=times,
            buckets=buckets,
            rng=rng,
            pool=pool,
            batch_id=10_000 + i,
            extra=extra,
        )
        _write(path, chunk)
        written += count

    table = DeltaTable(path)
    return LedgerInfo(
        path=path,
        keys=written,
        old_keys=old,
        recent_keys=recent,
        recent_batches=n_batches,
        version=table.version(),
        files=len(table.file_uris()),
        now_ms=now_ms,
    )


def _write(path: str, chunk: pa.Table) -> None:
    write_deltalake(
        path,
        chunk,
        mode="append",
        partition_by=list(PARTITION_COLUMNS),
        target_file_size=1 << 30,
    )


def existing_keys(count: int, *, total: int, seed: int = 11) -> list[str]:
    """``count`` keys that a ledger of ``total`` keys built by :func:`build_ledger` holds."""
    rng = np.random.default_rng(seed)
    numbers: Sequence[int] = rng.choice(total, size=count, replace=False).tolist()
    ids = [(n * _MULTIPLIER) % (1 << 40) for n in numbers]
    return [f"ORDER_{i}" for i in ids]


def batch_rows(keys: Sequence[str], *, buckets: int = 16, group: str = "bench") -> pa.Table:
    """Ledger rows for ``keys`` (completed now), as a batch commit would bring them."""
    return conform(
        pa.table(
            {
                "group": pa.array([group] * len(keys), pa.string()),
                "bucket": pa.array([bucket_of(k, buckets) for k in keys], pa.int32()),
                "key": pa.array(keys, pa.string()),
                "fingerprint": pa.array(["0" * 32] * len(keys), pa.string()),
            }
        ),
        now_ms=time.time_ns() // 1_000_000,
    )


def plain_merge(
    path: str, rows: pa.Table, *, streamed_exec: bool = False
) -> tuple[float, dict[str, Any]]:
    """The baseline: an insert-only MERGE on ``(bucket, key)`` with no recency restriction.

    Returns ``(seconds, delta-rs metrics)``. Which of delta-rs' two modes is
    faster varies here (10M keys: 5.9-16 s materialized, 8.6-17 s streamed).
    """
    table = DeltaTable(path)
    started = time.perf_counter()
    metrics = (
        table.merge(
            rows,
            "t.bucket = s.bucket AND t.key = s.key",
            source_alias="s",
            target_alias="t",
            streamed_exec=streamed_exec,
        )
        .when_not_matched_insert_all()
        .execute()
    )
    return time.perf_counter() - started, metrics


def plain_merge_seconds(
    path: str, n_keys: int, *, buckets: int = 16, round_: int = 99, streamed_exec: bool = True
) -> float:
    """Seconds of a plain insert-only MERGE of ``n_keys`` fresh keys into the ledger at ``path``.

    delta-rs' defaults (``streamed_exec=True``). It really inserts them (the
    ledger grows by ``n_keys``).
    """
    rows = batch_rows(fresh_keys(n_keys, round_=round_), buckets=buckets)
    seconds, _ = plain_merge(path, rows, streamed_exec=streamed_exec)
    return seconds
