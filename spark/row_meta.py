"""Where each row of a batch came from: its message id, origin and topic, on Arrow columns.

A row of the retry stream keeps the message it arrived as (``_idem_message``), so
its id, its first delivery's id and its first topic are that message's. A
main-stream row's id is the source's (``msg_id=``), else derived from the key's
and the payload's hashes (a redelivered copy is the same message), else made of
the batch owner and the row's place in the batch. A source line ``idem run``
could not parse is its own message: its id comes from its text.

Both the ledger rows (on the executors) and the rows sent back (on the driver)
take their ids from here, so a row has one id wherever it goes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from idem.retry.message import MessageExt
from idem.spark.ids import derived_msg_ids, hex_digits
from idem.spark.messages import MALFORMED_COLUMN, MESSAGE_COLUMN, RAW_BODY_COLUMN, msg_id_prefix
from idem.spark.rows import python_values

KEY_HASH_COLUMN = "_idem_key_hash"
"""The key's 64-bit hash, computed by Spark (derived message ids)."""

GIVEN_ID_COLUMN = "_idem_msg_id"
"""The source's message id of a main-stream row, as text (the ``msg_id=`` column)."""


@dataclass(frozen=True)
class RowMeta:
    """Per-row message identity of an Arrow table of batch rows (see the module)."""

    msg_ids: pa.Array
    origin_msg_ids: pa.Array
    topics: pa.Array
    previous: Mapping[int, MessageExt]
    """The retry message each retried row arrived as, by row position."""
    raw_bodies: Mapping[int, str]
    """The source text of malformed rows that have it, by row position."""


def row_meta(
    table: pa.Table, *, owner: str, topic: str, order_column: str, hash_column: str | None
) -> RowMeta:
    """The identity of every row of ``table``.

    ``order_column`` holds each row's place in the batch (Spark's
    ``monotonically_increasing_id``, taken before any shuffle); ``hash_column`` the
    payload hashes (``None``: fingerprints are off).
    """
    size = table.num_rows
    previous = previous_messages(table)
    malformed = text_values(table, MALFORMED_COLUMN)
    raw_bodies = {
        i: raw for i, raw in text_values(table, RAW_BODY_COLUMN).items() if i in malformed
    }
    names = table.column_names
    named: set[int] = set()
    if KEY_HASH_COLUMN in names and hash_column is not None and hash_column in names:
        ids = derived_msg_ids(table.column(KEY_HASH_COLUMN), table.column(hash_column))
    else:
        ids = positional_ids(owner, table.column(order_column))
        if GIVEN_ID_COLUMN in names:
            given = table.column(GIVEN_ID_COLUMN).combine_chunks()
            usable = pc.fill_null(pc.not_equal(given, ""), False)
            ids = pc.if_else(usable, given, ids)
            if raw_bodies:
                named = set(pc.indices_nonzero(usable).to_pylist())
    # A line the source could not parse is its own message, unless the source named it
    # (a Kafka record's topic, partition and offset do).
    ids = with_values(ids, {i: text_msg_id(raw) for i, raw in raw_bodies.items() if i not in named})
    ids = with_values(ids, {i: m.msg_id for i, m in previous.items()})
    origins = with_values(ids, {i: m.origin_msg_id for i, m in previous.items()})
    topics = with_values(
        pa.repeat(pa.scalar(topic, pa.string()), size),
        {i: m.retry_topic_origin for i, m in previous.items()},
    )
    return RowMeta(ids, origins, topics, previous, raw_bodies)


def positional_ids(owner: str, positions: pa.ChunkedArray | pa.Array) -> pa.Array:
    """Ids of rows with no source id and no fingerprint: 16 hex digits naming the batch's
    owner, then 16 of the row's place in the batch."""
    head = msg_id_prefix(owner)[:16]
    digits = hex_digits(positions)
    return pc.binary_join_element_wise(pa.repeat(pa.scalar(head), len(digits)), digits, "")


def previous_messages(table: pa.Table) -> dict[int, MessageExt]:
    """The retry messages rows arrived as (rows of the retry stream), by row position."""
    if MESSAGE_COLUMN not in table.column_names:
        return {}
    column = table.column(MESSAGE_COLUMN)
    if column.null_count == len(column):
        return {}
    present = pc.indices_nonzero(pc.fill_null(pc.not_equal(column, ""), False)).to_pylist()
    wires = column.take(pa.array(present, pa.int64())).to_pylist()
    return {i: MessageExt.from_wire(wire) for i, wire in zip(present, wires, strict=True)}


def text_values(table: pa.Table, column: str) -> dict[int, str]:
    """The non-null values of a text column by row position (none when it is absent)."""
    if column not in table.column_names:
        return {}
    values = table.column(column)
    if values.null_count == len(values):
        return {}
    present = pc.indices_nonzero(pc.is_valid(values)).to_pylist()
    texts = python_values(values.take(pa.array(present, pa.int64())), "replace")
    return dict(zip(present, texts, strict=True))


def text_msg_id(text: str) -> str:
    """A message id (32 hex digits) from a row's source text: copies of a line share it."""
    data = text.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).hexdigest().upper()


def with_values(array: pa.Array, values: Mapping[int, str]) -> pa.Array:
    """``array`` with the string ``values`` put at their row positions."""
    if not values:
        return array
    mask = np.zeros(len(array), dtype=bool)
    positions = sorted(values)
    mask[positions] = True
    return pc.replace_with_mask(
        array, pa.array(mask), pa.array([values[i] for i in positions], pa.string())
    )
