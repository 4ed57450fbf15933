"""One micro-batch through the protocol, on Arrow: claim, commit, send back, account.

:class:`BatchRun` holds the state of a single batch between the steps the
decorator drives (``claim`` → sink → ``commit`` → ``send_back``), so each step
is small and the crash points between them are explicit. Nothing here talks to
Spark: the batch arrives as an Arrow table.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from idem.clock import Clock
from idem.config import MismatchPolicy
from idem.dedup import Dedup
from idem.errors import StoreUnavailable
from idem.ledger.schema import datetime_of_ms
from idem.outcome import BatchClaim, CommitOutcome, DuplicateCause
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt
from idem.retry.status import ConsumeConcurrentlyStatus
from idem.spark.messages import (
    MESSAGE_COLUMN,
    RECONSUME_TIMES_COLUMN,
    message_for_row,
    msg_id_prefix,
)
from idem.spark.rows import RowCodec
from idem.spark.stats import BatchStats

log = logging.getLogger(__name__)

DEAD_LETTER_LEVEL = -1
"""``delay_level_when_next_consume`` that routes a message straight to ``%DLQ%<group>``."""

BROKER_CHOOSES_LEVEL = 0
"""Delay level 0: the broker picks ``3 + reconsume_times``."""


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What happened to the rows of one micro-batch."""

    batch_id: int
    query_id: str
    owner: str
    messages: int = 0
    retried_rows: int = 0
    applied_keys: tuple[str, ...] = ()
    failed_keys: tuple[str, ...] = ()
    busy: int = 0
    invalid: int = 0
    mismatched: int = 0
    duplicates: Mapping[str, int] = field(default_factory=dict)
    retried_by_level: Mapping[int, int] = field(default_factory=dict)
    dead: int = 0
    retaken: int = 0
    commit_version: int | None = None
    commit_replayed: bool = False
    timings: Mapping[str, float] = field(default_factory=dict)
    """Seconds spent per step (``arrow``, ``claim``, ``sink``, ``commit``, ``send_back``)."""

    @property
    def applied(self) -> int:
        """Rows the sink accepted and that were committed."""
        return len(self.applied_keys)

    @property
    def failed(self) -> int:
        """Rows the sink rejected."""
        return len(self.failed_keys)

    def stats(self) -> BatchStats:
        """The counters to record for the group."""
        return BatchStats(
            query_id=self.query_id,
            batch_id=self.batch_id,
            messages=self.messages,
            retried_rows=self.retried_rows,
            applied=self.applied,
            failed=self.failed,
            busy=self.busy,
            invalid=self.invalid,
            mismatched=self.mismatched,
            duplicates=dict(self.duplicates),
            retried_by_level=dict(self.retried_by_level),
            dead=self.dead,
            retaken=self.retaken,
        )


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
    ) -> None:
        self.table = table
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
        self.fingerprints: list[str] | None = (
            [v or "" for v in table.column(fingerprint_column).to_pylist()]
            if fingerprint_column
            else None
        )
        self.previous = _previous_messages(table)
        self.msg_ids = self._msg_ids(msg_id_column)
        self.claim_result: BatchClaim | None = None
        self.commit_result: CommitOutcome | None = None
        self._applied: list[int] = []
        self._applied_before: list[int] = []
        self._failed: dict[int, str] = {}
        self._levels: Counter[int] = Counter()
        self._dead = 0
        self._slipped: tuple[str, ...] = ()

    def _msg_ids(self, column: str | None) -> list[str]:
        """Each row's message id: retried rows keep theirs; main rows take ``column``'s value.

        Without a value a row gets a stable id from its batch and position.
        """
        prefix = msg_id_prefix(self.owner)
        given = self.table.column(column).to_pylist() if column else [None] * self.size
        ids = [
            str(value) if value else f"{prefix}{i:08X}" for i, value in enumerate(given)
        ]
        for i, prev in self.previous.items():
            ids[i] = prev.msg_id
        return ids

    # -- step 1-2 ------------------------------------------------------------------------------

    def claim(self) -> BatchClaim:
        """Normalise the keys, drop in-batch duplicates, claim the fresh keys for this owner.

        Of rows sharing a key, the one furthest along its retry chain is kept (then
        the first): its send-back continues that chain. Keeping a fresh copy
        instead would resend under the id of the chain's next message, which is
        still live, and the chain would end when this batch acknowledges it.
        """
        order = sorted(
            range(self.size),
            key=lambda i: (-(prev.reconsume_times if (prev := self.previous.get(i)) else -1), i),
        )
        self.claim_result = self.dedup.begin(
            self.keys,
            owner=self.owner,
            fingerprints=self.fingerprints,
            order=order if self.previous else None,
            field=self.key,
        )
        return self.claim_result

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
        mine = committed_by(
            self.dedup.config.resolved_ledger_path,
            self.owner,
            since_ms=self.clock.now_ms() - self.dedup.config.dedup_window_ms,
        )
        self._applied_before = [i for i in completed if claim.keys[i] in mine]
        return len(self._applied_before)

    # -- step 5 --------------------------------------------------------------------------------

    def commit(self, failed: Mapping[int, str], *, payload: pa.Table | None = None) -> None:
        """Commit the accepted rows (ledger first, then Redis); release the failed ones."""
        claim = self.claim_result
        if claim is None:
            raise RuntimeError("commit before claim")
        self._failed = dict(failed)
        succeeded = [i for i in claim.fresh if i not in failed]
        if succeeded:
            app_id = f"idem-spark:{self.dedup.config.group}:{self.query_id}"
            result = self.dedup.complete(
                claim,
                succeeded=succeeded,
                batch_id=self.batch_id,
                app_id=app_id,
                meta=self._meta(),
                payload=payload,
            )
            if result.replayed:
                result = self._commit_missing(claim, succeeded, payload, result)
            self.commit_result = result
            self._slipped = result.slipped
            slipped = set(result.slipped)
            self._applied = [i for i in succeeded if claim.keys[i] not in slipped]
        if failed:
            self.dedup.release(claim, list(failed))

    def _commit_missing(
        self,
        claim: BatchClaim,
        succeeded: Sequence[int],
        payload: pa.Table | None,
        result: CommitOutcome,
    ) -> CommitOutcome:
        """A replayed batch id found its commit done: make sure every accepted key is in it.

        Spark replays a batch with the same id, but the sink may accept rows in the
        replay that it rejected the first time; those are not in the earlier commit.
        """
        keys = [claim.keys[i] or "" for i in succeeded]
        since = self.clock.now_ms() - self.dedup.config.dedup_window_ms
        present = set(self.dedup.ledger.existing(keys, since_ms=since))
        missing = [i for i, k in zip(succeeded, keys, strict=True) if k not in present]
        if not missing:
            return result
        log.warning(
            "batch %d was committed before (replay) without %d key(s) the sink accepted now; "
            "committing them",
            self.batch_id,
            len(missing),
        )
        rows = None
        if payload is not None:
            position = {i: n for n, i in enumerate(succeeded)}
            rows = payload.take(pa.array([position[i] for i in missing], pa.int64()))
        return self.dedup.complete(
            claim,
            succeeded=missing,
            batch_id=self.batch_id,
            app_id=f"idem-spark:{self.dedup.config.group}:{self.owner}:{self.clock.now_ms()}",
            meta=self._meta(),
            payload=rows,
        )

    def _meta(self) -> pa.Table:
        """Where each row came from, aligned with the batch (for the ledger rows)."""
        origins = list(self.msg_ids)
        topics = [self.topic] * self.size
        for i, prev in self.previous.items():
            origins[i] = prev.origin_msg_id
            topics[i] = prev.retry_topic_origin
        return pa.table(
            {
                "msg_id": pa.array(self.msg_ids, pa.string()),
                "origin_msg_id": pa.array(origins, pa.string()),
                "topic": pa.array(topics, pa.string()),
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
        dead: dict[int, str] = {bad.index: f"{bad.reason}: {bad.message}" for bad in claim.invalid}
        if self.dedup.config.mismatch_policy is MismatchPolicy.DEAD_LETTER:
            for i in claim.mismatched:
                dead[i] = "payload_mismatch: completed before with a different payload"
        if dead:
            groups[DEAD_LETTER_LEVEL] = dead
        if claim.busy:
            groups[1] = dict.fromkeys(claim.busy, "busy: another owner holds a live claim")
        for level, rows in groups.items():
            self._send(level, rows)

    def _send(self, level: int, rows: Mapping[int, str]) -> None:
        indices = sorted(rows)
        bodies = self.codec.encode_table(self.table, indices)
        now = self.clock.now_ms()
        messages = [
            message_for_row(
                topic=self.topic,
                msg_id=self.msg_ids[i],
                index=i,
                key=self.keys_normalised[i] or _raw_key(self.keys[i]),
                body=body,
                schema_json=self.codec.schema_json,
                key_field=self.key,
                born_ms=now,
                previous=self.previous.get(i),
            )
            for i, body in zip(indices, bodies, strict=True)
        ]
        errors = {m.msg_id: rows[i] for m, i in zip(messages, indices, strict=True)}
        result = self.retry.send_back(
            messages,
            delay_level=level,
            errors=errors,
            app_id=f"idem-spark:{self.dedup.config.group}:{self.query_id}:level{level}",
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
            applied_keys=tuple(
                claim.keys[i] or "" for i in (*self._applied_before, *self._applied)
            ),
            failed_keys=tuple(claim.keys[i] or "" for i in sorted(self._failed)),
            busy=len(claim.busy),
            invalid=len(claim.invalid),
            mismatched=len(claim.mismatched),
            duplicates=dict(dups),
            retried_by_level=dict(self._levels),
            dead=self._dead,
            retaken=len(claim.retaken),
            commit_version=self.commit_result.version if self.commit_result else None,
            commit_replayed=bool(self.commit_result and self.commit_result.replayed),
            timings=dict(timings or {}),
        )


def committed_by(ledger_path: str, owner: str, *, since_ms: int) -> set[str]:
    """Keys the ledger at ``ledger_path`` holds from ``owner`` (read only on a replay)."""
    if not DeltaTable.is_deltatable(ledger_path):
        return set()
    since = datetime_of_ms(since_ms).date()
    dataset = DeltaTable(ledger_path).to_pyarrow_dataset()
    table = dataset.to_table(
        columns=["key"],
        filter=(pc.field("owner") == owner) & (pc.field("completed_date") >= since),
    )
    return {str(k) for k in table.column("key").to_pylist()}


def _raw_key(value: object) -> str | None:
    """A bad key as text for the DLQ row (``None`` when it is not text at all)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return None


def _key_values(column: pa.ChunkedArray) -> list[object]:
    """The key column as Python values; whole numbers become text (keys are text)."""
    values: list[object] = column.to_pylist()
    if pa.types.is_integer(column.type):
        return [None if v is None else str(v) for v in values]
    return values


def _previous_messages(table: pa.Table) -> dict[int, MessageExt]:
    """The retry messages rows arrived as (rows of the retry stream), by row index."""
    if MESSAGE_COLUMN not in table.column_names:
        return {}
    out: dict[int, MessageExt] = {}
    for i, wire in enumerate(table.column(MESSAGE_COLUMN).to_pylist()):
        if wire:
            out[i] = MessageExt.from_wire(wire)
    return out
