"""The ledger contract on real Delta tables, for both engines.

delta-rs runs in the test process; delta-spark runs in the shared local Spark
session with Delta's jars (the ``spark`` fixture). Tests of what only one
engine has (delta-rs' checked append, its log-cleanup handling) take that
engine directly.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, QueryBuilder, write_deltalake

from idem.cli import main as cli_main
from idem.clock import SYSTEM_CLOCK, ManualClock
from idem.config import IdemConfig
from idem.errors import ConfigError, LedgerError
from idem.keys import bucket_of
from idem.ledger import (
    LEDGER_SCHEMA,
    DeltaLedger,
    Ledger,
    _files,
    conform,
    deltars,
    make_rows,
    open_ledger,
)
from idem.ledger._log import LOG_DIR, LocalLogStore, ObjectLogStore, commit_name, parse_commit
from idem.ledger.schema import LedgerIdentity, date_of_ms
from idem.ledger.staged import StagedRows, parquet_opener

pytestmark = pytest.mark.integration

BUCKETS = 4
MINUTE_MS = 60_000
DAY_MS = 86_400_000
LEASE_MS = 5 * MINUTE_MS
START_MS = 1_700_049_600_000  # 2023-11-15 12:00:00 UTC

MakeLedger = Callable[..., Ledger]


@pytest.fixture
def clock() -> ManualClock:
    """Noon UTC, so a few hours either way stay on the same date."""
    return ManualClock(START_MS)


@pytest.fixture(params=["deltars", "spark"])
def make_ledger(request: pytest.FixtureRequest, tmp_path: Path, clock: ManualClock) -> MakeLedger:
    """A factory of ledgers on one table path (more than one = several writers)."""
    path = str(tmp_path / "ledger")
    if request.param == "spark":
        session = request.getfixturevalue("spark")
        from idem.ledger.spark_engine import SparkDeltaLedger

        def make_spark(**options: Any) -> Ledger:
            return SparkDeltaLedger(session, path, clock=clock, **options)

        return make_spark

    def make_deltars(**options: Any) -> Ledger:
        return DeltaLedger(path, clock=clock, **options)

    return make_deltars


def rows_for(
    keys: Sequence[str], clock: ManualClock, *, fingerprint: str = "fp", **columns: Any
) -> pa.Table:
    """Rows for ``keys`` completed now on ``clock``."""
    table = make_rows(
        group="orders",
        keys=keys,
        buckets=[bucket_of(k, BUCKETS) for k in keys],
        fingerprints=[f"{fingerprint}-{k}" for k in keys],
        columns=columns or None,
    )
    return conform(table, now_ms=clock.now_ms())


def commit(
    ledger: Ledger,
    keys: Sequence[str],
    clock: ManualClock,
    *,
    app: str = "app",
    txn: int = 0,
    after: int | None = None,
) -> Any:
    """Commit ``keys`` matching the lease horizon; with ``after``, as index mode does (the
    claim's Redis index had the versions up to it: a checked append)."""
    return ledger.commit(
        rows_for(keys, clock),
        app_id=app,
        txn_version=txn,
        match_since_ms=clock.now_ms() - LEASE_MS,
        match_after_version=after,
    )


def ledger_keys(ledger: Ledger) -> list[str]:
    """Every key in the ledger (with repeats), sorted."""
    return sorted(ledger.window(0).keys.column("key").to_pylist())


def test_a_missing_table_has_version_minus_one_and_nothing_in_it(make_ledger: MakeLedger) -> None:
    ledger = make_ledger()
    assert ledger.version() == -1
    assert ledger.window(0).version == -1
    assert ledger.existing(["A"], since_ms=None) == {}
    assert ledger.audit() == []


def test_a_replayed_batch_commits_nothing(make_ledger: MakeLedger, clock: ManualClock) -> None:
    ledger = make_ledger()
    first = commit(ledger, ["A", "B", "C"], clock, txn=7)
    assert (first.inserted, first.replayed, first.already_present) == (3, False, [])
    assert ledger.version() == first.version

    again = commit(ledger, ["A", "B", "C", "D"], clock, txn=7)  # Spark replays batch 7
    older = commit(ledger, ["E"], clock, txn=6)
    assert again.replayed
    assert older.replayed
    assert again.version is None
    assert again.inserted == 0
    assert ledger.version() == first.version
    assert ledger_keys(ledger) == ["A", "B", "C"]


def test_keys_already_in_the_window_are_reported_not_inserted(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    ledger = make_ledger()
    commit(ledger, ["A", "B"], clock, app="owner-1")
    clock.advance(60)
    second = commit(ledger, ["B", "C"], clock, app="owner-2")  # B slipped past Redis
    assert second.inserted == 1
    assert second.already_present == ["B"]
    everything_twice = commit(ledger, ["A", "C"], clock, app="owner-3")
    assert everything_twice.inserted == 0
    assert sorted(everything_twice.already_present) == ["A", "C"]
    # ... and that batch's txn is still recorded: its replay is recognised.
    assert commit(ledger, ["A", "C"], clock, app="owner-3").replayed
    assert ledger_keys(ledger) == ["A", "B", "C"]
    assert ledger.audit() == []


def test_outside_the_match_window_a_key_is_inserted_again_and_audit_finds_it(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    ledger = make_ledger(dedup_window_ms=7 * DAY_MS)
    commit(ledger, ["A", "B"], clock, app="a")
    clock.advance(3600)  # an hour later: far outside a 5-minute lease horizon
    late = commit(ledger, ["A"], clock, app="b")
    assert late.inserted == 1  # index mode trusts Redis for anything older
    assert ledger.audit() == [("A", 2)]
    strict = ledger.commit(rows_for(["B"], clock), app_id="c", txn_version=0, match_since_ms=None)
    assert strict.already_present == ["B"]  # strict mode matches the whole window


def test_the_first_commit_creates_the_table_as_version_zero(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    ledger = make_ledger()
    first = commit(ledger, ["A"], clock)
    assert first.version == ledger.version() == 0  # no data-less version for an index to skip
    changed = ledger.keys_added_since(-1)
    assert changed is not None
    assert changed.keys.column("key").to_pylist() == ["A"]


def test_in_batch_repeats_are_kept_once(make_ledger: MakeLedger, clock: ManualClock) -> None:
    ledger = make_ledger()
    result = commit(ledger, ["A", "B", "A"], clock)
    assert result.inserted == 2
    assert ledger_keys(ledger) == ["A", "B"]


def race(fn: Callable[[int], Any], n: int = 2) -> list[Any]:
    """Run ``fn(0) .. fn(n - 1)`` in threads released at once; their results, in order.

    An exception in any thread fails the test (a thread cannot raise into pytest).
    """
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(w: int) -> None:
        try:
            barrier.wait()
            results[w] = fn(w)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


def test_concurrent_commits_from_two_threads_both_land(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    make_ledger().commit(rows_for(["seed"], clock), app_id="s", txn_version=0, match_since_ms=0)
    writers = [make_ledger(), make_ledger()]  # two handles, like two driver processes
    batches = [[f"K{w}-{i}" for i in range(200)] for w in range(2)]
    shared = [f"S{i}" for i in range(100)]  # both claim these (a failover hole)
    results = race(lambda w: commit(writers[w], batches[w] + shared, clock, app=f"w{w}", txn=1))
    assert sum(r.inserted for r in results) == 400 + 100
    assert sorted(results[0].already_present + results[1].already_present) == sorted(shared)
    assert ledger_keys(writers[0]) == sorted(["seed", *batches[0], *batches[1], *shared])
    assert writers[0].audit() == []


def test_two_writers_creating_the_ledger_at_once_insert_each_key_once(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    writers = [make_ledger(), make_ledger()]
    shared = [f"S{i}" for i in range(50)]
    results = race(
        lambda w: commit(writers[w], [f"W{w}-{i}" for i in range(50)] + shared, clock, app=f"w{w}")
    )
    assert sorted(r.version for r in results) == [0, 1]
    assert sorted(results[0].already_present + results[1].already_present) == sorted(shared)
    assert writers[0].audit() == []
    assert len(ledger_keys(writers[0])) == 150


def test_an_index_mode_commit_checks_only_the_versions_after_its_claim(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    ledger = make_ledger()
    v0 = commit(ledger, ["A", "B"], clock, app="first").version
    clock.advance(10)
    v1 = commit(ledger, ["C"], clock, app="second").version

    # Claimed when Redis indexed v0 only: C, committed later by someone else, is caught.
    late = commit(ledger, ["C", "D"], clock, after=v0, app="late")
    assert (late.inserted, late.already_present) == (1, ["C"])
    assert late.version == v1 + 1
    # The txn makes a retry of that very commit a replay that adds nothing.
    assert commit(ledger, ["C", "D"], clock, after=v0, app="late").replayed
    # Versions the claim covered are Redis's to answer (it said "new"): not read again,
    # which is what keeps the commit's cost off the size of the recent window.
    covered = commit(ledger, ["E"], clock, after=late.version, app="next")
    assert (covered.inserted, covered.already_present) == (1, [])
    assert ledger_keys(ledger) == ["A", "B", "C", "D", "E"]


def test_index_mode_commits_racing_for_the_same_keys_insert_each_once(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    """Two writers whose claims both said "new" (a Redis failover hole), many rounds."""
    writers = [make_ledger(), make_ledger()]
    commit(writers[0], ["seed"], clock, app="seed")
    results: list[Any] = []
    for round_ in range(6):
        after = writers[0].version()  # both claims saw the ledger at this version
        shared = [f"S{round_}-{i}" for i in range(50)]

        def write(w: int, shared: list[str] = shared, after: int = after, r: int = round_) -> Any:
            own = [f"W{w}-{r}-{i}" for i in range(50)]
            return commit(writers[w], own + shared, clock, after=after, app=f"w{w}", txn=r)

        results += race(write)
    assert sum(r.inserted for r in results) == 6 * (100 + 50)
    assert sum(len(r.already_present) for r in results) == 6 * 50
    keys = ledger_keys(writers[0])
    assert len(keys) == len(set(keys)) == 1 + 6 * 150
    assert writers[0].audit() == []


def test_an_index_mode_commit_merges_when_the_versions_to_check_are_cleaned(
    make_ledger: MakeLedger, tmp_path: Path, clock: ManualClock
) -> None:
    path = tmp_path / "ledger"
    ledger = make_ledger()
    for txn in range(4):  # versions 0..3
        commit(ledger, [f"K{txn}"], clock, txn=txn)
    DeltaTable(str(path)).create_checkpoint()
    for version in range(2):
        (path / commit_name(version)).unlink()

    fresh = make_ledger()
    # Version 1 (K1) is gone from the log: the commit falls back to the MERGE on the
    # rows completed within the lease horizon, which still finds K1 and K3.
    result = commit(fresh, ["K1", "K3", "NEW"], clock, after=0, app="late")
    assert (result.inserted, sorted(result.already_present)) == (1, ["K1", "K3"])
    assert ledger_keys(fresh) == ["K0", "K1", "K2", "K3", "NEW"]


def test_a_commit_reports_its_own_version_even_when_another_writer_follows_at_once(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The version a commit reports moves Redis's watermark: naming a later writer's
    version would tell Redis it indexed keys it never saw. Two cases write through
    write_deltalake: creating the table, and the empty append that records a txn whose
    MERGE inserted nothing."""
    path = str(tmp_path / "ledger")
    ours, theirs = DeltaLedger(path, clock=clock), DeltaLedger(path, clock=clock)
    real = deltars.write_deltalake

    def then_another_writer(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        monkeypatch.setattr(deltars, "write_deltalake", real)
        commit(theirs, [f"THEIRS{theirs.version()}"], clock, app="theirs", txn=theirs.version())

    monkeypatch.setattr(deltars, "write_deltalake", then_another_writer)
    created = commit(ours, ["A"], clock, app="ours", txn=0)
    assert (created.version, ours.version()) == (0, 1)
    monkeypatch.setattr(deltars, "write_deltalake", then_another_writer)
    again = ours.commit(
        rows_for(["A"], clock), app_id="ours", txn_version=1, match_since_ms=None
    )  # strict mode: the MERGE finds A and inserts nothing; an empty append records txn 1
    assert (again.inserted, again.version, ours.version()) == (0, 2, 3)


def test_a_writer_that_slept_through_a_log_cleanup_still_checks_what_it_missed(
    tmp_path: Path, clock: ManualClock
) -> None:
    """An idle process remembers version 0; others commit, checkpoint and clean the log.
    Its version must not stay stuck at 0, and its checked append must not skip the
    versions it can no longer read (K1 is already in the ledger)."""
    path = tmp_path / "ledger"
    idle = DeltaLedger(str(path), clock=clock)
    commit(idle, ["K0"], clock, txn=0)
    assert idle.version() == 0
    busy = DeltaLedger(str(path), clock=clock)
    for txn in range(1, 4):  # versions 1..3
        commit(busy, [f"K{txn}"], clock, app="busy", txn=txn)
    DeltaTable(str(path)).create_checkpoint()
    for version in range(3):
        (path / commit_name(version)).unlink()
    clock.advance(deltars.REVERIFY_AFTER_MS / 1000 + 1)
    assert idle.version() == 3
    result = commit(idle, ["K1", "NEW"], clock, txn=1, after=0)
    assert (result.inserted, result.already_present) == (1, ["K1"])
    assert ledger_keys(idle) == ["K0", "K1", "K2", "K3", "NEW"]


def test_keys_added_since_reads_exactly_the_later_versions(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    ledger = make_ledger()
    v1 = commit(ledger, ["A", "B"], clock, txn=1).version
    clock.advance(10)
    commit(ledger, ["C"], clock, txn=2)
    clock.advance(10)
    v3 = commit(ledger, ["D", "E", "A"], clock, txn=3).version  # A is a slipped duplicate

    changed = ledger.keys_added_since(v1)
    assert changed is not None
    assert changed.version == v3
    rows = sorted(changed.keys.to_pylist(), key=lambda r: r["key"])
    assert [r["key"] for r in rows] == ["C", "D", "E"]
    assert {r["bucket"] for r in rows} <= set(range(BUCKETS))
    assert all(r["bucket"] == bucket_of(r["key"], BUCKETS) for r in rows)
    assert rows[0]["fingerprint"] == "fp-C"
    assert rows[0]["completed_at_ms"] == START_MS + 10_000

    nothing = ledger.keys_added_since(v3)
    assert nothing is not None
    assert (nothing.keys.num_rows, nothing.version) == (0, v3)
    everything = ledger.keys_added_since(-1)
    assert everything is not None
    assert everything.keys.num_rows == 5


def test_keys_added_since_reads_each_file_once_and_never_its_own_appends(
    tmp_path: Path, clock: ManualClock
) -> None:
    """Two writers on one ledger: each one's checks read the other's files once."""
    path = str(tmp_path / "ledger")
    mine, theirs = DeltaLedger(path, clock=clock), DeltaLedger(path, clock=clock)
    start = commit(theirs, ["seed"], clock, app="seed").version
    own = commit(mine, ["M1", "M2", "M3"], clock, after=start, app="mine")
    foreign = commit(theirs, ["T1", "T2"], clock, after=own.version, app="theirs")

    first = mine.keys_added_since(start)
    assert first is not None
    assert sorted(first.keys.column("key").to_pylist()) == ["M1", "M2", "M3", "T1", "T2"]
    their_files = {bucket_of(k, BUCKETS) for k in ("T1", "T2")}
    assert first.files_read == len(their_files)  # its own append came from memory
    again = mine.keys_added_since(start)
    assert again is not None
    assert again.files_read == 0
    assert again.keys.sort_by("key").equals(first.keys.sort_by("key"))
    # A reader that wrote nothing reads every file, and finds the same keys.
    cold = DeltaLedger(path, clock=clock).keys_added_since(start)
    assert cold is not None
    assert cold.version == foreign.version
    assert cold.keys.sort_by("key").equals(first.keys.sort_by("key"))
    assert cold.files_read == len({bucket_of(k, BUCKETS) for k in ("M1", "M2", "M3")}) + len(
        their_files
    )


def test_keys_added_since_follows_a_later_delete_of_remembered_rows(
    tmp_path: Path, clock: ManualClock
) -> None:
    """Rows this writer appended and another process deleted are not reported."""
    path = tmp_path / "ledger"
    ledger = DeltaLedger(str(path), clock=clock)
    start = commit(ledger, ["seed"], clock, app="seed").version
    commit(ledger, ["gone", "kept"], clock, after=start, app="mine")
    DeltaTable(str(path)).delete("key = 'gone'")  # e.g. an operator's DELETE

    changed = ledger.keys_added_since(start)
    assert changed is not None
    assert changed.keys.column("key").to_pylist() == ["kept"]


def test_keys_added_since_does_not_repeat_keys_a_compaction_rewrote(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    ledger = make_ledger()
    for txn in range(3):
        commit(ledger, [f"K{txn}-{i}" for i in range(5)], clock, txn=txn)
    before = ledger.version()
    clock.advance(DAY_MS / 1000)  # the next day: yesterday's files may be compacted
    compacted = ledger.compact()
    assert compacted.files_removed > compacted.files_added > 0
    commit(ledger, ["new"], clock, txn=9)
    changed = ledger.keys_added_since(before)
    assert changed is not None
    assert changed.keys.column("key").to_pylist() == ["new"]
    assert ledger.audit() == []
    assert len(ledger_keys(ledger)) == 16


def test_keys_added_since_says_when_the_log_was_cleaned(tmp_path: Path, clock: ManualClock) -> None:
    path = tmp_path / "ledger"
    ledger = DeltaLedger(str(path), clock=clock)
    for txn in range(4):  # versions 0..3
        commit(ledger, [f"K{txn}"], clock, txn=txn)
    DeltaTable(str(path)).create_checkpoint()
    for version in range(2):  # what log cleanup removes once a checkpoint covers it
        (path / commit_name(version)).unlink()

    fresh = DeltaLedger(str(path), clock=clock)  # a new process: no remembered version
    assert fresh.version() == 3
    assert fresh.keys_added_since(0) is None  # the caller must rebuild from the window
    changed = fresh.keys_added_since(2)
    assert changed is not None
    assert changed.keys.column("key").to_pylist() == ["K3"]
    assert sorted(fresh.window(0).keys.column("key").to_pylist()) == ["K0", "K1", "K2", "K3"]


def test_window_reads_only_the_requested_days_and_buckets(
    make_ledger: MakeLedger, clock: ManualClock, tmp_path: Path
) -> None:
    ledger = make_ledger()
    keys = [f"K{i}" for i in range(40)]
    for day, txn in ((0, 0), (1, 1), (2, 2)):
        commit(ledger, [f"{k}@{day}" for k in keys], clock, txn=txn)
        clock.advance(DAY_MS / 1000)
    since = START_MS + DAY_MS  # day 1 onwards
    wanted = [0, 2]
    # Remove what the window must not touch: if it read it, it would fail.
    root = tmp_path / "ledger"
    for data_file in root.rglob("*.parquet"):
        parts = dict(p.split("=", 1) for p in data_file.parent.relative_to(root).parts)
        if parts["completed_date"] == "2023-11-15" or int(parts["bucket"]) not in wanted:
            data_file.unlink()

    window = ledger.window(since, wanted)
    assert window.version == ledger.version()
    got = window.keys.to_pylist()
    expected = sorted(
        f"{k}@{day}" for day in (1, 2) for k in keys if bucket_of(f"{k}@{day}", BUCKETS) in wanted
    )
    assert sorted(r["key"] for r in got) == expected
    assert all(r["completed_at_ms"] >= since for r in got)


def test_existing_and_lookup_results_answer_for_many_keys(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    ledger = make_ledger()
    keys = [f"ORDER_{i}" for i in range(3000)]
    results = [f'{{"n": {i}}}' if i % 2 else None for i in range(3000)]
    ledger.commit(
        rows_for(keys, clock, result=results), app_id="a", txn_version=0, match_since_ms=None
    )
    clock.advance(3600)
    commit(ledger, ["LATE"], clock, app="b")
    probe = [*keys[::3], "LATE", *(f"MISSING_{i}" for i in range(20_000))]  # no IN-list crash

    found = ledger.existing(probe, since_ms=None)
    assert set(found) == {*keys[::3], "LATE"}
    assert found["ORDER_3"] == "fp-ORDER_3"
    assert set(ledger.existing(probe, since_ms=clock.now_ms() - LEASE_MS)) == {"LATE"}
    looked = ledger.lookup_results(["ORDER_0", "ORDER_1", "MISSING_1"])
    assert looked == {"ORDER_0": None, "ORDER_1": '{"n": 1}'}


def test_owners_says_who_committed_each_key(make_ledger: MakeLedger, clock: ManualClock) -> None:
    """A replayed Spark batch tells its own earlier commits from other writers' by this."""
    ledger = make_ledger()
    for owner, keys in (("query-a", ["A_1", "A_2"]), ("query-b", ["B_1"])):
        rows = make_rows(
            group="orders", keys=keys, buckets=[bucket_of(k, BUCKETS) for k in keys], owner=owner
        )
        ledger.commit(rows, app_id=owner, txn_version=0, match_since_ms=None)
        clock.advance(60)

    got = ledger.owners(["A_1", "A_2", "B_1", "MISSING"], since_ms=None)
    assert got == {"A_1": "query-a", "A_2": "query-a", "B_1": "query-b"}
    assert ledger.owners(["A_1", "B_1"], since_ms=clock.now_ms() - 90_000) == {"B_1": "query-b"}
    assert ledger.owners([], since_ms=None) == {}


def test_expire_drops_old_days_and_keeps_the_rest(
    make_ledger: MakeLedger, clock: ManualClock, tmp_path: Path
) -> None:
    path = tmp_path / "ledger"
    ledger = make_ledger()
    for day, keys in ((0, ["old1", "old2"]), (5, ["mid"]), (9, ["new"])):
        clock.advance(day * DAY_MS / 1000 - (clock.now_ms() - START_MS) / 1000)
        commit(ledger, keys, clock, txn=day)
    old_files = [f for f in path.rglob("*.parquet") if "2023-11-15" in str(f)]
    assert old_files

    deleted = ledger.expire(clock.now_ms() - 7 * DAY_MS, vacuum_retention_hours=0)
    assert deleted == 2
    assert ledger_keys(ledger) == ["mid", "new"]
    assert not any(f.exists() for f in old_files)  # vacuumed, not just unlinked from the log
    assert ledger.expire(clock.now_ms() - 7 * DAY_MS, vacuum_retention_hours=0) == 0


def test_expire_refuses_a_negative_vacuum_retention_before_deleting(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    ledger = make_ledger()
    commit(ledger, ["old"], clock, txn=0)
    clock.advance(9 * DAY_MS / 1000)
    with pytest.raises(ConfigError, match=r"^vacuum_retention_hours: -1 must be >= 0"):
        ledger.expire(clock.now_ms() - 7 * DAY_MS, vacuum_retention_hours=-1)
    assert ledger_keys(ledger) == ["old"]  # nothing deleted


def test_a_sink_table_that_is_its_own_ledger_keeps_the_user_columns_and_tells_their_types(
    make_ledger: MakeLedger, clock: ManualClock, tmp_path: Path
) -> None:
    """The types are what a sink fits the user's rows to (a row that does not fit is
    dead-lettered instead of failing the batch on every replay)."""
    ledger = make_ledger()
    assert ledger.column_types() is None  # no table yet
    rows = rows_for(["A", "B"], clock).append_column("amount", pa.array([9.5, 3.0]))
    ledger.commit(rows, app_id="q", txn_version=0, match_since_ms=None)
    later = rows_for(["B", "C"], clock).append_column("amount", pa.array([1.0, 7.25]))
    result = ledger.commit(later, app_id="q", txn_version=1, match_since_ms=None)
    assert result.already_present == ["B"]
    stored = pa.table(
        QueryBuilder()
        .register("sink", DeltaTable(str(tmp_path / "ledger")))
        .execute("SELECT key, amount FROM sink ORDER BY key")
        .read_all()
    )
    assert stored.column("amount").to_pylist() == [9.5, 3.0, 7.25]
    types = ledger.column_types()
    assert types is not None
    assert {f.name: f.type for f in types} == {
        **{f.name: f.type for f in LEDGER_SCHEMA},
        "amount": pa.float64(),
    }


def test_keys_added_since_raises_when_a_file_cannot_be_read_and_is_none_only_when_gone(
    make_ledger: MakeLedger, clock: ManualClock, tmp_path: Path
) -> None:
    """A damaged file is an error to see, not a reason to rebuild the whole index."""
    path = tmp_path / "ledger"
    writer = make_ledger()
    start = commit(writer, ["A"], clock, txn=0).version
    later = commit(writer, ["B"], clock, txn=1).version
    entry = parse_commit(later, (path / commit_name(later)).read_bytes())
    [added] = [a.path for a in entry.added]
    (path / added).write_bytes(b"not parquet")

    reader = make_ledger()  # remembers nothing of the writer's commits
    with pytest.raises(LedgerError, match=r"cannot read"):
        reader.keys_added_since(start)
    (path / added).unlink()  # vacuumed: the index must be rebuilt from the window
    assert make_ledger().keys_added_since(start) is None


def test_a_ledger_of_another_group_or_bucket_count_is_refused(
    make_ledger: MakeLedger, clock: ManualClock
) -> None:
    commit(make_ledger(identity=LedgerIdentity("orders", BUCKETS)), ["A"], clock)
    with pytest.raises(ConfigError, match=r"^ledger_path: .* belongs to group 'orders'"):
        make_ledger(identity=LedgerIdentity("payments", BUCKETS)).version()
    with pytest.raises(ConfigError, match=rf"^buckets: .* written with {BUCKETS} buckets, not 8"):
        make_ledger(identity=LedgerIdentity("orders", 8)).version()
    assert make_ledger(identity=LedgerIdentity("orders", BUCKETS)).version() == 0


def test_version_sees_other_writers_and_counts_every_commit(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    reader = DeltaLedger(str(path))
    assert reader.version() == -1
    write_deltalake(str(path), pa.table({"x": [1]}))
    write_deltalake(str(path), pa.table({"x": [2]}), mode="append")
    assert reader.version() == 1
    assert (path / LOG_DIR / "00000000000000000001.json").exists()


def test_the_object_store_log_reader_reads_like_the_local_one(
    tmp_path: Path, clock: ManualClock
) -> None:
    """s3:// / abfss:// ledgers go through delta-rs' storage handler; it must agree."""
    path = tmp_path / "ledger"
    ledger = DeltaLedger(str(path), clock=clock)
    commit(ledger, ["A", "B", "C"], clock)
    local, remote = LocalLogStore(str(path)), ObjectLogStore(str(path), None)
    for store in (local, remote):
        assert store.exists(commit_name(0))
        assert not store.exists(commit_name(1))
        entry = parse_commit(0, store.read_bytes(commit_name(0)))
        keys = sorted(
            k
            for added in entry.added
            for k in store.read_parquet(added.path, ["key"])["key"].to_pylist()
        )
        assert keys == ["A", "B", "C"]
        with pytest.raises(FileNotFoundError):
            store.read_bytes(commit_name(1))
    assert sorted(local.list_log()) == sorted(remote.list_log())


def test_the_cli_audits_expires_and_refuses_to_cut_into_the_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = IdemConfig(group="orders", data_dir=str(tmp_path))
    ledger = DeltaLedger(config.resolved_ledger_path)
    wall = ManualClock(SYSTEM_CLOCK.now_ms())  # the CLI runs on wall time
    commit(ledger, ["A"], wall, app="a")
    wall.advance(3600)
    commit(ledger, ["A", "B"], wall, app="b")  # A again an hour later, outside the horizon
    common = ["--group", "orders", "--data-dir", str(tmp_path)]

    assert cli_main(["ledger", "audit", "--json", *common]) == 1
    assert json.loads(capsys.readouterr().out)["repeated"] == [{"key": "A", "count": 2}]
    assert (
        cli_main(["ledger", "expire", "--older-than", "1d", *common]) == 2
    )  # refused: a bad setting
    assert "inside the dedup window" in capsys.readouterr().err
    assert cli_main(["ledger", "expire", "--older-than", "30d", "--json", *common]) == 0
    assert json.loads(capsys.readouterr().out)["deleted_rows"] == 0


# -- delta-spark: what a Spark session shares with the application ---------------------


@pytest.fixture
def spark_ledger(spark: Any, tmp_path: Path, clock: ManualClock) -> Callable[..., Any]:
    """Ledgers written by delta-spark, on ``tmp_path / name``."""
    from idem.ledger.spark_engine import SparkDeltaLedger

    def make(name: str = "ledger", **options: Any) -> Any:
        return SparkDeltaLedger(spark, str(tmp_path / name), clock=clock, **options)

    return make


def test_a_spark_commit_leaves_the_callers_session_settings_alone(
    spark: Any, spark_ledger: Callable[..., Any], clock: ManualClock, tmp_path: Path
) -> None:
    """The txn ids and the commit tag are set on a clone: the application's own Delta
    writes in its session carry neither, and its own settings survive the commit."""
    user_metadata = "spark.databricks.delta.commitInfo.userMetadata"
    spark.conf.set(user_metadata, "the application's")
    try:
        commit(spark_ledger(), ["A"], clock, app="sink", txn=3)
        assert spark.conf.get(user_metadata) == "the application's"
        assert spark.conf.get("spark.databricks.delta.write.txnAppId", None) is None
        own = str(tmp_path / "own")
        spark.range(1).write.format("delta").save(own)
        entry = parse_commit(0, (Path(own) / commit_name(0)).read_bytes())
        assert entry.transactions == {}
        assert entry.user_metadata == "the application's"
    finally:
        spark.conf.unset(user_metadata)


def test_two_spark_ledgers_committing_at_once_keep_their_own_txn_ids(
    spark_ledger: Callable[..., Any], clock: ManualClock, tmp_path: Path
) -> None:
    ledgers = [spark_ledger("first"), spark_ledger("second")]
    for round_ in range(2):
        results = race(
            lambda w, r=round_: commit(ledgers[w], [f"K{w}-{r}"], clock, app=f"app{w}", txn=r)
        )
        for w, result in enumerate(results):
            assert (result.inserted, result.replayed) == (1, False)
            path = tmp_path / ("first", "second")[w]
            entry = parse_commit(result.version, (path / commit_name(result.version)).read_bytes())
            assert entry.transactions == {f"app{w}": round_}


class _BeforeMerge:
    """delta-spark's DeltaTable, calling ``hook`` once just before the first MERGE starts."""

    def __init__(self, real: Any, hook: Callable[[], None]) -> None:
        self._real = real
        self._hook: Callable[[], None] | None = hook

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def forPath(self, *args: Any) -> Any:  # noqa: N802 -- delta-spark's name
        table = self._real.forPath(*args)
        outer = self

        class Table:
            def __getattr__(self, name: str) -> Any:
                return getattr(table, name)

            def alias(self, name: str) -> Any:
                hook, outer._hook = outer._hook, None
                if hook is not None:
                    hook()
                return table.alias(name)

        return Table()


def test_a_key_another_writer_commits_just_before_the_merge_is_reported_present(
    spark_ledger: Callable[..., Any], clock: ManualClock
) -> None:
    """What a commit reports as already present comes from the commit itself."""
    ours, theirs = spark_ledger(), spark_ledger()
    commit(ours, ["seed"], clock, app="seed")
    ours._delta = _BeforeMerge(ours._delta, lambda: commit(theirs, ["B"], clock, app="theirs"))
    result = commit(ours, ["A", "B"], clock, app="ours")
    assert (result.inserted, result.already_present) == (1, ["B"])
    assert ledger_keys(ours) == ["A", "B", "seed"]


def test_a_spark_commit_reports_its_own_version_when_another_writer_follows_at_once(
    spark_ledger: Callable[..., Any], clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The version a commit reports moves Redis's watermark: it must be the commit that
    carries this batch's txn, found by its tag, not the newest one."""
    from idem.ledger.spark_engine import SparkDeltaLedger

    ours, theirs = spark_ledger(), spark_ledger()
    commit(ours, ["seed"], clock, app="seed")
    real = SparkDeltaLedger._find_commit

    def then_another_writer(self: Any, before: int, tag: str) -> Any:
        monkeypatch.setattr(SparkDeltaLedger, "_find_commit", real)
        commit(theirs, ["THEIRS"], clock, app="theirs")
        return real(self, before, tag)

    monkeypatch.setattr(SparkDeltaLedger, "_find_commit", then_another_writer)
    result = commit(ours, ["A"], clock, app="ours")
    assert (result.version, result.inserted, ours.version()) == (1, 1, 2)
    path = Path(ours.path)
    entry = parse_commit(1, (path / commit_name(1)).read_bytes())
    assert entry.transactions == {"ours": 0}


def test_a_spark_ledger_created_by_another_writer_between_its_log_and_its_first_commit(
    spark_ledger: Callable[..., Any],
    clock: ManualClock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Delta calls a table there once its ``_delta_log`` directory is, before the
    creator's first commit lands: the losing create waits for it and goes in as a MERGE."""
    from idem.ledger.spark_engine import SparkDeltaLedger

    commit(spark_ledger("theirs"), ["A"], clock, app="theirs")
    theirs, ours = tmp_path / "theirs", tmp_path / "ledger"
    shutil.copytree(theirs, ours, ignore=shutil.ignore_patterns("*.json", "*.crc"))
    # The other writer's first commit lands 1 s after our create failed, while ours waits.
    first = threading.Timer(1.0, shutil.copy, (theirs / commit_name(0), ours / commit_name(0)))
    real = SparkDeltaLedger._created_by_another

    def once_our_create_failed(self: Any, exc: Exception) -> bool:
        if not first.is_alive() and not (ours / commit_name(0)).exists():
            first.start()
        return real(self, exc)

    monkeypatch.setattr(SparkDeltaLedger, "_created_by_another", once_our_create_failed)
    try:
        result = commit(spark_ledger(), ["A", "B"], clock, app="ours")
    finally:
        first.join()
    assert (result.version, result.inserted, result.already_present) == (1, 1, ["A"])
    assert ledger_keys(spark_ledger()) == ["A", "B"]


def test_a_spark_ledger_whose_log_directory_never_gets_a_commit_names_it(
    spark_ledger: Callable[..., Any],
    clock: ManualClock,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from idem.ledger import spark_engine

    monkeypatch.setattr(spark_engine, "FIRST_COMMIT_WAIT_S", 1.0)
    (tmp_path / "ledger" / LOG_DIR).mkdir(parents=True)
    with pytest.raises(LedgerError, match=r"_delta_log directory holds no commit after 1 s"):
        commit(spark_ledger(), ["A"], clock, app="ours")


def test_version_on_delta_spark_reads_the_log_and_runs_no_spark_job(
    spark: Any, spark_ledger: Callable[..., Any], clock: ManualClock
) -> None:
    writer, reader = spark_ledger(), spark_ledger()
    commit(writer, ["A"], clock)
    assert reader.version() == 0  # the first call also checks whose table it is
    tracker = spark.sparkContext.statusTracker()
    jobs = len(tracker.getJobIdsForGroup(None))
    assert [reader.version() for _ in range(20)] == [0] * 20
    commit(writer, ["B"], clock, txn=1)
    jobs_after_commit = len(tracker.getJobIdsForGroup(None))
    assert reader.version() == 1
    assert jobs_after_commit > jobs  # the tracker does see jobs...
    assert len(tracker.getJobIdsForGroup(None)) == jobs_after_commit  # ...version ran none


def test_a_table_has_one_writer_engine(
    spark: Any,
    spark_ledger: Callable[..., Any],
    clock: ManualClock,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    commit(DeltaLedger(str(tmp_path / "by-delta-rs"), clock=clock), ["A"], clock)
    with pytest.raises(ConfigError, match=r"is written by delta-rs, not delta-spark"):
        spark_ledger("by-delta-rs").version()

    from idem.config import LedgerEngine
    from idem.spark.ledger_engine import engine_for_session

    config = IdemConfig(group="orders", data_dir=str(tmp_path / "spark-group"), buckets=BUCKETS)
    assert type(open_ledger(config)).__name__ == "DeltaLedger"  # the core's auto
    engine = engine_for_session(LedgerEngine.AUTO, spark)  # the Spark glue's auto
    ledger = open_ledger(config, engine)
    assert type(ledger).__name__ == "SparkDeltaLedger"
    commit(ledger, ["A"], clock)
    with pytest.raises(ConfigError, match=r"is written by delta-spark, not delta-rs"):
        open_ledger(config, "delta-rs").version()
    common = ["--group", "orders", "--data-dir", config.data_dir]
    assert cli_main(["ledger", "expire", "--older-than", "30d", *common]) == 2
    refusal = capsys.readouterr().err
    assert "is written by delta-spark" in refusal
    assert "open_ledger(config, 'delta-spark').expire(" in refusal
    assert ledger_keys(ledger) == ["A"]


def test_the_spark_log_reader_reads_like_the_local_one(spark: Any, tmp_path: Path) -> None:
    """A ledger on a filesystem only Spark reaches is read through its Hadoop filesystem."""
    from idem.ledger._hadoop import HadoopLogStore

    path = tmp_path / "ledger"
    commit(DeltaLedger(str(path)), ["A", "B"], ManualClock(START_MS))
    local, hadoop = LocalLogStore(str(path)), HadoopLogStore(spark, f"file://{path}")
    entry = parse_commit(0, hadoop.read_bytes(commit_name(0)))
    assert entry == parse_commit(0, local.read_bytes(commit_name(0)))
    assert hadoop.exists(commit_name(0))
    assert not hadoop.exists(commit_name(1))
    with pytest.raises(FileNotFoundError):
        hadoop.read_bytes(commit_name(1))
    keys = [hadoop.read_parquet(a.path, ["key"]).column("key").to_pylist() for a in entry.added]
    assert sorted(k for part in keys for k in part) == ["A", "B"]
    assert sorted(hadoop.list_log()) == sorted(local.list_log())


def test_a_spark_ledger_commits_rows_that_stay_a_dataframe(
    spark: Any, spark_ledger: Callable[..., Any], clock: ManualClock
) -> None:
    """The executors' commit: the rows are a DataFrame of the caller's session, written by
    the MERGE of the ledger's own write session, once per txn, naming slipped keys."""
    ledger = spark_ledger()
    commit(ledger, ["A"], clock, app="other")

    def frame(keys: list[str]) -> Any:
        rows = rows_for(keys, clock).append_column("amount", pa.array(range(len(keys))))
        return spark.createDataFrame(rows)  # a sink table's ledger rows carry the user's columns

    since = clock.now_ms() - 60_000
    first = ledger.commit_frame(
        frame(["A", "B", "C"]), offered=3, app_id="app", txn_version=0, match_since_ms=since
    )
    again = ledger.commit_frame(
        frame(["A", "B", "C"]), offered=3, app_id="app", txn_version=0, match_since_ms=since
    )

    assert (first.version, first.inserted, first.already_present) == (1, 2, ["A"])
    assert again.replayed
    assert again.version is None
    assert ledger_keys(ledger) == ["A", "B", "C"]
    assert ledger.version() == 1
    amounts = spark.read.format("delta").load(ledger.path).where("amount IS NOT NULL")
    assert sorted(r["amount"] for r in amounts.collect()) == [1, 2]  # B and C's


def staged(
    directory: Path, keys: Sequence[str], clock: ManualClock, *, completed_at_ms: int | None
) -> StagedRows:
    """``keys``' rows with an ``amount`` column, written as two Parquet files (as two
    Spark tasks stage them) and held as their ledger columns alone."""
    rows = rows_for(keys, clock).append_column(
        "amount", pa.array([float(len(k)) * 1.5 for k in keys])
    )
    directory.mkdir(parents=True, exist_ok=True)
    half = rows.num_rows // 2
    files = []
    for n, part in enumerate((rows.slice(0, half), rows.slice(half))):
        files.append(str(directory / f"part-{n}.parquet"))
        pq.write_table(part, files[-1], row_group_size=max(1, half // 3))
    return StagedRows(
        keys=rows.select(LEDGER_SCHEMA.names),
        schema=rows.schema,
        open=parquet_opener(files, rows.schema),
        completed_at_ms=completed_at_ms,
    )


def test_staged_rows_are_committed_like_rows_in_memory_by_every_path_of_delta_rs(
    tmp_path: Path, clock: ManualClock
) -> None:
    """A Delta sink's rows streamed from staged files: table creation, the MERGE and the
    checked append each insert only the keys the ledger lacks, with the user's column."""
    ledger = DeltaLedger(str(tmp_path / "ledger"), clock=clock)
    horizon = clock.now_ms() - LEASE_MS
    stamp = clock.now_ms() + 5

    def go(name: str, keys: Sequence[str], **options: Any) -> Any:
        rows = staged(tmp_path / name, keys, clock, completed_at_ms=stamp)
        return ledger.commit(rows, app_id=name, txn_version=0, match_since_ms=horizon, **options)

    created = go("create", ["AA", "B"], match_after_version=None)
    assert (created.version, created.inserted) == (0, 2)
    merged = go("merge", ["B", "CCC", "D"], match_after_version=None)  # B slipped
    assert (merged.inserted, merged.already_present) == (2, ["B"])
    # Claimed when the index had version 0: D, committed since, is caught batch by batch.
    appended = go("append", ["D", "EE", "F"], match_after_version=0)
    assert (appended.inserted, appended.already_present) == (2, ["D"])
    assert go("append", ["D", "EE", "F"], match_after_version=0).replayed
    assert ledger.audit() == []
    stored = pa.table(
        QueryBuilder()
        .register("sink", DeltaTable(str(tmp_path / "ledger")))
        .execute("SELECT key, amount, completed_at, completed_date FROM sink ORDER BY key")
        .read_all()
    )
    assert stored.column("key").to_pylist() == ["AA", "B", "CCC", "D", "EE", "F"]
    assert stored.column("amount").to_pylist() == [3.0, 1.5, 4.5, 1.5, 3.0, 1.5]
    stamped = {int(t.timestamp() * 1000) for t in stored.column("completed_at").to_pylist()}
    assert stamped == {stamp}
    # What Redis is told of these commits matches the files (key, fingerprint, instant).
    changed = ledger.keys_added_since(-1)
    assert changed is not None
    assert sorted(changed.keys.column("key").to_pylist()) == ["AA", "B", "CCC", "D", "EE", "F"]


def test_staged_rows_that_repeat_a_key_are_refused_naming_the_cause(
    tmp_path: Path, clock: ManualClock
) -> None:
    ledger = DeltaLedger(str(tmp_path / "ledger"), clock=clock)
    rows = staged(tmp_path / "dup", ["A", "A"], clock, completed_at_ms=clock.now_ms())
    with pytest.raises(LedgerError, match="1 key\\(s\\) appear more than once"):
        ledger.commit(rows, app_id="q", txn_version=0, match_since_ms=None)
    assert ledger.version() == -1  # nothing written


def seed(ledger: DeltaLedger, tmp_path: Path, clock: ManualClock) -> None:
    """Create the ledger with one staged row, ``seed``: a sink table with the user's column."""
    rows = staged(tmp_path / "seed", ["seed"], clock, completed_at_ms=clock.now_ms())
    ledger.commit(rows, app_id="seed", txn_version=0, match_since_ms=None)


def data_files(table: Path) -> set[str]:
    """Every Parquet file under the table's partition directories (named or not)."""
    return {str(p.relative_to(table)) for p in table.glob("bucket=*/*/*.parquet")}


def named_files(table: Path) -> set[str]:
    """The data files the table's current version names."""
    return {str(p) for p in DeltaTable(str(table)).get_add_actions().column("path").to_pylist()}


@pytest.mark.parametrize("path", ["create", "merge", "append"])
def test_staged_rows_land_once_in_their_partitions_with_stats_a_lookup_prunes_by(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Many rows over every bucket, written by idem in small pieces (buffer and file size
    bounds shrunk): each row is read back once, in the partition of its bucket and day,
    and each file's add action holds its row count and the ranges Delta prunes by."""
    monkeypatch.setattr(_files, "BUFFER_BYTES", 4096)
    monkeypatch.setattr(_files, "TARGET_FILE_BYTES", 2048)
    table = tmp_path / "ledger"
    ledger = DeltaLedger(str(table), clock=clock)
    if path != "create":
        seed(ledger, tmp_path, clock)
    keys = [f"K{i:04d}" for i in range(3000)]
    stamp = clock.now_ms() + 7
    rows = staged(tmp_path / "staged", keys, clock, completed_at_ms=stamp)
    result = ledger.commit(
        rows,
        app_id="big",
        txn_version=0,
        match_since_ms=clock.now_ms() - LEASE_MS,
        match_after_version=0 if path == "append" else None,
    )
    assert result.inserted == 3000
    stored = pa.table(
        QueryBuilder()
        .register("sink", DeltaTable(str(table)))
        .execute(
            "SELECT key, bucket, completed_date, amount FROM sink WHERE key <> 'seed' ORDER BY key"
        )
        .read_all()
    )
    assert stored.column("key").to_pylist() == keys
    assert stored.column("bucket").to_pylist() == [bucket_of(k, BUCKETS) for k in keys]
    assert set(stored.column("completed_date").to_pylist()) == {date_of_ms(stamp)}
    assert stored.column("amount").to_pylist() == [float(len(k)) * 1.5 for k in keys]
    # Several files per partition, every one of them named by the table, no strays.
    assert data_files(table) == named_files(table)
    actions = pa.table(DeltaTable(str(table)).get_add_actions(flatten=True))
    partitions = {
        (a["partition.bucket"], a["partition.completed_date"]) for a in actions.to_pylist()
    }
    assert actions.num_rows > len(partitions)
    checked = 0
    for action in actions.to_pylist():
        if action["num_records"] == 1:
            continue  # the seed's file
        held = pq.read_table(table / action["path"], columns=["key", "completed_at", "msg_id"])
        assert action["num_records"] == held.num_rows
        assert action["partition.bucket"] == bucket_of(action["min.key"], BUCKETS)
        assert (action["min.key"], action["max.key"]) == (
            min(held.column("key").to_pylist()),
            max(held.column("key").to_pylist()),
        )
        assert action["null_count.msg_id"] == held.num_rows  # staged without message ids
        assert action["min.completed_at"] == action["max.completed_at"]
        assert int(action["min.completed_at"].timestamp() * 1000) == stamp
        checked += 1
    assert checked == actions.num_rows - (0 if path == "create" else 1)
    # A lookup of one key reads only the files whose key range holds it.
    holding = [a for a in actions.to_pylist() if a["min.key"] <= PROBED <= a["max.key"]]
    assert 0 < len(holding) < actions.num_rows
    plan = (
        QueryBuilder()
        .register("sink", DeltaTable(str(table)))
        .execute(f"EXPLAIN ANALYZE {PROBE_SQL}")
        .read_all()
    )
    scanned = re.findall(r"part-[^,\]]*\.parquet", pa.table(plan).column("plan")[0].as_py())
    assert sorted(scanned) == sorted(Path(a["path"]).name for a in holding)
    assert ledger.existing([PROBED], since_ms=None) == {PROBED: f"fp-{PROBED}"}


PROBED = "K1234"
PROBE_SQL = "SELECT key FROM sink WHERE key = 'K1234'"


@pytest.mark.parametrize("overlap", [True, False], ids=["racer-shares-a-key", "disjoint-racer"])
def test_a_staged_append_that_loses_the_race_writes_no_key_twice_and_leaves_no_files(
    tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, overlap: bool
) -> None:
    """Another writer commits between our files' writing and their commit: our commit
    loses the version, checks what the other added, and commits again (writing anew when
    the other added a key our files hold). Files that were never committed are removed."""
    table = tmp_path / "ledger"
    ours, theirs = DeltaLedger(str(table), clock=clock), DeltaLedger(str(table), clock=clock)
    seed(ours, tmp_path, clock)
    racer = ["C", "R"] if overlap else ["R"]
    real = deltars._StagedFiles.commit_to
    commits: list[int] = []

    def after_another_writer(self: Any, table_: DeltaTable, app_id: str, txn: int) -> None:
        if self.keys.to_pylist() == racer:
            real(self, table_, app_id, txn)  # the other writer's own commit
            return
        if not commits:
            rows = staged(tmp_path / "theirs", racer, clock, completed_at_ms=clock.now_ms())
            theirs.commit(
                rows, app_id="theirs", txn_version=0, match_since_ms=0, match_after_version=0
            )
        commits.append(len(self.actions))
        real(self, table_, app_id, txn)

    monkeypatch.setattr(deltars._StagedFiles, "commit_to", after_another_writer)
    rows = staged(tmp_path / "ours", ["A", "B", "C"], clock, completed_at_ms=clock.now_ms())
    result = ours.commit(
        rows, app_id="ours", txn_version=0, match_since_ms=0, match_after_version=0
    )
    assert len(commits) == 2  # lost the version once, then landed
    assert result.version == 2
    assert result.already_present == (["C"] if overlap else [])
    assert ledger_keys(ours) == sorted({"seed", "A", "B", "C", "R"})
    assert ours.audit() == []
    assert data_files(table) == named_files(table)  # the lost attempt's files are gone
    # A replay of the same batch (a restarted query) writes no file at all.
    before = data_files(table)
    again = ours.commit(
        staged(tmp_path / "again", ["A", "B", "C"], clock, completed_at_ms=clock.now_ms()),
        app_id="ours",
        txn_version=0,
        match_since_ms=0,
        match_after_version=0,
    )
    assert again.replayed
    assert data_files(table) == before


def test_two_writers_creating_a_ledger_from_staged_rows_insert_each_key_once(
    tmp_path: Path, clock: ManualClock
) -> None:
    """Both write their files, one creates the table; the other's files are removed and
    its rows go in again, checked against the first's."""
    table = tmp_path / "ledger"
    writers = [DeltaLedger(str(table), clock=clock), DeltaLedger(str(table), clock=clock)]
    shared = [f"S{i}" for i in range(50)]
    batches = [
        staged(
            tmp_path / f"w{w}",
            [f"W{w}-{i}" for i in range(50)] + shared,
            clock,
            completed_at_ms=clock.now_ms(),
        )
        for w in range(2)
    ]
    results = race(
        lambda w: writers[w].commit(batches[w], app_id=f"w{w}", txn_version=0, match_since_ms=0)
    )
    assert sorted(r.version for r in results) == [0, 1]
    assert sorted(results[0].already_present + results[1].already_present) == sorted(shared)
    assert writers[0].audit() == []
    assert len(ledger_keys(writers[0])) == 150
    assert data_files(table) == named_files(table)
