"""Rows of a micro-batch that leave it for the retry topic or the DLQ.

The driver gathers only these rows (the sink's failures, bad keys, unreadable
rows, busy keys, payload mismatches dead-lettered by policy, rows that do not
fit the sink table), never the batch, with their bodies already made by the
executors (:class:`BodyTask`: the row's JSON, read back with the schema the
message carries; never pickle). Each becomes the RocketMQ message it was, or a
new one with that body, and goes back:
failures on the delay ladder, busy keys after a short delay with their reconsume
times unchanged, bad rows to ``%DLQ%<group>`` at once with their reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa

from idem.clock import Clock
from idem.errors import StoreUnavailable
from idem.retry.engine import RetryEngine
from idem.retry.sendback import BUSY_DELAY_LEVEL
from idem.spark.messages import message_for_row
from idem.spark.row_meta import RowMeta
from idem.spark.rows import RowCodec, python_values

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

BODY_COLUMN = "_idem_body"
"""The message body of a row that leaves its batch (its JSON), made on an executor."""

DEAD_LETTER_LEVEL = -1
"""``delay_level_when_next_consume`` that routes a message straight to ``%DLQ%<group>``."""

BROKER_CHOOSES_LEVEL = 0
"""Delay level 0: the broker picks ``3 + reconsume_times``."""


@dataclass
class SendBackTally:
    """What the send-back of a batch did."""

    by_level: Counter[int] = field(default_factory=Counter)
    """Rows scheduled, by delay level."""
    dead: int = 0
    """Rows routed to ``%DLQ%<group>``."""


@dataclass(frozen=True)
class SendBack:
    """Sends rows of one batch back (see the module).

    Args:
        retry: The group's retry engine.
        codec: Encodes a row's user columns as its message body.
        topic: The topic of main-stream rows.
        key_field: The column holding the business key.
        app_id: The journal's transaction id prefix (group and query).
        batch_id: The micro-batch id (the journal's transaction version).
        clock: Stamps the new messages.
    """

    retry: RetryEngine
    codec: RowCodec
    topic: str
    key_field: str
    app_id: str
    batch_id: int
    clock: Clock

    def send(
        self,
        rows: pa.Table,
        meta: RowMeta,
        keys: pa.Array,
        *,
        level: int,
        reasons: Mapping[int, str],
        tally: SendBackTally,
    ) -> None:
        """Send ``rows`` at the positions of ``reasons`` back on ``level`` (or to the DLQ,
        or after the busy delay). ``keys`` are the rows' validated keys (null: bad).

        Raises :class:`StoreUnavailable` when neither Redis nor Delta took them: nothing
        durable holds them, so the batch must fail and be replayed.
        """
        if not reasons:
            return
        positions = sorted(reasons)
        if BODY_COLUMN in rows.column_names:
            bodies = rows.column(BODY_COLUMN).take(pa.array(positions)).to_pylist()
        else:
            bodies = self.codec.encode_table(rows, positions)
        raw_keys = python_values(
            rows.column(self.key_field).take(pa.array(positions)), "surrogateescape"
        )
        valid = keys.take(pa.array(positions)).to_pylist()
        now = self.clock.now_ms()
        messages = []
        for n, i in enumerate(positions):
            raw = meta.raw_bodies.get(i)
            messages.append(
                message_for_row(
                    topic=self.topic,
                    msg_id=meta.msg_ids[i].as_py(),
                    index=i,
                    key=valid[n] if valid[n] is not None else _raw_key(raw_keys[n]),
                    body=raw.encode("utf-8", "surrogatepass") if raw else bodies[n],
                    schema_json=self.codec.schema_json,
                    key_field=self.key_field,
                    born_ms=now,
                    previous=meta.previous.get(i),
                    source_line=raw is not None,
                )
            )
        app_id = f"{self.app_id}:level{level}"
        if level == BUSY_DELAY_LEVEL:
            result = self.retry.send_back_busy(
                messages, delay_level=level, app_id=f"{app_id}:busy", txn_version=self.batch_id
            )
        else:
            errors = {m.msg_id: reasons[i] for m, i in zip(messages, positions, strict=True)}
            result = self.retry.send_back(
                messages,
                delay_level=level,
                errors=errors,
                app_id=app_id,
                txn_version=self.batch_id,
            )
        for outcome in (*result.scheduled, *result.fallback):
            tally.by_level[outcome.delay_level] += 1
        tally.dead += len(result.dead)
        if not result.acknowledged:
            raise StoreUnavailable(
                f"send-back of {len(result.resubmit)} row(s) of batch {self.batch_id} could "
                "not be stored (Redis and Delta unavailable); the batch will be replayed"
            )


@dataclass(frozen=True)
class BodyTask:
    """Appends :data:`BODY_COLUMN` to a task's rows; ``mapInArrow`` calls it on an executor.

    Args:
        schema_json: The user's columns' Spark schema, in Spark's JSON form.
        renamed: Columns the rows carry under another name, ``{name: carried as}``.
    """

    schema_json: str
    renamed: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The rows with their bodies (called once per task)."""
        codec = RowCodec.from_schema_json(self.schema_json)
        back = {v: k for k, v in self.renamed.items()}
        for batch in batches:
            if not batch.num_rows:
                continue
            table = pa.Table.from_batches([batch])
            named = table.rename_columns([back.get(n, n) for n in table.column_names])
            bodies = pa.array(codec.encode_table(named), pa.binary())
            yield from table.append_column(BODY_COLUMN, bodies).to_batches()


def with_bodies(rows: DataFrame, task: BodyTask) -> DataFrame:
    """``rows`` with :data:`BODY_COLUMN` made on the executors (lazy)."""
    from pyspark.sql import types as st  # noqa: PLC0415 -- pyspark is loaded by now

    schema = st.StructType([*rows.schema.fields, st.StructField(BODY_COLUMN, st.BinaryType())])
    return rows.mapInArrow(task, schema)


def _raw_key(value: object) -> str | None:
    """A bad key as text for the DLQ row, so ``idem dlq show --key`` finds it (``None``
    when it is null): a decimal, date or float key is written as Python prints it, and
    text that is not valid Unicode with its bad bytes escaped (``K\\xff``)."""
    if value is None:
        return value
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            errors = "surrogateescape" if _escaped_bytes_only(value) else "surrogatepass"
            return value.encode("utf-8", errors).decode("utf-8", "backslashreplace")
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _escaped_bytes_only(text: str) -> bool:
    """Whether every lone surrogate in ``text`` stands for a byte (``surrogateescape``)."""
    return all("\udc80" <= c <= "\udcff" for c in text if "\ud800" <= c <= "\udfff")
