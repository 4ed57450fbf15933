"""A micro-batch's claim, run on the executors: every row gets its verdict where it lies.

The driver repartitions the batch by Redis bucket and has Spark sort each
partition by bucket, key and precedence (:func:`verdict_frame`), so all of a
bucket's rows meet in one task, and every copy of a key is in one run of rows.
Each task (:class:`ClaimTask`, called by ``mapInArrow``) then, on Arrow columns,
a few batches of rows at a time:

1. validates the keys (null, empty, too long, not text: ``INVALID``; rows whose
   values could not be read: ``MALFORMED``; neither is claimed);
2. keeps the first row of every key in precedence order (the row furthest along
   its retry chain, then the earliest): the others are ``IN_BATCH`` duplicates, or
   ``CONFLICTING`` when their payload differs from the first row's;
3. claims the first rows' keys in Redis, one ``claim.lua`` call per bucket and
   at most 1000 keys, under the batch's owner token (query id and batch id) at
   the instant the driver chose, so a retried or speculative attempt of the task
   takes the same claims again (verdict ``RETAKEN``) and gives the same answer;
4. tags each row: ``FRESH``, ``RETAKEN``, ``RECLAIMED`` (claimed: the sink gets
   them), ``COMPLETED``, ``MISMATCHED`` (completed before with another payload),
   ``BUSY`` (another owner holds a live lease), or ``STALE`` (the bucket's index
   is behind the ledger: the driver catches it up and claims those rows again).

Nothing here runs on the driver, and a task holds about one Arrow batch of rows
(``spark.sql.execution.arrow.maxRecordsPerBatch``), whatever its partition's size.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from idem.clock import SYSTEM_CLOCK, ManualClock
from idem.config import IdemConfig
from idem.errors import InvalidKey
from idem.hotstore import RedisHotStore
from idem.keys import validate_key
from idem.redis_client import connect
from idem.redis_cluster import RedisClient
from idem.spark.faults import TaskFault, TaskFaultPoint
from idem.spark.ids import spark_hex
from idem.spark.messages import MALFORMED_COLUMN, RECONSUME_TIMES_COLUMN
from idem.spark.rows import python_values

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

KEY_COLUMN = "_idem_key"
"""The validated key of the row (null when the key is bad)."""
VERDICT_COLUMN = "_idem_verdict"
"""What the claim decided for the row (a :class:`Verdict`)."""
DETAIL_COLUMN = "_idem_detail"
"""Why a key is bad (``<reason>: <message>``); the stored fingerprint of a completed key."""
FINGERPRINT_TEXT_COLUMN = "_idem_fp"
"""The row's payload fingerprint as text (null when fingerprints are off)."""
BUCKET_COLUMN = "_idem_bucket"
"""The key's Redis bucket, computed by Spark before the shuffle."""
ORDER_COLUMN = "_idem_row"
"""The row's position in the batch, computed by Spark before the shuffle (precedence)."""
HASH_COLUMN = "_idem_fingerprint"
"""The payload's 64-bit hash, computed by Spark (the fingerprint's source)."""


class Verdict(IntEnum):
    """What the claim decided for one row; the first three hand it to the sink."""

    FRESH = 0
    """Claimed: no one had the key."""
    RETAKEN = 1
    """Claimed: this owner held it already (a replay, or another attempt of the task)."""
    RECLAIMED = 2
    """Claimed: another owner's lease on it had run out."""
    IN_BATCH = 3
    """An earlier row of the batch (in precedence order) has the key."""
    COMPLETED = 4
    """The key was completed within the dedup window."""
    MISMATCHED = 5
    """The key was completed with another payload (the mismatch policy decides)."""
    BUSY = 6
    """Another owner holds the key with a live lease."""
    INVALID = 7
    """The key is null, empty, too long or not text; never claimed."""
    MALFORMED = 8
    """The row's values could not be read; never claimed."""
    STALE = 9
    """The bucket's Redis index is behind the ledger: not examined, claim again."""
    CONFLICTING = 10
    """An earlier row of the batch has the key with another payload (the mismatch policy
    decides, as for a key completed with another payload)."""


CLAIMED = (Verdict.FRESH, Verdict.RETAKEN, Verdict.RECLAIMED)
"""The verdicts of the rows the sink gets."""

CONFLICT_DETAIL = "another row of the batch has this key with another payload"
"""The detail of a :data:`Verdict.CONFLICTING` row."""

_FROM_CODE = np.full(256, 255, dtype=np.uint8)
for _code, _verdict in (
    (b"N", Verdict.FRESH),
    (b"R", Verdict.RETAKEN),
    (b"X", Verdict.RECLAIMED),
    (b"D", Verdict.COMPLETED),
    (b"B", Verdict.BUSY),
    (b"S", Verdict.STALE),
):
    _FROM_CODE[_code[0]] = _verdict
"""``claim.lua``'s code letters (and ``S``, a stale bucket) as verdicts."""

VERDICT_FIELDS = pa.schema(
    [
        pa.field(KEY_COLUMN, pa.string()),
        pa.field(VERDICT_COLUMN, pa.int8(), nullable=False),
        pa.field(DETAIL_COLUMN, pa.string()),
        pa.field(FINGERPRINT_TEXT_COLUMN, pa.string()),
    ]
)
"""The columns :class:`ClaimTask` appends to every row."""


@dataclass(frozen=True)
class ClaimTask:
    """The claim of one task's rows; ``mapInArrow`` calls it on an executor.

    Args:
        config: The group's settings (Redis URL, buckets, lease, window, key limit).
        owner: The batch's owner token (query id and batch id).
        now_ms: The instant of the claim when the driver's clock is a test clock:
            every task and every attempt of a task claims at it. ``None`` (the
            system clock): each call decides at Redis's clock.
        min_version: The ledger version each bucket's index must have reached.
        hold: Whether the claims take leases (see :meth:`idem.dedup.Dedup.begin`).
        track: With ``hold``: also record the claimed keys under the owner in Redis,
            so the driver can renew their leases without knowing them (see
            :meth:`idem.hotstore.RedisHotStore.renew_tracked`).
        key: The column holding the business key.
        fingerprints: Whether :data:`HASH_COLUMN` holds the payload hashes.
        fault: A failure to stage in one task's first attempt (tests only).
    """

    config: IdemConfig
    owner: str
    now_ms: int | None
    min_version: int
    hold: bool
    key: str
    fingerprints: bool = True
    fault: TaskFault | None = None
    """A fault to stage in the task (tests): see :class:`idem.spark.faults.TaskFault`."""
    track: bool = False

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """Tag every row of the task with its verdict (called once per task).

        Spark hands the rows sorted by bucket, key and precedence
        (:func:`claim_frame`), so every copy of a key is in one run of rows. The rows
        are tagged as they arrive, a few Arrow batches at a time: the run of the last
        key of a batch waits for the next batch, which may continue it. A task holds
        about one batch, however many rows its partition has.
        """
        pending: pa.Table | None = None
        ready: pa.Table | None = None  # tagged, not handed back yet
        for batch in batches:
            if not batch.num_rows:
                continue
            table = pa.Table.from_batches([batch])
            if pending is not None:
                table = pa.concat_tables([pending, table])
            cut = _last_run(table, self.key)
            pending = table.slice(cut) if cut < table.num_rows else None
            if cut:
                if ready is not None:
                    yield from ready.to_batches()
                ready = self._tagged(table.slice(0, cut), opening=ready is None)
        if pending is not None:
            if ready is not None:
                yield from ready.to_batches()
            ready = self._tagged(pending, opening=ready is None)
        if ready is not None:
            if self.fault is not None:
                self.fault.fire(TaskFaultPoint.CLAIMED)
            yield from ready.to_batches()

    def _tagged(self, rows: pa.Table, *, opening: bool) -> pa.Table:
        """``rows`` (every copy of each of their keys) with the verdict columns appended."""
        rows = rows.combine_chunks()
        for field, column in zip(VERDICT_FIELDS, self.verdicts(rows, opening=opening), strict=True):
            rows = rows.append_column(field, column)
        return rows

    def verdicts(self, table: pa.Table, *, opening: bool = True) -> list[pa.Array]:
        """The :data:`VERDICT_FIELDS` columns of ``table``: every copy of each of its keys,
        each key's copies in precedence order. ``opening``: the task's first rows (a
        staged fault fires there only)."""
        size = table.num_rows
        keys, invalid = _valid_keys(table.column(self.key), self.config.max_key_bytes, self.key)
        verdicts = np.full(size, Verdict.IN_BATCH, dtype=np.int8)
        details: dict[int, str] = dict(invalid.items())
        verdicts[list(invalid)] = Verdict.INVALID
        if MALFORMED_COLUMN in table.column_names:
            malformed = table.column(MALFORMED_COLUMN)
            if malformed.null_count < size:
                rows = pc.indices_nonzero(pc.is_valid(malformed)).to_numpy()
                verdicts[rows] = Verdict.MALFORMED
                keys = pc.if_else(pc.is_valid(malformed), pa.scalar(None, pa.string()), keys)
                for i, why in zip(rows.tolist(), malformed.take(rows).to_pylist(), strict=True):
                    details[int(i)] = why
        prints = None
        if self.fingerprints:
            prints = spark_hex(table.column(HASH_COLUMN))
        first, first_of = _first_rows(keys)
        if prints is not None:
            for i in _conflicting(prints, first_of).tolist():
                verdicts[i] = Verdict.CONFLICTING
                details[i] = CONFLICT_DETAIL
        if len(first):
            codes, stored = self._claim(keys, first, table.column(BUCKET_COLUMN), fire=opening)
            claimed = _FROM_CODE[np.frombuffer(codes, dtype=np.uint8)]
            if (claimed == 255).any():
                raise RuntimeError("claim.lua answered a code this task does not know")
            order = first[claimed == Verdict.COMPLETED]
            if len(order):
                own = prints.take(pa.array(order)).to_pylist() if prints is not None else None
                for n, (i, value) in enumerate(zip(order.tolist(), stored, strict=True)):
                    details[i] = value
                    if own is not None and value and own[n] and value != own[n]:
                        claimed[np.searchsorted(first, i)] = Verdict.MISMATCHED
            verdicts[first] = claimed
        detail = pa.nulls(size, pa.string())
        if details:
            at = sorted(details)
            mask = np.zeros(size, dtype=bool)
            mask[at] = True
            detail = pc.replace_with_mask(
                detail, pa.array(mask), pa.array([details[i] for i in at], pa.string())
            )
        return [
            keys,
            pa.array(verdicts, pa.int8()),
            detail,
            prints if prints is not None else pa.nulls(size, pa.string()),
        ]

    def _claim(
        self, keys: pa.Array, first: np.ndarray, buckets: pa.ChunkedArray | pa.Array, *, fire: bool
    ) -> tuple[bytes, list[str]]:
        """Claim the keys of the ``first`` rows (sorted) in Redis; their codes in that
        order, and the stored fingerprints of the completed ones."""
        first_buckets = np.asarray(pc.take(buckets, pa.array(first)).to_numpy(), dtype=np.int64)
        by_bucket = np.argsort(first_buckets, kind="stable")
        names = pc.take(keys, pa.array(first[by_bucket])).to_pylist()
        grouped = split_by_bucket(names, first_buckets[by_bucket])
        store = task_store(self.config, self.now_ms)
        calls = store.start_claim(
            self.owner, min_version=self.min_version, hold=self.hold, track=self.track
        )
        try:
            calls.add(grouped)
            if fire and self.fault is not None:
                self.fault.fire(TaskFaultPoint.CLAIMS_SENT)
        except BaseException:
            calls.abandon()
            raise
        codes, stored = calls.codes()
        # Back from bucket order to the order of ``first``.
        unsorted = np.empty(len(codes), dtype=np.uint8)
        unsorted[by_bucket] = np.frombuffer(codes, dtype=np.uint8)
        completed = np.flatnonzero(np.frombuffer(codes, dtype=np.uint8) == ord("D"))
        stored_in_first_order = [""] * len(first)
        for value, position in zip(stored, by_bucket[completed].tolist(), strict=True):
            stored_in_first_order[position] = value
        done = np.flatnonzero(unsorted == ord("D")).tolist()
        return unsorted.tobytes(), [stored_in_first_order[i] for i in done]


def _last_run(table: pa.Table, key: str) -> int:
    """Where the run of rows holding the last row's key begins (rows sorted by key).

    A null key is a run of its own, and so is every row when the key column cannot
    hold a valid key (not text, bytes or an integer): such rows are never compared.
    """
    kind = table.schema.field(key).type
    keyed = (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_integer(kind)
    )
    keys = table.column(key)
    last = keys[len(keys) - 1]
    if not keyed or not last.is_valid:
        return len(keys)
    others = pc.indices_nonzero(pc.fill_null(pc.not_equal(keys, last), True))
    return int(others[len(others) - 1].as_py()) + 1 if len(others) else 0


def _valid_keys(
    column: pa.ChunkedArray | pa.Array, max_bytes: int, field: str
) -> tuple[pa.Array, dict[int, str]]:
    """The validated keys as text (null where bad) and why each bad one is bad.

    Non-blank ASCII text within the limit is decided on the whole column at once;
    only the other rows go through :func:`idem.keys.validate_key` one by one.
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_integer(column.type):
        column = pc.cast(column, pa.string())
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        text = pc.cast(column, pa.string())
        lengths = pc.binary_length(text)
        fast = pc.and_kleene(
            pc.and_kleene(pc.string_is_ascii(text), pc.greater(lengths, 0)),
            pc.and_kleene(pc.less_equal(lengths, max_bytes), pc.invert(pc.ascii_is_space(text))),
        )
        fast = pc.fill_null(fast, False)
    else:
        text = pa.nulls(len(column), pa.string())
        fast = pa.repeat(pa.scalar(False), len(column))
    if fast.true_count == len(column):
        return text, {}
    slow = pc.indices_nonzero(pc.invert(fast)).to_numpy()
    values = python_values(column.take(pa.array(slow)), "surrogateescape")
    if pa.types.is_integer(column.type):
        values = [None if v is None else str(v) for v in values]
    invalid: dict[int, str] = {}
    good: dict[int, str] = {}
    for i, value in zip(slow.tolist(), values, strict=True):
        try:
            good[i] = validate_key(value, field=field, max_bytes=max_bytes)
        except InvalidKey as exc:
            invalid[i] = f"{exc.reason}: {exc}"
    mask = np.zeros(len(column), dtype=bool)
    mask[slow] = True
    replacement = [good.get(i) for i in slow.tolist()]
    keys = pc.replace_with_mask(text, pa.array(mask), pa.array(replacement, pa.string()))
    return keys, invalid


def _first_rows(keys: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The (sorted) indices of the first row of every non-null key, and for every row
    the index of its key's first row (``-1`` for a null key)."""
    first_of = np.full(len(keys), -1, dtype=np.int64)
    if keys.null_count == len(keys):
        return np.empty(0, dtype=np.int64), first_of
    rows = pa.table({"k": keys, "i": pa.array(np.arange(len(keys), dtype=np.int64))})
    rows = rows.filter(pc.is_valid(keys))
    firsts = rows.group_by("k", use_threads=False).aggregate([("i", "min")])
    joined = rows.join(firsts, "k", use_threads=False)
    first_of[joined.column("i").to_numpy()] = joined.column("i_min").to_numpy()
    return np.sort(firsts.column("i_min").to_numpy()), first_of


def _conflicting(prints: pa.Array, first_of: np.ndarray) -> np.ndarray:
    """The rows that are not their key's first row and whose payload fingerprint differs
    from the first row's: a copy with another payload is never a silent duplicate."""
    copies = np.flatnonzero((first_of >= 0) & (first_of != np.arange(len(first_of))))
    if not len(copies):
        return copies
    differs = pc.not_equal(prints.take(pa.array(copies)), prints.take(pa.array(first_of[copies])))
    found: np.ndarray = copies[differs.to_numpy(zero_copy_only=False)]
    return found


def split_by_bucket(keys: list[str], buckets: np.ndarray) -> dict[int, list[str]]:
    """``keys`` by bucket, given the keys sorted by bucket and each one's bucket."""
    edges = [0, *(np.flatnonzero(np.diff(buckets)) + 1).tolist(), len(keys)]
    return {int(buckets[start]): keys[start:end] for start, end in itertools.pairwise(edges)}


_clients: dict[str, RedisClient] = {}
_clients_lock = threading.Lock()


def redis_client(url: str) -> RedisClient:
    """One Redis client per URL in this Python worker (Spark reuses its workers)."""
    with _clients_lock:
        client = _clients.get(url)
        if client is None:
            client = _clients[url] = connect(url)
        return client


def task_store(config: IdemConfig, now_ms: int | None = None) -> RedisHotStore:
    """The group's Redis side for a task on an executor, on this worker's client for the
    group's URL; ``now_ms`` is a test clock's instant (``None``: Redis's clock decides)."""
    clock = SYSTEM_CLOCK if now_ms is None else ManualClock(now_ms)
    return RedisHotStore.from_config(config, client=redis_client(config.redis_url), clock=clock)


def bucket_sql(key: str, buckets: int) -> str:
    """The Redis bucket of the key column as Spark SQL: CRC-32 of its UTF-8 text modulo
    ``buckets``, as :func:`idem.keys.bucket_of` (a bad key lands anywhere: never claimed)."""
    column = "`" + key.replace("`", "``") + "`"
    return f"CAST(pmod(crc32(CAST(CAST({column} AS STRING) AS BINARY)), {buckets}) AS INT)"


def safe_names(frame: DataFrame) -> tuple[DataFrame, dict[str, str]]:
    """``frame`` with every column whose name PySpark's ``mapInArrow`` cannot take (a
    backtick or a dot in it) renamed, and ``{name: new name}``."""
    renamed = {
        name: f"_idem_c{n}" for n, name in enumerate(frame.columns) if "`" in name or "." in name
    }
    return (frame.withColumnsRenamed(renamed) if renamed else frame), renamed


def verdict_frame(prepared: DataFrame, task: ClaimTask) -> DataFrame:
    """``prepared`` (with :data:`HASH_COLUMN` when fingerprints are on) claimed by
    ``task`` on the executors: its rows, a bucket's all in one task, with
    :data:`ORDER_COLUMN`, :data:`BUCKET_COLUMN` and the :data:`VERDICT_FIELDS`
    appended (lazy: nothing runs until it is read)."""
    from pyspark.sql import functions as F  # noqa: N812, PLC0415 -- Spark's convention

    numbered = prepared.withColumn(ORDER_COLUMN, F.monotonically_increasing_id()).withColumn(
        BUCKET_COLUMN, F.expr(bucket_sql(task.key, task.config.buckets))
    )
    return claim_frame(numbered, task)


def _key_types() -> tuple[type, ...]:
    from pyspark.sql import types as st  # noqa: PLC0415 -- pyspark is loaded by now

    return (st.StringType, st.BinaryType, st.IntegralType)


def claim_frame(numbered: DataFrame, task: ClaimTask) -> DataFrame:
    """Rows that carry :data:`ORDER_COLUMN` and :data:`BUCKET_COLUMN` already, claimed
    by ``task`` (:func:`verdict_frame`'s second half: rows claimed again reuse it)."""
    from pyspark.sql import functions as F  # noqa: N812, PLC0415 -- Spark's convention
    from pyspark.sql import types as st  # noqa: PLC0415

    schema = st.StructType(
        [
            *numbered.schema.fields,
            st.StructField(KEY_COLUMN, st.StringType()),
            st.StructField(VERDICT_COLUMN, st.ByteType(), nullable=False),
            st.StructField(DETAIL_COLUMN, st.StringType()),
            st.StructField(FINGERPRINT_TEXT_COLUMN, st.StringType()),
        ]
    )
    # Each key's copies one after another, the one that goes first (furthest along
    # its retry chain, then the earliest) at the head: Spark's sort spills to disk,
    # and the task tags the rows as they stream past.
    order = [F.col(BUCKET_COLUMN)]
    if isinstance(numbered.schema[task.key].dataType, _key_types()):
        order.append(F.col(task.key))  # a carried name: no dot, no backtick
    if RECONSUME_TIMES_COLUMN in numbered.columns:
        order.append(F.coalesce(F.col(RECONSUME_TIMES_COLUMN), F.lit(0)).desc())
    order.append(F.col(ORDER_COLUMN))
    arranged = numbered.repartition(BUCKET_COLUMN).sortWithinPartitions(*order)
    return arranged.mapInArrow(task, schema)
