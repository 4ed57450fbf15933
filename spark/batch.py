"""One micro-batch through the protocol, on Arrow: claim, commit, send back, account.

:class:`BatchRun` holds the state of a single batch between the steps the
decorator drives (``claim`` → sink → ``commit`` → ``send_back``), so each step
is small and the crash points between them are explicit. Nothing here talks to
Spark: the batch arrives as an Arrow table.
"""

from __future__ import annotations

import hashlib
import logging
import operator
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from idem.clock import Clock
from idem.config import MismatchPolicy
from idem.dedup import Dedup
from idem.errors import StoreUnavailable
from idem.outcome import BatchClaim, CommitOutcome, DuplicateCause
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt
from idem.retry.sendback import BUSY_DELAY_LEVEL
from idem.retry.status import ConsumeConcurrentlyStatus
from idem.spark.ids import derived_msg_ids, positional_msg_ids, spark_hex
from idem.spark.messages import (
    MALFORMED_COLUMN,
    MESSAGE_COLUMN,
    RAW_BODY_COLUMN,
    RECONSUME_TIMES_COLUMN,
    message_for_row,
    msg_id_prefix,
)
from idem.spark.outcome import BatchOutcome
from idem.spark.rows import RowCodec, python_values

log = logging.getLogger(__name__)

DEAD_LETTER_LEVEL = -1
"""``delay_level_when_next_consume`` that routes a message straight to ``%DLQ%<group>``."""

BROKER_CHOOSES_LEVEL = 0
"""Delay level 0: the broker picks ``3 + reconsume_times``."""


class BatchRun:
    """The state of one batch while the decorator drives it through the protocol."""

    def __init__(
        self,
        *,
        table: pa.Table,
        batch_id: int,
        query_id: str,
        key: str,
        payload_columns: Sequence[str],
        codec: RowCodec,
        topic: str,
        dedup: Dedup,
        retry: RetryEngine,
        clock: Clock,
        fingerprint_column: str | None = None,
        msg_id_column: str | None = None,
        key_hash_column: str | None = None,
        hold_claims: bool = True,
    ) -> None:
        self.table = table
        self.hold_claims = hold_claims
        """Whether the claim takes leases (``False`` only when the ledger commit is the
        sink's write: see :meth:`idem.dedup.Dedup.begin`)."""
        self.batch_id = batch_id
        self.query_id = query_id
        self.owner = f"{query_id}:{batch_id}"
        self.key = key
        self.payload_columns = list(payload_columns)
        self.codec = codec
        self.topic = topic
        self.dedup = dedup
        self.retry = retry
        self.clock = clock
        self.size = table.num_rows
        self.keys = _key_values(table.column(key))
        self.previous = _previous_messages(table)
        self.malformed = _text_values(table, MALFORMED_COLUMN)
        """Rows whose values could not be read, with why (never claimed: dead-lettered)."""
        self.raw_bodies = {
            i: raw for i, raw in _text_values(table, RAW_BODY_COLUMN).items() if i in self.malformed
        }
        """The source text of malformed rows that have it: their dead letters' bodies."""
        self._columns = (fingerprint_column, msg_id_column, key_hash_column)
        self.fingerprints: list[str] | None = None
        """Each row's payload fingerprint (``None`` when not computed); set by :meth:`claim`."""
        self.msg_ids: pa.Array = pa.nulls(0, pa.string())
        """Each row's message id; set by :meth:`claim`."""
        self.claim_result: BatchClaim | None = None
        self.commit_result: CommitOutcome | None = None
        self._applied: list[int] = []
        self._applied_before: list[int] = []
        self._failed: dict[int, str] = {}
        self.misfits: dict[int, str] = {}
        """Fresh rows that do not fit the sink table's column types, with why."""
        self._levels: Counter[int] = Counter()
        self._dead = 0
        self._slipped: tuple[str, ...] = ()

    def _msg_ids(
        self,
        given: pa.ChunkedArray | None,
        key_hashes: pa.ChunkedArray | None,
        fingerprint_hashes: pa.ChunkedArray | None,
    ) -> pa.Array:
        """Each row's message id, as one Arrow column.

        Retried rows keep the id of the message they arrived as; main rows take
        the source's id (``given``), else one derived from the key and payload
        hashes, else a stable id from the batch and the row's position.
        """
        named: set[int] = set()
        if key_hashes is not None and fingerprint_hashes is not None:
            ids = derived_msg_ids(key_hashes, fingerprint_hashes)
        else:
            ids = positional_msg_ids(msg_id_prefix(self.owner), self.size)
            if given is not None:
                values = given.combine_chunks()
                usable = pc.fill_null(pc.not_equal(values, ""), False)
                ids = pc.if_else(usable, values, ids)
                if self.raw_bodies:
                    named = set(pc.indices_nonzero(usable).to_pylist())
        # A line the source could not parse is its own message: its id comes from its text,
        # unless the source named it (a Kafka record's topic, partition and offset do).
        unnamed = {i: _text_msg_id(raw) for i, raw in self.raw_bodies.items() if i not in named}
        ids = _with_values(ids, unnamed)
        return _with_values(ids, {i: m.msg_id for i, m in self.previous.items()})

    # -- step 1-2 ------------------------------------------------------------------------------

    def claim(self) -> BatchClaim:
        """Normalise the keys, drop in-batch duplicates, claim the fresh keys for this owner.

        Of rows sharing a key, the one furthest along its retry chain is kept (then
        the first): its send-back continues that chain. Keeping a fresh copy
        instead would resend under the id of the chain's next message, which is
        still live, and the chain would end when this batch acknowledges it.
        """
        order = None
        if self.previous:
            ahead = sorted(self.previous, key=lambda i: (-self.previous[i].reconsume_times, i))
            order = [*ahead, *(i for i in range(self.size) if i not in self.previous)]
        keys = self.keys
        if self.malformed:  # not claimed: the claim reports them invalid, send_back says why
            keys = [None if i in self.malformed else k for i, k in enumerate(keys)]
        pending = self.dedup.start(
            keys, owner=self.owner, order=order, field=self.key, hold=self.hold_claims
        )
        try:
            self._hash_columns()  # while Redis runs the claims
        except BaseException:
            pending.abandon()
            raise
        self.claim_result = pending.finish(self.fingerprints)
        return self.claim_result

    def _hash_columns(self) -> None:
        """The fingerprints and message ids of the rows, from the hashes Spark computed."""
        fingerprint_column, msg_id_column, key_hash_column = self._columns
        table = self.table
        hashes = table.column(fingerprint_column) if fingerprint_column else None
        self.fingerprints = None if hashes is None else spark_hex(hashes).to_pylist()
        self.msg_ids = self._msg_ids(
            table.column(msg_id_column) if msg_id_column else None,
            table.column(key_hash_column) if key_hash_column and hashes is not None else None,
            hashes,
        )

    @property
    def fresh(self) -> tuple[int, ...]:
        """Indices of the rows claimed for the sink."""
        return self.claim_result.fresh if self.claim_result else ()

    def fingerprint_of(self, index: int) -> str:
        """The payload fingerprint of row ``index`` (empty when not computed)."""
        return self.fingerprints[index] if self.fingerprints else ""

    def fresh_table(
        self, *, keep: Iterable[str] = (), idempotency_column: str | None, group: str
    ) -> pa.Table:
        """The fresh rows with the user's columns (plus ``keep`` columns present in the batch)."""
        names = [*self.payload_columns, *(c for c in keep if c in self.table.column_names)]
        fresh = self.table.select(names).take(pa.array(self.fresh, pa.int64()))
        if RECONSUME_TIMES_COLUMN in fresh.column_names:
            column = fresh.column(RECONSUME_TIMES_COLUMN)
            index = fresh.column_names.index(RECONSUME_TIMES_COLUMN)
            fresh = fresh.set_column(
                index, RECONSUME_TIMES_COLUMN, pc.fill_null(column, pa.scalar(0, column.type))
            )
        if idempotency_column:
            values = [f"{group}:{self.keys_normalised[i]}" for i in self.fresh]
            fresh = fresh.append_column(idempotency_column, pa.array(values, pa.string()))
        return fresh

    @property
    def keys_normalised(self) -> tuple[str | None, ...]:
        """The validated key of every row (``None`` for bad keys)."""
        return self.claim_result.keys if self.claim_result else ()

    def failures_from(self, failed: Mapping[object, str] | None) -> dict[int, str]:
        """Map the sink's ``{key: error}`` onto fresh row indices."""
        if not failed:
            return {}
        if ConsumeConcurrentlyStatus.RECONSUME_LATER in failed:
            return dict.fromkeys(self.fresh, "RECONSUME_LATER")
        by_key = {self.keys_normalised[i]: i for i in self.fresh}
        out: dict[int, str] = {}
        unknown: list[object] = []
        for raw, error in failed.items():
            text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
            index = by_key.get(text)
            if index is None:
                unknown.append(raw)
            else:
                out[index] = error
        if unknown:
            log.warning(
                "the sink reported %d failed key(s) that were not among its fresh rows, e.g. %r",
                len(unknown),
                unknown[0],
            )
        return out

    def release_all(self) -> None:
        """Give back every claim of this batch (the batch is abandoned)."""
        if self.claim_result is not None and self.claim_result.fresh:
            self.dedup.release(self.claim_result)

    def count_own_commits(self) -> int:
        """On a replay: rows an earlier attempt of this very batch committed count as applied.

        Spark replays a batch whose first attempt died after the commit; the replay
        sees those keys as completed. They are the batch's own work, not duplicates.
        """
        claim = self.claim_result
        if claim is None:
            return 0
        completed = [i for i, c in claim.duplicates.items() if c is DuplicateCause.COMPLETED]
        if not completed:
            return 0
        since = self.clock.now_ms() - self.dedup.config.dedup_window_ms
        keys = _keys_at(claim.keys, completed)  # completed keys are never None
        owners = self.dedup.ledger.owners(keys, since_ms=since)
        self._applied_before = [
            i for i, key in zip(completed, keys, strict=True) if owners.get(key) == self.owner
        ]
        return len(self._applied_before)

    # -- step 5 --------------------------------------------------------------------------------

    def commit(
        self,
        failed: Mapping[int, str],
        *,
        payload: pa.Table | None = None,
        misfits: Mapping[int, str] | None = None,
    ) -> None:
        """Commit the accepted rows (ledger first, then Redis); release the failed ones and
        the ``misfits`` (rows that do not fit the sink table: dead-lettered by
        :meth:`send_back`)."""
        claim = self.claim_result
        if claim is None:
            raise RuntimeError("commit before claim")
        self._failed = dict(failed)
        self.misfits = dict(misfits or {})
        if self.misfits:
            failed = {**failed, **self.misfits}
        succeeded = [i for i in claim.fresh if i not in failed] if failed else list(claim.fresh)
        if succeeded:
            app_id = f"idem-spark:{self.dedup.config.group}:{self.query_id}"
            result = self.dedup.complete(
                claim,
                succeeded=succeeded if failed else None,  # None: every fresh row
                batch_id=self.batch_id,
                app_id=app_id,
                meta=self._meta(),
                payload=payload,
                # The ledger commit is durable here; Redis learns of it in the background
                # while Spark moves on (the next batch's claim waits for it).
                defer_index=True,
            )
            # A replayed batch id: Dedup.complete itself commits the rows the earlier
            # commit lacked (accepted now, rejected the first time).
            self.commit_result = result
            self._slipped = result.slipped
            slipped = set(result.slipped)
            self._applied = (
                [i for i in succeeded if claim.keys[i] not in slipped] if slipped else succeeded
            )
        if failed:
            self.dedup.release(claim, list(failed))

    def _meta(self) -> pa.Table:
        """Where each row came from, aligned with the batch (for the ledger rows)."""
        topics = pa.repeat(pa.scalar(self.topic, pa.string()), self.size)
        return pa.table(
            {
                "msg_id": self.msg_ids,
                "origin_msg_id": _with_values(
                    self.msg_ids, {i: m.origin_msg_id for i, m in self.previous.items()}
                ),
                "topic": _with_values(
                    topics, {i: m.retry_topic_origin for i, m in self.previous.items()}
                ),
            }
        )

    # -- step 6 --------------------------------------------------------------------------------

    def send_back(self, failed: Mapping[int, str]) -> None:
        """Failed rows go back on the delay ladder; bad rows and busy rows are sent too."""
        claim = self.claim_result
        if claim is None:
            return
        groups: dict[int, dict[int, str]] = {}
        if failed:
            groups[BROKER_CHOOSES_LEVEL] = dict(failed)
        dead: dict[int, str] = {
            bad.index: f"{bad.reason}: {bad.message}"
            for bad in claim.invalid
            if bad.index not in self.malformed
        }
        dead.update({i: f"malformed: {reason}" for i, reason in self.malformed.items()})
        dead.update({i: f"schema_mismatch: {reason}" for i, reason in self.misfits.items()})
        if self.dedup.config.mismatch_policy is MismatchPolicy.DEAD_LETTER:
            for i in claim.mismatched:
                dead[i] = "payload_mismatch: completed before with a different payload"
        if dead:
            groups[DEAD_LETTER_LEVEL] = dead
        for level, rows in groups.items():
            self._send(level, rows)
        if claim.busy:
            # Not a failure: back after a short delay, reconsume times unchanged, so a
            # key that is merely busy is never dead-lettered.
            self._send(BUSY_DELAY_LEVEL, dict.fromkeys(claim.busy, "busy"), busy=True)

    def _send(self, level: int, rows: Mapping[int, str], *, busy: bool = False) -> None:
        indices = sorted(rows)
        bodies = self.codec.encode_table(self.table, indices)
        if self.raw_bodies:
            bodies = [
                raw.encode("utf-8", "surrogatepass") if (raw := self.raw_bodies.get(i)) else body
                for i, body in zip(indices, bodies, strict=True)
            ]
        now = self.clock.now_ms()
        messages = [
            message_for_row(
                topic=self.topic,
                msg_id=self.msg_ids[i].as_py(),
                index=i,
                key=self.keys_normalised[i] or _raw_key(self.keys[i]),
                body=body,
                schema_json=self.codec.schema_json,
                key_field=self.key,
                born_ms=now,
                previous=self.previous.get(i),
                source_line=i in self.raw_bodies,
            )
            for i, body in zip(indices, bodies, strict=True)
        ]
        app_id = f"idem-spark:{self.dedup.config.group}:{self.query_id}:level{level}"
        if busy:
            result = self.retry.send_back_busy(
                messages, delay_level=level, app_id=f"{app_id}:busy", txn_version=self.batch_id
            )
        else:
            errors = {m.msg_id: rows[i] for m, i in zip(messages, indices, strict=True)}
            result = self.retry.send_back(
                messages,
                delay_level=level,
                errors=errors,
                app_id=app_id,
                txn_version=self.batch_id,
            )
        for outcome in (*result.scheduled, *result.fallback):
            self._levels[outcome.delay_level] += 1
        self._dead += len(result.dead)
        if not result.acknowledged:
            # Nothing durable holds these rows yet: fail the batch so Spark replays it.
            raise StoreUnavailable(
                f"send-back of {len(result.resubmit)} row(s) of batch {self.batch_id} could "
                "not be stored (Redis and Delta unavailable); the batch will be replayed"
            )

    def ack_retried(self) -> int:
        """Acknowledge the retry messages this batch consumed (they are done or re-sent)."""
        if not self.previous:
            return 0
        return self.retry.ack(list(self.previous.values()))

    # -- the outcome ---------------------------------------------------------------------------

    def outcome(self, timings: Mapping[str, float] | None = None) -> BatchOutcome:
        """What happened to the batch's rows."""
        claim = self.claim_result
        retried_rows = len(self.previous)
        if claim is None:
            return BatchOutcome(
                batch_id=self.batch_id,
                query_id=self.query_id,
                owner=self.owner,
                messages=self.size,
                retried_rows=retried_rows,
            )
        before = set(self._applied_before)
        dups = Counter(c.value for i, c in claim.duplicates.items() if i not in before)
        if self._slipped:
            dups[DuplicateCause.SLIPPED.value] += len(self._slipped)
        return BatchOutcome(
            batch_id=self.batch_id,
            query_id=self.query_id,
            owner=self.owner,
            messages=self.size,
            retried_rows=retried_rows,
            applied_keys=_keys_at(claim.keys, (*self._applied_before, *self._applied)),
            failed_keys=tuple(claim.keys[i] or "" for i in sorted(self._failed)),
            busy=len(claim.busy),
            invalid=sum(1 for bad in claim.invalid if bad.index not in self.malformed),
            malformed=len(self.malformed),
            mismatched=len(claim.mismatched),
            duplicates=dict(dups),
            retried_by_level=dict(self._levels),
            dead=self._dead,
            retaken=len(claim.retaken),
            commit_version=self.commit_result.version if self.commit_result else None,
            commit_replayed=bool(self.commit_result and self.commit_result.replayed),
            timings=dict(timings or {}),
        )


def _keys_at(keys: Sequence[str | None], indices: Sequence[int]) -> tuple[str, ...]:
    """The keys at ``indices`` (claimed keys are never ``None``)."""
    if not indices:
        return ()
    if len(indices) == 1:
        return (keys[indices[0]] or "",)
    picked: tuple[str | None, ...] = operator.itemgetter(*indices)(keys)
    return tuple(k or "" for k in picked) if None in picked else cast("tuple[str, ...]", picked)


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


def _key_values(column: pa.ChunkedArray) -> list[object]:
    """The key column as Python values; whole numbers become text (keys are text). A
    Spark string that is not valid UTF-8 (e.g. ``CAST(binary AS STRING)``) keeps its bad
    bytes as lone surrogates: the key check refuses it, and its row is dead-lettered."""
    values: list[object] = python_values(column, "surrogateescape")
    if pa.types.is_integer(column.type):
        return [None if v is None else str(v) for v in values]
    return values


def _previous_messages(table: pa.Table) -> dict[int, MessageExt]:
    """The retry messages rows arrived as (rows of the retry stream), by row index."""
    if MESSAGE_COLUMN not in table.column_names:
        return {}
    column = table.column(MESSAGE_COLUMN)
    if column.null_count == len(column):
        return {}
    present = pc.indices_nonzero(pc.fill_null(pc.not_equal(column, ""), False)).to_pylist()
    wires = column.take(pa.array(present, pa.int64())).to_pylist()
    return {i: MessageExt.from_wire(wire) for i, wire in zip(present, wires, strict=True)}


def _text_values(table: pa.Table, column: str) -> dict[int, str]:
    """The non-null values of a text column by row index (none when it is absent)."""
    if column not in table.column_names:
        return {}
    values = table.column(column)
    if values.null_count == len(values):
        return {}
    present = pc.indices_nonzero(pc.is_valid(values)).to_pylist()
    texts = python_values(values.take(pa.array(present, pa.int64())), "replace")
    return dict(zip(present, texts, strict=True))


def _text_msg_id(text: str) -> str:
    """A message id (32 hex digits) from a row's source text: copies of a line share it."""
    data = text.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=16).hexdigest().upper()


def _with_values(array: pa.Array, values: Mapping[int, str]) -> pa.Array:
    """``array`` with the string ``values`` put at their row indices."""
    if not values:
        return array
    mask = np.zeros(len(array), dtype=bool)
    positions = sorted(values)
    mask[positions] = True
    return pc.replace_with_mask(
        array, pa.array(mask), pa.array([values[i] for i in positions], pa.string())
    )
