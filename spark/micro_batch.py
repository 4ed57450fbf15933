"""One micro-batch through the protocol, its rows kept on the executors.

:class:`MicroBatch` owns a batch from its claim to its acknowledgement:

1. **claim** on the executors (:func:`idem.spark.claimed.claim_batch`): every row
   gets its verdict where it lies, and the verdicts are kept by Spark;
2. **sink**: the user's function gets the claimed rows as a DataFrame that stays
   the same however often it is read; with leases, the driver renews them every
   third of a lease from the claim job's start until the batch's claims are
   completed or released (the tasks record the keys under the batch's owner in
   Redis, so a renewal is one call per bucket: :class:`~idem.lease_keeper.LeaseKeeper`);
3. **commit** of the accepted rows: their ledger rows are made on the executors
   (:mod:`idem.spark.ledger_rows`); on the delta-spark engine they are one Spark
   MERGE and the Redis index update runs on the executors too; on the embedded
   delta-rs engine the executors stage the rows as files (a Delta sink's with
   the user's columns) and the driver, reading back only the ledger columns it
   decides with — never the user's payload — commits them, streaming the files
   into the commit (:mod:`idem.spark.staging`);
4. **send-back** of the rows that leave the batch (failed, bad, busy, mismatched
   by policy, not fitting the sink table): only these rows come to the driver;
5. **record** of the batch's counters, then **ack** of the retry rows it consumed.

Observers (:class:`idem.spark.faults.BatchObserver`) are told when the batch
reaches each :class:`~idem.spark.faults.CrashPoint`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from idem.clock import Clock, SystemClock
from idem.commit_rows import STAGED_COLUMNS
from idem.config import DedupMode, MismatchPolicy
from idem.dedup import Dedup
from idem.errors import ConfigError, PayloadMismatch
from idem.keys import group_by_bucket
from idem.lease_keeper import LeaseKeeper
from idem.ledger.deltars import DeltaLedger
from idem.ledger.staged import StagedRows
from idem.outcome import ClaimedRows, DuplicateCause
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt
from idem.retry.sendback import BUSY_DELAY_LEVEL
from idem.retry.status import ConsumeConcurrentlyStatus
from idem.spark.claimed import ClaimedBatch, claim_batch, kept_level
from idem.spark.faults import BatchObserver, CrashPoint, TaskFault
from idem.spark.index_task import IndexTask, ReleaseTask, index_committed, release_claimed
from idem.spark.ledger_rows import MISFIT_COLUMN, LedgerRowsTask, ledger_frame
from idem.spark.messages import MESSAGE_COLUMN, RECONSUME_TIMES_COLUMN
from idem.spark.outcome import BatchOutcome
from idem.spark.row_meta import previous_messages, row_meta
from idem.spark.rows import RowCodec
from idem.spark.send_back import (
    BROKER_CHOOSES_LEVEL,
    DEAD_LETTER_LEVEL,
    BodyTask,
    SendBack,
    SendBackTally,
    with_bodies,
)
from idem.spark.sink_result import SinkFunction, call_sink, failed_keys, quoted
from idem.spark.staging import Staging
from idem.spark.stats import StatsStore
from idem.spark.verdicts import (
    BUCKET_COLUMN,
    CLAIMED,
    CONFLICT_DETAIL,
    DETAIL_COLUMN,
    FINGERPRINT_TEXT_COLUMN,
    HASH_COLUMN,
    KEY_COLUMN,
    ORDER_COLUMN,
    VERDICT_COLUMN,
    Verdict,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

    from idem.ledger.base import CommitResult
    from idem.ledger.spark_engine import SparkDeltaLedger

log = logging.getLogger(__name__)

APPLIED_KEYS_SHOWN = 100
"""How many applied keys a :class:`BatchOutcome` names (all of them when fewer)."""

MISMATCH_DETAIL = "completed before with a different payload"
"""Why a row whose key was completed with another payload is dead-lettered by policy."""


@dataclass(frozen=True)
class _AllFailed:
    """Every claimed row failed (the sink raised, or answered RECONSUME_LATER)."""

    error: str


Failures = Mapping[str, str] | _AllFailed
"""What the sink rejected: ``{key: error}``, or every claimed row."""


@dataclass(frozen=True)
class BatchSetup:
    """What every micro-batch of one ``foreachBatch`` sink shares."""

    key: str
    fn: SinkFunction | None
    payload_columns: tuple[str, ...]
    sink_columns: tuple[str, ...]
    """The user's columns written into the Delta sink table (empty: no sink table, or
    no column but the key)."""
    topic: str
    idempotency_column: str | None
    fingerprints: bool
    hold: bool
    dedup: Dedup
    retry: RetryEngine
    stats: StatsStore
    clock: Clock
    codec: RowCodec
    observers: tuple[BatchObserver, ...] = ()
    task_fault: TaskFault | None = None
    renamed: Mapping[str, str] = field(default_factory=dict)
    """Columns the prepared batch carries under another name, ``{name: carried as}``:
    PySpark's ``mapInArrow`` cannot take a column whose name holds a backtick or a dot."""

    def carried(self, name: str) -> str:
        """The name column ``name`` has in the prepared batch."""
        return self.renamed.get(name, name)

    def restored(self, table: pa.Table) -> pa.Table:
        """``table`` with the user's own column names."""
        if not self.renamed:
            return table
        back = {v: k for k, v in self.renamed.items()}
        return table.rename_columns([back.get(n, n) for n in table.column_names])


@dataclass
class _Steps:
    """Seconds per step of a batch, for logs and benchmarks."""

    laps: dict[str, float] = field(default_factory=dict)
    last: float = field(default_factory=time.perf_counter)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now


@dataclass
class _Commit:
    """What the commit of the accepted rows did."""

    applied: int = 0
    applied_keys: tuple[str, ...] = ()
    slipped: int = 0
    version: int | None = None
    replayed: bool = False
    misfits: dict[str, str] = field(default_factory=dict)


class MicroBatch:
    """One micro-batch, from claim to ack (see the module); :meth:`run` drives it once."""

    def __init__(
        self, setup: BatchSetup, prepared: DataFrame, *, batch_id: int, query_id: str, attempt: int
    ) -> None:
        self.setup = setup
        self.prepared = prepared
        self.batch_id = batch_id
        self.query_id = query_id
        self.owner = f"{query_id}:{batch_id}"
        self.attempt = attempt
        self.app_id = f"idem-spark:{setup.dedup.config.group}:{query_id}"
        self._steps = _Steps()

    def _reached(self, point: CrashPoint) -> None:
        for observer in self.setup.observers:
            observer.reached(point, self.batch_id)

    def run(self) -> BatchOutcome:
        """Drive the batch through every step; the outcome is recorded in the group's stats.

        The Spark jobs of each step carry its name as their description (in the
        Spark UI and its status API: ``idem <group> batch <id>: claim``); the
        description the thread had before is put back at the end.
        """
        context = self.prepared.sparkSession.sparkContext
        before = context.getLocalProperty(_JOB_DESCRIPTION)
        try:
            return self._run()
        finally:
            context.setLocalProperty(_JOB_DESCRIPTION, before)  # type: ignore[arg-type]

    def _describe(self, step: str) -> None:
        """Name the Spark jobs that follow after this batch's ``step``."""
        self.prepared.sparkSession.sparkContext.setJobDescription(
            f"idem {self.setup.dedup.config.group} batch {self.batch_id}: {step}"
        )

    def _run(self) -> BatchOutcome:
        self._reached(CrashPoint.BEFORE_CLAIM)
        self._describe("claim")
        s = self.setup
        # With leases, the claims are renewed from the moment the tasks make them (the
        # claim job, the sink and the commit may each outlast a lease) until the batch
        # has completed or released them, or its driver died.
        with LeaseKeeper(s.dedup, None, self.owner) if s.hold else nullcontext():
            claimed = claim_batch(
                self.prepared,
                s.dedup,
                owner=self.owner,
                key=s.carried(s.key),
                hold=s.hold,
                fingerprints=s.fingerprints,
                fault=s.task_fault,
                track=s.hold,
            )
            try:
                return self._after_claim(claimed)
            finally:
                claimed.release()

    def _after_claim(self, claimed: ClaimedBatch) -> BatchOutcome:
        s = self.setup
        counts = claimed.counts
        total = sum(counts.values())
        if total == 0:
            return BatchOutcome(batch_id=self.batch_id, query_id=self.query_id, owner=self.owner)
        retaken = counts.get(Verdict.RETAKEN, 0)
        if retaken and s.fn is not None:
            # Counted before the function runs, so a crash inside it cannot hide a repeat.
            # (Without a function the Delta sink's commit is the write: nothing repeats.)
            s.stats.add("possible_repeats", retaken)
        own_before = self._count_own_commits(claimed) if self.attempt > 1 else 0
        self._steps.lap("claim")
        self._describe("sink")
        self._reached(CrashPoint.AFTER_CLAIM)
        self._check_mismatches(claimed)
        failures = self._call_sink(claimed) if claimed.claimed else {}
        self._steps.lap("sink")
        self._describe("commit")
        self._reached(CrashPoint.AFTER_SINK)
        leaving = self._leaving(claimed, failures)
        failed = self._failed_rows(leaving, failures)
        commit = self._commit(claimed, failures, failed)
        if commit.misfits:
            leaving = self._with_misfits(claimed, leaving, commit.misfits)
        released = [*failed.values(), *commit.misfits]
        if released and s.hold:
            s.dedup.hot.release(group_by_bucket(released, s.dedup.config.buckets), self.owner)
        self._steps.lap("commit")
        self._describe("send-back")
        self._reached(CrashPoint.AFTER_COMMIT)
        tally = self._send_back(leaving, failures, commit.misfits)
        self._steps.lap("send_back")
        self._describe("record")
        self._reached(CrashPoint.AFTER_SEND_BACK)
        retried = self._retried(claimed)
        mismatched = counts.get(Verdict.MISMATCHED, 0) + counts.get(Verdict.CONFLICTING, 0)
        duplicates = {
            DuplicateCause.IN_BATCH.value: counts.get(Verdict.IN_BATCH, 0)
            + counts.get(Verdict.CONFLICTING, 0),
            DuplicateCause.COMPLETED.value: counts.get(Verdict.COMPLETED, 0)
            + counts.get(Verdict.MISMATCHED, 0)
            - own_before,
            DuplicateCause.SLIPPED.value: commit.slipped,
        }
        outcome = BatchOutcome(
            batch_id=self.batch_id,
            query_id=self.query_id,
            owner=self.owner,
            messages=total,
            retried_rows=len(retried),
            applied=commit.applied + own_before,
            applied_keys=commit.applied_keys,
            failed_keys=tuple(failed.values()),
            busy=counts.get(Verdict.BUSY, 0),
            invalid=counts.get(Verdict.INVALID, 0),
            malformed=counts.get(Verdict.MALFORMED, 0),
            mismatched=mismatched,
            duplicates={cause: n for cause, n in duplicates.items() if n},
            retried_by_level=dict(tally.by_level),
            dead=tally.dead,
            retaken=retaken,
            commit_version=commit.version,
            commit_replayed=commit.replayed,
            timings=dict(self._steps.laps),
        )
        # Recorded before the retry rows are acknowledged: a replay after a crash between
        # the two reads them again (and record adds a batch once), where a replay after
        # the ack would find them gone, the batch perhaps empty, and count nothing.
        s.stats.record(outcome)
        self._reached(CrashPoint.AFTER_RECORD)
        if retried:
            s.retry.ack(list(retried.values()))
        self._reached(CrashPoint.AFTER_ACK)
        self._reached(CrashPoint.AFTER_BATCH)
        return outcome

    # -- claim --------------------------------------------------------------------------------

    def _count_own_commits(self, claimed: ClaimedBatch) -> int:
        """On a replay: rows an earlier attempt of this very batch committed count as applied.

        Spark replays a batch whose first attempt died after the commit; the replay
        sees those keys as completed. They are the batch's own work, not duplicates.
        """
        from pyspark.sql import functions as F  # noqa: N812, PLC0415 -- Spark's convention

        if not claimed.counts.get(Verdict.COMPLETED):
            return 0
        done = claimed.frame.where(F.col(VERDICT_COLUMN) == int(Verdict.COMPLETED))
        keys = done.select(KEY_COLUMN).toArrow().column(0).to_pylist()
        dedup = self.setup.dedup
        since = self.setup.clock.now_ms() - dedup.config.dedup_window_ms
        owners = dedup.ledger.owners(keys, since_ms=since)
        return sum(1 for key in keys if owners.get(key) == self.owner)

    def _check_mismatches(self, claimed: ClaimedBatch) -> None:
        from pyspark.sql import functions as F  # noqa: N812, PLC0415

        counts = claimed.counts
        found = counts.get(Verdict.MISMATCHED, 0) + counts.get(Verdict.CONFLICTING, 0)
        if not found:
            return
        policy = self.setup.dedup.config.mismatch_policy
        if policy is MismatchPolicy.WARN:
            log.warning(
                "batch %d: %d key(s) arrived again with a different payload", self.batch_id, found
            )
            return
        if policy is not MismatchPolicy.RAISE:
            return
        mismatch = F.col(VERDICT_COLUMN).isin([int(Verdict.MISMATCHED), int(Verdict.CONFLICTING)])
        row = (
            claimed.frame.where(mismatch)
            .orderBy(ORDER_COLUMN)
            .select(KEY_COLUMN, VERDICT_COLUMN, DETAIL_COLUMN, FINGERPRINT_TEXT_COLUMN)
            .first()
        )
        self._release_claimed(claimed)
        if row is None:  # pragma: no cover - counted above
            return
        stored = row[2] if row[1] == int(Verdict.MISMATCHED) else "(another row of the batch)"
        raise PayloadMismatch(row[0] or "", stored=stored or "(ledger)", seen=row[3] or "")

    def _release_claimed(self, claimed: ClaimedBatch) -> None:
        """Give back every claim of the batch (it is abandoned)."""
        if not claimed.claimed or not self.setup.hold:
            return
        release_claimed(claimed.fresh, ReleaseTask(self.setup.dedup.config, self.owner))

    # -- sink ---------------------------------------------------------------------------------

    def _call_sink(self, claimed: ClaimedBatch) -> Failures:
        """Call the user's function with the claimed rows; ``{key: error}`` of its failures,
        or :class:`_AllFailed`."""
        from pyspark.sql import functions as F  # noqa: N812, PLC0415

        s = self.setup
        if s.fn is None:
            return {}
        fresh = claimed.fresh
        columns: list[Column] = [
            F.col(quoted(s.carried(name))).alias(name) for name in s.payload_columns
        ]
        if RECONSUME_TIMES_COLUMN in fresh.columns:
            columns.append(
                F.coalesce(F.col(RECONSUME_TIMES_COLUMN), F.lit(0)).alias(RECONSUME_TIMES_COLUMN)
            )
        if s.idempotency_column:
            group = s.dedup.config.group
            columns.append(
                F.concat(F.lit(f"{group}:"), F.col(KEY_COLUMN)).alias(s.idempotency_column)
            )
        fresh_df = fresh.select(*columns)
        try:
            result = call_sink(s.fn, fresh_df, self.batch_id)
        except Exception as exc:  # the user's failure: every fresh row is reconsumed later
            return self._sink_raised(claimed, exc)
        try:
            reported = failed_keys(result, s.key)
        except ConfigError:
            raise  # not a result idem can read: a bug to fix, not rows to retry
        except Exception as exc:
            # A lazy result (a DataFrame of failed rows, a generator) runs the user's code
            # only as it is read here: its failure is the sink's, not the query's.
            return self._sink_raised(claimed, exc)
        if not reported:
            return {}
        if ConsumeConcurrentlyStatus.RECONSUME_LATER in reported:
            return _AllFailed("RECONSUME_LATER")
        return {
            (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)): error
            for raw, error in reported.items()
        }

    def _sink_raised(self, claimed: ClaimedBatch, exc: Exception) -> _AllFailed:
        log.warning(
            "sink %s raised %s: %d fresh row(s) will be reconsumed later",
            getattr(self.setup.fn, "__name__", self.setup.fn),
            type(exc).__name__,
            claimed.claimed,
            exc_info=True,
        )
        return _AllFailed(f"{type(exc).__name__}: {exc}")

    # -- rows that leave the batch ------------------------------------------------------------

    def _leaving(self, claimed: ClaimedBatch, failures: Failures) -> pa.Table:
        """The rows that go back or to the DLQ, gathered on the driver (only these)."""
        from pyspark.sql import functions as F  # noqa: N812, PLC0415

        verdict = F.col(VERDICT_COLUMN)
        out = [Verdict.BUSY, Verdict.INVALID, Verdict.MALFORMED]
        if self.setup.dedup.config.mismatch_policy is MismatchPolicy.DEAD_LETTER:
            out += [Verdict.MISMATCHED, Verdict.CONFLICTING]
        condition = verdict.isin([int(v) for v in out])
        claimed_row = verdict.isin([int(v) for v in CLAIMED])
        if isinstance(failures, _AllFailed):
            condition = condition | claimed_row
        wanted = sum(claimed.counts.get(v, 0) for v in out)
        if not wanted and not failures:
            return self.setup.restored(claimed.frame.limit(0).toArrow())
        chosen = claimed.frame.where(condition)
        if isinstance(failures, Mapping) and failures:
            rejected = _among(claimed.frame.where(claimed_row), failures, keep=True)
            chosen = chosen.unionByName(rejected)
        rows = with_bodies(chosen, self._bodies())
        return self.setup.restored(rows.orderBy(ORDER_COLUMN).toArrow())

    def _bodies(self) -> BodyTask:
        s = self.setup
        return BodyTask(s.codec.schema_json, dict(s.renamed))

    def _failed_rows(self, leaving: pa.Table, failures: Failures) -> dict[int, str]:
        """The claimed rows the sink rejected: ``{position in leaving: key}``."""
        if not failures:
            return {}
        verdicts = leaving.column(VERDICT_COLUMN).to_numpy()
        keys = leaving.column(KEY_COLUMN).to_pylist()
        claimed = {int(v) for v in CLAIMED}
        found = {i: keys[i] for i in range(leaving.num_rows) if int(verdicts[i]) in claimed}
        if isinstance(failures, Mapping):
            unknown = set(failures) - set(found.values())
            if unknown:
                log.warning(
                    "the sink reported %d failed key(s) that were not among its fresh rows, "
                    "e.g. %r",
                    len(unknown),
                    next(iter(unknown)),
                )
        return found

    def _with_misfits(
        self, claimed: ClaimedBatch, leaving: pa.Table, misfits: Mapping[str, str]
    ) -> pa.Table:
        misfit = _among(claimed.fresh, misfits, keep=True)
        rows = self.setup.restored(with_bodies(misfit, self._bodies()).toArrow())
        return pa.concat_tables([leaving, rows.cast(leaving.schema)]) if leaving.num_rows else rows

    def _send_back(
        self,
        leaving: pa.Table,
        failures: Failures,
        misfits: Mapping[str, str],
    ) -> SendBackTally:
        s = self.setup
        tally = SendBackTally()
        if not leaving.num_rows:
            return tally
        meta = row_meta(
            leaving,
            owner=self.owner,
            topic=s.topic,
            order_column=ORDER_COLUMN,
            hash_column=HASH_COLUMN if s.fingerprints else None,
        )
        keys = leaving.column(KEY_COLUMN).combine_chunks()
        verdicts = leaving.column(VERDICT_COLUMN).to_numpy()
        details = leaving.column(DETAIL_COLUMN).to_pylist()
        names = keys.to_pylist()
        failed: dict[int, str] = {}
        dead: dict[int, str] = {}
        busy: dict[int, str] = {}
        for i, code in enumerate(verdicts.tolist()):
            verdict = Verdict(code)
            if verdict in CLAIMED:
                name = names[i]
                if name in misfits:
                    dead[i] = f"schema_mismatch: {misfits[name]}"
                elif isinstance(failures, _AllFailed):
                    failed[i] = failures.error
                elif isinstance(failures, Mapping):
                    failed[i] = failures[name]
            elif verdict is Verdict.INVALID:
                dead[i] = details[i]
            elif verdict is Verdict.MALFORMED:
                dead[i] = f"malformed: {details[i]}"
            elif verdict is Verdict.MISMATCHED:
                dead[i] = f"payload_mismatch: {MISMATCH_DETAIL}"
            elif verdict is Verdict.CONFLICTING:
                dead[i] = f"payload_mismatch: {CONFLICT_DETAIL}"
            elif verdict is Verdict.BUSY:
                busy[i] = "busy"
        sender = SendBack(
            retry=s.retry,
            codec=s.codec,
            topic=s.topic,
            key_field=s.key,
            app_id=self.app_id,
            batch_id=self.batch_id,
            clock=s.clock,
        )
        sender.send(leaving, meta, keys, level=BROKER_CHOOSES_LEVEL, reasons=failed, tally=tally)
        sender.send(leaving, meta, keys, level=DEAD_LETTER_LEVEL, reasons=dead, tally=tally)
        # Not a failure: back after a short delay, reconsume times unchanged, so a key
        # that is merely busy is never dead-lettered.
        sender.send(leaving, meta, keys, level=BUSY_DELAY_LEVEL, reasons=busy, tally=tally)
        return tally

    def _retried(self, claimed: ClaimedBatch) -> dict[int, MessageExt]:
        """The retry messages the batch's rows arrived as (acknowledged after the batch)."""
        from pyspark.sql import functions as F  # noqa: N812, PLC0415

        if MESSAGE_COLUMN not in claimed.frame.columns:
            return {}
        column = F.col(MESSAGE_COLUMN)
        wires = claimed.frame.where(column.isNotNull() & (column != "")).select(MESSAGE_COLUMN)
        return dict(previous_messages(wires.toArrow()))

    # -- commit -------------------------------------------------------------------------------

    def _commit(
        self,
        claimed: ClaimedBatch,
        failures: Failures,
        failed: Mapping[int, str],
    ) -> _Commit:
        """Commit the accepted rows: ledger first, then the Redis index."""
        from pyspark.sql import functions as F  # noqa: N812, PLC0415

        s = self.setup
        if isinstance(failures, _AllFailed) or not claimed.claimed:
            return _Commit()
        accepted = claimed.fresh
        offered = claimed.claimed - len(failed)
        if failed:
            accepted = _among(accepted, failed.values(), keep=False)
        if offered <= 0:
            return _Commit()
        ledger = s.dedup.ledger
        now = s.dedup.hot.now_ms()  # Redis's clock, as the ledger rows' completed_at
        task = LedgerRowsTask(
            group=s.dedup.config.group,
            owner=self.owner,
            batch_id=self.batch_id,
            topic=s.topic,
            completed_at_ms=now,
            columns=s.sink_columns,
            carried=tuple(s.carried(name) for name in s.sink_columns),
            table_types=ledger.column_types() if s.sink_columns else None,
            fingerprints=s.fingerprints,
        )
        # Kept: the commit, the index update and the applied sample all read these rows.
        rows = ledger_frame(accepted, task).persist(kept_level())
        misfits: dict[str, str] = {}
        if s.sink_columns:
            found = rows.where(F.col(MISFIT_COLUMN).isNotNull()).select("key", MISFIT_COLUMN)
            misfits = {r[0]: r[1] for r in found.collect()}
        try:
            good = rows.where(F.col(MISFIT_COLUMN).isNull()).drop(MISFIT_COLUMN)
            offered -= len(misfits)
            if offered <= 0:
                return _Commit(misfits=misfits)
            done = self._commit_rows(claimed, good, offered, now)
            done.misfits = misfits
            return done
        finally:
            rows.unpersist()

    def _commit_rows(
        self, claimed: ClaimedBatch, rows: DataFrame, offered: int, now: int
    ) -> _Commit:
        from idem.ledger.spark_engine import SparkDeltaLedger  # noqa: PLC0415

        s = self.setup
        config = s.dedup.config
        strict = config.mode is DedupMode.STRICT
        # See Dedup.complete: a lease kept every other writer off the key since the
        # claim, so twice the lease before it covers every copy that could land after it.
        leased = s.hold and not strict
        window = 2 * config.lease_ms if leased else config.dedup_window_ms
        since = min(now, claimed.claimed_at_ms) - window
        ledger = s.dedup.ledger
        if isinstance(ledger, SparkDeltaLedger):
            result = ledger.commit_frame(
                rows,
                offered=offered,
                app_id=self.app_id,
                txn_version=self.batch_id,
                match_since_ms=since,
                match_after_version=None if strict else claimed.version,
            )
            if not result.replayed:
                return self._landed(result, rows, rows, offered, now)
            return self._replay(ledger, rows, offered, now, since)
        return self._commit_on_driver(claimed, rows, offered)

    def _replay(
        self, ledger: SparkDeltaLedger, rows: DataFrame, offered: int, now: int, since: int
    ) -> _Commit:
        """The batch's commit was made before (Spark replays a batch whose driver died
        after it): the keys the ledger holds are marked COMPLETED in Redis, and rows that
        succeed only now are committed under a txn of their own. On the executors, as
        the first commit, with the ledger as of the replay read for both halves.

        A replay may succeed for rows that failed the first time; those are not in the
        earlier commit, and marking them COMPLETED without a ledger row would lose them.
        """
        s = self.setup
        window = s.dedup.config.dedup_window_ms
        held, missing = ledger.split_held(rows, "key", since_ms=now - window)
        # -2 never moves a watermark: those keys were indexed with their own version.
        self._index(held, (), -2, now)
        late = missing.count()
        if not late:
            return _Commit(applied=offered, applied_keys=_sample(rows, ()), replayed=True)
        log.warning(
            "batch %d was committed before without %d key(s) that succeeded now; committing them",
            self.batch_id,
            late,
        )
        result = ledger.commit_frame(
            missing,
            offered=late,
            app_id=f"{self.app_id}:late:{now}",
            txn_version=self.batch_id,
            match_since_ms=since,
        )
        done = self._landed(result, missing, rows, offered, now)
        done.replayed = True
        return done

    def _landed(
        self, result: CommitResult, committed: DataFrame, rows: DataFrame, offered: int, now: int
    ) -> _Commit:
        """After a commit of ``committed`` from the executors (``rows``: the batch's, of
        which ``offered`` were offered): the keys the ledger held already are released,
        the others marked COMPLETED in Redis."""
        s = self.setup
        slipped = tuple(result.already_present)
        if slipped and s.hold:
            s.dedup.hot.release(group_by_bucket(slipped, s.dedup.config.buckets), self.owner)
        version = result.version if result.version is not None else -2
        self._index(committed, slipped, version, now)
        return _Commit(
            applied=offered - len(slipped),
            applied_keys=_sample(rows, slipped),
            slipped=len(slipped),
            version=result.version,
        )

    def _index(self, rows: DataFrame, slipped: Sequence[str], version: int, now: int) -> None:
        """Mark the committed keys COMPLETED in Redis from the executors, bucket by bucket."""
        from pyspark.sql import functions as F  # noqa: N812, PLC0415

        s = self.setup
        committed = rows.select(
            F.col("key").alias(KEY_COLUMN),
            F.col("bucket").alias(BUCKET_COLUMN),
            F.col("fingerprint").alias(FINGERPRINT_TEXT_COLUMN),
        )
        if slipped:
            committed = _among(committed, slipped, keep=False)
        # None: the scripts read Redis's clock (a test's clock is passed as it is).
        at = None if isinstance(s.clock, SystemClock) else now
        task = IndexTask(s.dedup.config, self.owner, version, now, at)
        done = index_committed(committed, task, s.dedup.hot)
        if done.fenced:
            log.warning(
                "%d key(s) were claimed by another owner when this one completed them, e.g. %r",
                len(done.fenced),
                done.fenced[0],
            )

    def _commit_on_driver(self, claimed: ClaimedBatch, rows: DataFrame, offered: int) -> _Commit:
        """The commit through :meth:`idem.dedup.Dedup.complete_rows` from the driver: the
        delta-rs engine's path.

        On a delta-rs ledger the executors stage the rows (a Delta sink's with its own
        columns, a function sink's done-records) as files the commit streams
        (:mod:`idem.spark.staging`); the driver reads back only the ledger columns it
        decides with. Another ledger gets those columns gathered as Arrow.
        """
        s = self.setup
        ledger = s.dedup.ledger
        staging: Staging | None = None
        if isinstance(ledger, DeltaLedger):
            staging = Staging(ledger.path, self.app_id, self.batch_id)
        try:
            return self._complete(claimed, rows, staging)
        finally:
            if staging is not None:
                staging.remove()

    def _complete(self, claimed: ClaimedBatch, rows: DataFrame, staging: Staging | None) -> _Commit:
        s = self.setup
        payload: StagedRows | None = None
        if staging is None:  # not a delta-rs ledger: the ledger columns come to the driver
            table = rows.select(*_DRIVER_COLUMNS).toArrow()
        else:  # the executors stage every column; the driver reads back the ledger's
            payload = staging.stage(rows, STAGED_COLUMNS)
            table = payload.keys
        claim = ClaimedRows(
            owner=self.owner,
            columns=table,
            ledger_version=claimed.version,
            held=s.hold,
            claimed_at_ms=claimed.claimed_at_ms,
        )
        result = s.dedup.complete_rows(
            claim, batch_id=self.batch_id, app_id=self.app_id, payload=payload, defer_index=True
        )
        keys = table.column("key")
        slipped = set(result.slipped)
        if slipped:
            gone = pa.array(sorted(slipped), pa.string())
            keys = keys.filter(pc.invert(pc.is_in(keys, value_set=gone)))
        return _Commit(
            applied=len(keys),
            applied_keys=tuple(keys.slice(0, APPLIED_KEYS_SHOWN).to_pylist()),
            slipped=len(slipped),
            version=result.version,
            replayed=result.replayed,
        )


_JOB_DESCRIPTION = "spark.job.description"
"""The local property Spark shows as a job's description (``setJobDescription``)."""

_DRIVER_COLUMNS = ("key", "fingerprint", "bucket", "msg_id", "origin_msg_id", "topic")
"""The ledger columns the driver's commit needs (the claim and the message ids)."""


def _sample(rows: DataFrame, slipped: Sequence[str]) -> tuple[str, ...]:
    """Up to :data:`APPLIED_KEYS_SHOWN` of the committed keys."""
    keys = rows.select("key")
    if slipped:
        keys = _among(keys, slipped, column="key", keep=False)
    return tuple(keys.limit(APPLIED_KEYS_SHOWN).toArrow().column(0).to_pylist())


def _among(
    frame: DataFrame, keys: Iterable[str], *, column: str = KEY_COLUMN, keep: bool
) -> DataFrame:
    """The rows of ``frame`` whose ``column`` is (``keep``) or is not among ``keys``.

    A join with the keys as a broadcast table: one Arrow transfer however many keys
    there are, where an ``isin`` list costs the driver a call per key and grows the plan.
    """
    from pyspark.sql import functions as F  # noqa: N812, PLC0415

    wanted = pa.table({column: pa.array(sorted(set(keys)), pa.string())})
    probe = frame.sparkSession.createDataFrame(wanted)
    return frame.join(F.broadcast(probe), column, "left_semi" if keep else "left_anti")
