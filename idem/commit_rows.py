"""The ledger rows of a completion, built column by column from Arrow.

:meth:`idem.dedup.Dedup.complete` turns the succeeded rows of a
:class:`~idem.outcome.BatchClaim` into a :class:`~idem.outcome.ClaimedRows`
(:func:`claimed_rows`); rows claimed elsewhere arrive as one. Either way the
ledger rows are made from those columns (:func:`ledger_rows`), with no Python
object per row, and the user's columns are added (:func:`commit_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

import pyarrow as pa

from idem.arrow_text import repeat_text
from idem.keys import bucket_of
from idem.ledger.staged import StagedRows
from idem.outcome import BatchClaim, ClaimedRows

MESSAGE_COLUMNS: Mapping[str, pa.DataType] = {
    "msg_id": pa.string(),
    "origin_msg_id": pa.string(),
    "topic": pa.string(),
    "queue_id": pa.int32(),
    "queue_offset": pa.int64(),
}
"""The ledger's columns a batch-aligned ``meta`` table may carry, and their types."""

STAGED_COLUMNS = ("key", "bucket", "fingerprint")
"""The columns a commit of staged rows decides with: its checks, and what it tells Redis."""


def claimed_rows(
    claim: BatchClaim,
    indices: Sequence[int],
    *,
    every_row: bool,
    bucket_count: int,
    meta: pa.Table | None,
    results: Mapping[int, str] | None,
) -> ClaimedRows:
    """The succeeded ``indices`` of ``claim`` as columns (``every_row``: they are every
    row of the batch, in order, so the batch-aligned ``meta`` needs no take)."""
    keys = [claim.keys[i] or "" for i in indices]
    if claim.buckets:
        buckets = [claim.buckets[i] for i in indices]
    else:
        buckets = [bucket_of(key, bucket_count) for key in keys]
    columns: dict[str, pa.Array] = {
        "key": pa.array(keys, pa.string()),
        "bucket": pa.array(buckets, pa.int32()),
        "fingerprint": pa.array([claim.fingerprints[i] for i in indices], pa.string()),
    }
    if meta is not None:
        whole = every_row and meta.num_rows == len(indices)
        taken = None if whole else pa.array(indices, pa.int64())
        for name in MESSAGE_COLUMNS:
            if name in meta.column_names:
                column = meta.column(name)
                columns[name] = (column if taken is None else column.take(taken)).combine_chunks()
    if results:
        columns["result"] = pa.array([results.get(i) for i in indices], pa.string())
    return ClaimedRows(
        owner=claim.owner,
        columns=pa.table(columns),
        ledger_version=claim.ledger_version,
        held=claim.held,
        claimed_at_ms=claim.claimed_at_ms,
    )


def ledger_rows(rows: ClaimedRows, *, group: str, batch_id: int, now_ms: int) -> pa.Table:
    """The ledger rows of ``rows``: completed by ``group`` in ``batch_id`` at ``now_ms``."""
    given = rows.columns
    size = rows.num_rows
    at = datetime.fromtimestamp(now_ms / 1000, tz=UTC)

    def column(name: str, kind: pa.DataType) -> pa.Array | pa.ChunkedArray:
        if name in given.column_names:
            return given.column(name).cast(kind)
        return pa.nulls(size, kind)

    columns: dict[str, pa.Array | pa.ChunkedArray] = {
        "group": repeat_text(group, size),
        "bucket": column("bucket", pa.int32()),
        "key": column("key", pa.string()),
        **{name: column(name, kind) for name, kind in MESSAGE_COLUMNS.items()},
        "batch_id": pa.repeat(pa.scalar(batch_id, pa.int64()), size),
        "owner": repeat_text(rows.owner, size),
        "fingerprint": column("fingerprint", pa.string()),
        "completed_at": pa.repeat(pa.scalar(at, pa.timestamp("us", tz="UTC")), size),
        "completed_date": pa.repeat(pa.scalar(at.date(), pa.date32()), size),
        "result": column("result", pa.string()),
    }
    return pa.table(columns)


def commit_rows(
    rows: ClaimedRows,
    payload: pa.Table | StagedRows | None,
    *,
    group: str,
    batch_id: int,
    now_ms: int,
) -> pa.Table | StagedRows:
    """What the ledger commits for ``rows``: their ledger rows with the user's columns
    (``payload``, aligned with ``rows``) appended, or the staged rows ``payload`` describes.

    Staged rows carry every ledger column in their files (their writers made them),
    so the commit is handed only the columns it decides with (:data:`STAGED_COLUMNS`),
    as they are: nothing is built per row for a batch whose rows stay in files.
    """
    if payload is not None and payload.num_rows != rows.num_rows:
        raise ValueError(f"payload: {payload.num_rows} rows for {rows.num_rows} succeeded rows")
    if isinstance(payload, StagedRows):
        if "result" in rows.columns.column_names:
            raise ValueError("results: staged rows carry their own result column")
        decided = rows.columns.select([n for n in STAGED_COLUMNS if n in rows.columns.column_names])
        return payload.with_ledger_columns(decided, completed_at_ms=now_ms)
    ledger = ledger_rows(rows, group=group, batch_id=batch_id, now_ms=now_ms)
    if payload is None:
        return ledger
    for name in payload.column_names:
        ledger = ledger.append_column(payload.schema.field(name), payload.column(name))
    return ledger
