"""The Delta retry journal: the log of truth of the resend path; Redis is rebuilt from it.

Every send-back (``SCHEDULED``), dead-letter (``DEAD``) and acknowledgement
(``ACKED``) is appended here — one commit per batch, with ``txnAppId`` /
``txnVersion`` when the caller has them — *before* it is applied to Redis. The
Redis side keeps a cursor: the next journal position (commit version, row) it
has applied, moved in the same Lua call as the effects. :meth:`RetryJournal.sync`
applies whatever the cursor has not seen, in journal order; a missing cursor
(``FLUSHALL``, a restart without persistence) means a rebuild: from the newest
base (:meth:`RetryJournal.compact`, :mod:`idem.retry.journal_base`) and the events
after it, or from version 0 when there is none. Losing Redis costs time, never a
message.

The table has Delta's change data feed enabled, so the rows of a range of
versions are read without scanning the table (``load_cdf``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import CommitProperties, Transaction

from idem.errors import ConfigError
from idem.retry.errors import JournalError
from idem.retry.faults import DEFAULT_FAULT_TOLERANCE, FaultTolerance
from idem.retry.journal_base import (
    BASE_OF,
    BASE_ROWS,
    HISTORY_WINDOWS,
    JournalBase,
    as_scheduled,
    base_rows,
    cursor_in_base,
    parse_base_cursor,
)
from idem.retry.journal_events import (
    JOURNAL_CONFIGURATION,
    JOURNAL_SCHEMA,
    START,
    JournalEvent,
    JournalEventType,
    JournalPosition,
    live_messages,
    plan,
)
from idem.retry.journal_history import settled_history
from idem.retry.store import APPLY_CHUNK, ApplyResult, Op, ScheduleStore

__all__ = [
    "JOURNAL_CONFIGURATION",
    "JOURNAL_SCHEMA",
    "START",
    "JournalBase",
    "JournalEvent",
    "JournalEventType",
    "JournalPosition",
    "RetryJournal",
    "live_messages",
    "plan",
]


SMALL_FILE_BYTES = 8 * 1024 * 1024
"""A journal file smaller than this is compacted (:meth:`RetryJournal.compact_files`) into
files of about this size; larger ones are left as they are."""
SMALL_FILES_TO_COMPACT = 64
"""Small files that make a compaction of the journal's files worth its rewrite."""

TXN_OF = "idem.journal.txn"
"""Commit-info key of a batch's commits: ``<app_id>@<txn_version>``."""
TXN_ROLE = "idem.journal.txn_role"
"""Commit-info key: ``batch`` (the commit with the txn) or ``late`` (what a replay added)."""


class RetryJournal:
    """The retry journal of one group at ``path`` (a Delta table, change data feed on)."""

    def __init__(
        self,
        path: str,
        group: str,
        *,
        storage_options: Mapping[str, str] | None = None,
        faults: FaultTolerance = DEFAULT_FAULT_TOLERANCE,
    ) -> None:
        self.path = path
        self.group = group
        self.storage_options = dict(storage_options) if storage_options else None
        self.faults = faults
        self._name = f"retry journal of {group}"
        self._table: DeltaTable | None = None
        self._lock = threading.RLock()

    # -- writing -------------------------------------------------------------------------

    def append(
        self,
        events: Sequence[JournalEvent],
        *,
        app_id: str | None = None,
        txn_version: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> int | None:
        """Append ``events`` as one commit and return its version (see :meth:`append_batch`).

        ``None`` when there is nothing to append: a replayed ``(app_id, txn_version)``
        whose events are all committed, or no events (``metadata``, the commit info of
        a base, makes even an empty commit).
        """
        return self.append_batch(
            events, app_id=app_id, txn_version=txn_version, metadata=metadata
        ).version

    def append_batch(
        self,
        events: Sequence[JournalEvent],
        *,
        app_id: str | None = None,
        txn_version: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Appended:
        """Append ``events`` as one commit; return its version and the events it holds.

        With ``app_id`` and ``txn_version`` a batch is journaled once: when that txn
        is already committed (Spark replays a batch), only the events its commits
        lack are appended, in a commit of their own. A replay need not fail the same
        rows as the first attempt did (a transient sink error), and a row that fails
        only in the replay must still be journaled; the rows both attempts sent back
        are not appended again (their messages may be consumed and acked by now).
        """
        if not events and metadata is None:
            return Appended(None, ())
        once = app_id is not None and txn_version is not None
        tag = f"{app_id}@{txn_version}"

        def write() -> Appended:
            with self._lock:
                written: Sequence[JournalEvent] = events
                props = None
                if app_id is not None and txn_version is not None:
                    role = "batch"
                    if self.committed(app_id, txn_version):
                        done = self._batch_events(app_id, txn_version)
                        written = [e for e in events if (str(e.event), e.msg_id) not in done]
                        if not written:
                            return Appended(None, ())
                        role = "late"
                        props = CommitProperties(custom_metadata={TXN_OF: tag, TXN_ROLE: role})
                    else:
                        props = CommitProperties(
                            app_transactions=[Transaction(app_id=app_id, version=txn_version)],
                            custom_metadata={TXN_OF: tag, TXN_ROLE: role},
                        )
                elif metadata is not None:
                    props = CommitProperties(custom_metadata=dict(metadata))
                data = self._rows(written, app_id if once else None, txn_version)
                table = self._load() or self._create()
                # writing through the table object leaves it at exactly our commit's version
                write_deltalake(table, data, mode="append", commit_properties=props)
                return Appended(table.version(), tuple(written))

        return self.faults.delta(
            write, what=f"retry journal append to {self.path}", wrap=JournalError
        )

    def _rows(
        self, events: Sequence[JournalEvent], app_id: str | None, txn_version: int | None
    ) -> pa.Table:
        rows = [
            {
                "group": self.group,
                "seq": seq,
                "event": str(e.event),
                "msg_id": e.msg_id,
                "origin_msg_id": e.origin_msg_id,
                "key": e.key,
                "reconsume_times": e.reconsume_times,
                "delay_level": e.delay_level,
                "queue_id": e.queue_id,
                "due_ms": e.due_ms,
                "replaces": e.replaces,
                "wire": e.wire,
                "at_ms": e.at_ms,
                "app_id": app_id,
                "txn_version": txn_version,
            }
            for seq, e in enumerate(events)
        ]
        return pa.Table.from_pylist(rows, schema=JOURNAL_SCHEMA)

    def _batch_events(self, app_id: str, txn_version: int) -> set[tuple[str, str]]:
        """``(event, msg_id)`` of every event committed for ``(app_id, txn_version)``.

        Its commits are found by their commit info (newest first, looking back further
        each time, until the batch's first commit); a journal written before commits
        carried that info is read whole instead.
        """
        table = self._load()
        assert table is not None  # the txn is committed, so the table exists
        tag = f"{app_id}@{txn_version}"
        for window in HISTORY_WINDOWS:
            history = settled_history(table, window)
            mine = [info for info in history if info.get(TXN_OF) == tag]
            if any(info.get(TXN_ROLE) == "batch" for info in mine):
                done: set[tuple[str, str]] = set()
                for info in mine:
                    version = int(info["version"])
                    done |= _pairs(table.load_cdf(starting_version=version, ending_version=version))
                return done
            if window is None or len(history) < window:
                break
        rows = pa.table(table.load_cdf(starting_version=0))
        return {
            (r["event"], r["msg_id"])
            for r in rows.select(
                ["event", "msg_id", "app_id", "txn_version", "_change_type"]
            ).to_pylist()
            if r["app_id"] == app_id
            and r["txn_version"] == txn_version
            and r["_change_type"] == "insert"
        }

    def _create(self) -> DeltaTable:
        DeltaTable.create(
            self.path,
            schema=JOURNAL_SCHEMA,
            mode="ignore",  # another writer may have created it a moment ago
            name=self._name,
            configuration=JOURNAL_CONFIGURATION,
            storage_options=self.storage_options,
        )
        table = self._load()
        assert table is not None
        return table

    # -- reading -------------------------------------------------------------------------

    def _load(self) -> DeltaTable | None:
        if self._table is None:
            if not DeltaTable.is_deltatable(self.path, storage_options=self.storage_options):
                return None
            table = DeltaTable(self.path, storage_options=self.storage_options)
            name = table.metadata().name
            if name and name != self._name:
                raise ConfigError(
                    f"journal_path: the table at {self.path} is {name!r}, not the retry "
                    f"journal of group {self.group!r}; give each group its own journal"
                )
            self._table = table
        else:
            self._table.update_incremental()
        return self._table

    def committed(self, app_id: str, txn_version: int) -> bool:
        """Whether a commit with ``(app_id, >= txn_version)`` is in the journal."""
        with self._lock:
            table = self._load()
            done = None if table is None else table.transaction_version(app_id)
            return done is not None and done >= txn_version

    def latest_version(self) -> int | None:
        """The newest commit version (``None``: no journal yet)."""
        with self._lock:
            table = self._load()
            return None if table is None else table.version()

    def read_since(
        self, position: JournalPosition, *, until: int | None = None
    ) -> tuple[list[tuple[JournalPosition, JournalEvent]], JournalPosition]:
        """Events at or after ``position`` (up to version ``until``) in journal order, and
        the position after them. ``BASE`` rows are left out: they restate, never change."""

        def read() -> tuple[list[tuple[JournalPosition, JournalEvent]], JournalPosition]:
            with self._lock:
                table = self._load()
                if table is None:
                    return [], position
                latest = table.version() if until is None else min(until, table.version())
                if position.version > latest:
                    return [], position
                reader = table.load_cdf(starting_version=position.version, ending_version=latest)
                rows = [
                    r for r in pa.table(reader).to_pylist() if r["event"] != JournalEventType.BASE
                ]
            events = sorted(
                (
                    (
                        JournalPosition(int(r["_commit_version"]), int(r["seq"])),
                        JournalEvent.from_row(r),
                    )
                    for r in rows
                    if r["_change_type"] == "insert"
                ),
                key=lambda item: item[0],
            )
            return [e for e in events if e[0] >= position], JournalPosition(latest + 1, 0)

        return self.faults.delta(read, what=f"retry journal read of {self.path}", wrap=JournalError)

    def events(self) -> list[JournalEvent]:
        """Every event, in journal order."""
        return [event for _pos, event in self.read_since(START)[0]]

    def live(self) -> dict[str, JournalEvent]:
        """Msg id -> scheduling event of every message the journal holds live (scheduled or
        in the retry topic, neither acknowledged nor dead): the newest base and the events
        after it, or every event when there is no base."""
        base = self.read_base()
        if base is None:
            return live_messages(self.events())
        tail, _ = self.read_since(base.resumes_at)
        return live_messages([as_scheduled(e) for e in base.live] + [e for _pos, e in tail])

    # -- bringing Redis up to date -------------------------------------------------------

    def sync(
        self,
        store: ScheduleStore,
        *,
        own: tuple[int, Sequence[JournalEvent]] | None = None,
        followed: bool = False,
    ) -> ApplyResult:
        """Apply to ``store`` every event its cursor has not seen, in journal order.

        Safe with several callers at once: each slice is applied by whoever moves the
        cursor first; the others see the cursor moved and read on from there. ``own``
        is ``(version, events)`` of the commit the caller just made, every event it holds
        (:meth:`Appended.as_own`): when the cursor stands right before it, those events
        are applied without reading the commit back.
        ``followed``: the caller has just checked that Redis follows this journal
        (:meth:`follow`), so that round trip is not made again.
        """
        if not followed:
            self.follow(store)
        return self._sync(store, own)

    def _sync(
        self, store: ScheduleStore, own: tuple[int, Sequence[JournalEvent]] | None
    ) -> ApplyResult:
        total = ApplyResult()
        while True:
            raw = store.cursor()
            named = parse_base_cursor(raw)
            if raw is None or named is not None:
                # A rebuild: from the newest base, not from version 0. One already under
                # way finishes the base it began (a newer base restates it *after* events
                # that removed some of the rows applied so far: a switch would keep them).
                base = self.read_base(named[0] if named is not None else None)
                if base is None and named is not None:
                    store.purge()  # that base is gone from the log: start the rebuild over
                    continue
                if base is not None:
                    applied = self._apply_base(store, raw, base)
                    total += applied or ApplyResult()
                    continue  # the cursor stands after the base now (or someone moved it)
            start = JournalPosition.parse(raw) or START
            if own is not None and raw is not None and start == JournalPosition(own[0], 0):
                events = [(JournalPosition(own[0], seq), e) for seq, e in enumerate(own[1])]
                end = JournalPosition(own[0] + 1, 0)
            else:
                events, end = self.read_since(start)
                if not events and raw is not None and start >= end:
                    return total
            own = None
            steps = plan(events)
            expect: str | None = raw
            conflict = False
            chunk: list[Op] = []
            for index in range(len(events) + 1):
                at_end = index == len(events)
                if not at_end:
                    chunk += steps[index]
                if at_end or (len(chunk) >= APPLY_CHUNK and index + 1 < len(events)):
                    new = str(end if at_end else events[index + 1][0])
                    result = store.apply(chunk, expect=expect, new=new)
                    if isinstance(result, str):
                        conflict = True
                        break
                    total += result
                    expect, chunk = new, []
            if not conflict:
                return total

    def _apply_base(
        self, store: ScheduleStore, raw: str | None, base: JournalBase
    ) -> ApplyResult | None:
        """Schedule the base's live messages, resuming at the row a ``base:`` cursor names;
        ``None`` when another caller moved the cursor first.

        A message that an event after the base removes again is not scheduled: a
        consumer could otherwise get it before that removal is applied.
        """
        parsed = parse_base_cursor(raw)
        row = parsed[1] if parsed is not None and parsed[0] == base.version else 0
        later, _ = self.read_since(base.resumes_at)
        # (the cursor counts the base's rows: the same however many events come after it)
        rows = [as_scheduled(e) for e in base.live]
        after = live_messages(rows + [e for _pos, e in later])
        total = ApplyResult()
        expect = raw
        while True:
            chunk = rows[row : row + APPLY_CHUNK]
            row += len(chunk)
            done = row >= len(rows)
            new = str(base.resumes_at) if done else cursor_in_base(base.version, row)
            # the rows still live after the events since, as they stand in the base
            ops = [op for e in chunk if after.get(e.msg_id) is e for op in e.ops()]
            result = store.apply(ops, expect=expect, new=new)
            if isinstance(result, str):
                return None
            total += result
            if done:
                return total
            expect = new

    def read_base(self, version: int | None = None) -> JournalBase | None:
        """The newest base (:meth:`compact`), or the base committed at ``version``;
        ``None`` when there is none (or that one is gone from the log)."""

        def read() -> JournalBase | None:
            with self._lock:
                table = self._load()
                if table is None:
                    return None
                info = _newest_base_commit(table, version)
                if info is None:
                    return None
                found = int(info["version"])
                reader = table.load_cdf(starting_version=found, ending_version=found)
                rows = [
                    r
                    for r in pa.table(reader).to_pylist()
                    if r["_change_type"] == "insert" and r["event"] == JournalEventType.BASE
                ]
            expected = info.get(BASE_ROWS)
            if expected is not None and int(expected) != len(rows):
                # never rebuild from a base read short: its missing messages would be skipped
                raise JournalError(
                    f"retry journal {self.path}: base at version {found} holds {expected} "
                    f"row(s), {len(rows)} read back"
                )
            rows.sort(key=lambda r: int(r["seq"]))
            live = tuple(JournalEvent.from_row(r) for r in rows)
            return JournalBase(version=found, covers=int(info[BASE_OF]), live=live)

        return self.faults.delta(
            read, what=f"retry journal base read of {self.path}", wrap=JournalError
        )

    def small_files(self) -> int:
        """How many of the table's files are below :data:`SMALL_FILE_BYTES`."""

        def count() -> int:
            with self._lock:
                table = self._load()
                if table is None:
                    return 0
                sizes = table.get_add_actions(flatten=True).column("size_bytes")
                return sum(1 for size in sizes.to_pylist() if size < SMALL_FILE_BYTES)

        return self.faults.delta(
            count, what=f"retry journal files of {self.path}", wrap=JournalError
        )

    def compact_files(self) -> int:
        """Rewrite the small files into files of about :data:`SMALL_FILE_BYTES` (Delta
        ``OPTIMIZE``); returns the files replaced.

        The rows, the versions their events were committed at, time travel and the change
        data feed are unchanged: the compaction's commit changes no data. Appends of this
        and other processes go on meanwhile.
        """

        def run() -> int:
            table = DeltaTable(self.path, storage_options=self.storage_options)
            metrics = table.optimize.compact(target_size=SMALL_FILE_BYTES)
            return int(metrics["numFilesRemoved"])

        return self.faults.delta(
            run, what=f"retry journal file compaction of {self.path}", wrap=JournalError
        )

    def compact(self, *, now_ms: int, until: int | None = None) -> JournalBase | None:
        """Append a base: every message live as of version ``until`` (default: the newest).

        From then on a rebuild reads the base and the versions after ``until`` only.
        Reads the previous base and what followed it (or everything, the first time).
        ``None`` when there is no journal yet. Old rows stay (Delta time travel and
        ``events()`` still see them); only the rebuild stops reading them.
        """
        latest = self.latest_version()
        if latest is None:
            return None
        covers = latest if until is None else min(until, latest)
        previous = self.read_base()
        if previous is not None and previous.covers <= covers:
            since = [as_scheduled(e) for e in previous.live]
            tail, _ = self.read_since(previous.resumes_at, until=covers)
            events = since + [e for _pos, e in tail]
        else:
            events = [e for _pos, e in self.read_since(START, until=covers)[0]]
        rows = base_rows(list(live_messages(events).values()), now_ms)
        version = self.append(rows, metadata={BASE_OF: str(covers), BASE_ROWS: str(len(rows))})
        assert version is not None  # a base commit is written even when nothing is live
        return JournalBase(version=version, covers=covers, live=tuple(rows))

    def follow(self, store: ScheduleStore) -> bool:
        """Refuse a Redis whose cursor belongs to another journal table (this journal was
        re-created, moved without its log, or restored from elsewhere): its positions mean
        nothing here, and events before it would be skipped for good. Returns whether
        Redis is bound to this table now (``False``: there is no journal yet)."""
        with self._lock:
            table = self._table if self._table is not None else self._load()  # ids never change
            journal_id = None if table is None else str(table.metadata().id)
        if journal_id is None:
            return False
        followed = store.follow(journal_id)
        if followed is not None:
            raise JournalError(
                f"retry journal {self.path}: Redis follows another journal table "
                f"({followed}, this one is {journal_id}); its cursor does not apply here. "
                f"Rebuild Redis from this journal: idem retry rebuild --group {self.group}"
            )
        return True

    def rebuild(self, store: ScheduleStore) -> ApplyResult:
        """Rebuild the group's Redis side from the journal alone (cleared first: applying a
        base over what Redis holds would keep messages removed before the base)."""
        store.purge()
        return self.sync(store)


class Appended(NamedTuple):
    """What :meth:`RetryJournal.append_batch` committed: the version and its events."""

    version: int | None
    events: tuple[JournalEvent, ...]

    def as_own(self) -> tuple[int, tuple[JournalEvent, ...]]:
        """``(version, events)`` as :meth:`RetryJournal.sync` takes its ``own``: the events
        are the whole commit's, so a sync that applies them without reading the commit
        back skips none of it."""
        assert self.version is not None, "nothing was committed"
        return self.version, self.events


def _pairs(reader: Any) -> set[tuple[str, str]]:
    """``(event, msg_id)`` of the rows a change-data-feed read inserted."""
    rows = pa.table(reader).select(["event", "msg_id", "_change_type"]).to_pylist()
    return {(r["event"], r["msg_id"]) for r in rows if r["_change_type"] == "insert"}


def _newest_base_commit(table: DeltaTable, version: int | None = None) -> dict[str, str] | None:
    """``version``, ``BASE_OF`` and (when recorded) ``BASE_ROWS`` of the newest base commit
    (or of the one at ``version``), looking back through more history each time."""
    for window in HISTORY_WINDOWS:
        history = settled_history(table, window)
        for info in history:  # newest first
            if BASE_OF in info and (version is None or int(info["version"]) == version):
                found = {"version": str(info["version"]), BASE_OF: str(info[BASE_OF])}
                if BASE_ROWS in info:
                    found[BASE_ROWS] = str(info[BASE_ROWS])
                return found
        if window is None or len(history) < window:
            return None
    return None
