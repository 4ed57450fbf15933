"""Rows of a micro-batch that leave it for the retry topic or the DLQ.

The driver gathers only these rows (the sink's failures, bad keys, unreadable
rows, busy keys, payload mismatches dead-lettered by policy, rows that do not
fit the sink table), never the batch. Each becomes the RocketMQ message it was,
or a new one whose body is the row's JSON with its schema, and goes back:
failures on the delay ladder, busy keys after a short delay with their reconsume
times unchanged, bad rows to ``%DLQ%<group>`` at once with their reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from idem.clock import Clock
from idem.errors import StoreUnavailable
from idem.retry.engine import RetryEngine
from idem.retry.sendback import BUSY_DELAY_LEVEL
from idem.spark.messages import message_for_row
from idem.spark.row_meta import RowMeta
from idem.spark.rows import RowCodec, python_values

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
