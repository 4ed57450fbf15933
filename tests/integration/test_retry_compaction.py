"""Compacting the retry journal: a rebuild starts from the newest base, not from version 0.

Real redis-server, real Delta journal. The strongest check deletes, from disk,
every data file the versions before the base wrote: the rebuild must not need them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
import redis
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import CommitProperties
from retry_helpers import drain

from idem.cli import main as idem_main
from idem.clock import ManualClock
from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry import MessageExt, RetryEngine, audit_states
from idem.retry.errors import JournalError
from idem.retry.journal import RetryJournal
from idem.retry.journal_base import BASE_OF, BASE_ROWS, JournalBase
from idem.retry.journal_history import settled_history

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, server: RedisServer, group: str) -> IdemConfig:
    return IdemConfig(
        group=group, redis_url=server.url, data_dir=str(tmp_path), delay_levels="1s 1s 1s"
    )


def _messages(n: int, prefix: str) -> list[MessageExt]:
    return [
        MessageExt(topic="TopicTest", msg_id=f"{prefix}{i}", keys=f"ORDER_{prefix}{i}", body=b"{}")
        for i in range(n)
    ]


def _remove_data_files_up_to(table: Path, version: int) -> int:
    """Delete the parquet files that versions ``0..version`` of a Delta table added."""
    removed = 0
    for v in range(version + 1):
        for line in (table / "_delta_log" / f"{v:020d}.json").read_text().splitlines():
            add = json.loads(line).get("add")
            if add:
                (table / add["path"]).unlink()
                removed += 1
    return removed


def test_a_rebuild_after_compaction_reads_only_what_came_after_the_base(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    config = _config(tmp_path, redis_server, "CID_compact")
    engine = RetryEngine(config, clock=clock)
    sent = [m for b in range(6) for m in _messages(50, f"b{b}-")]
    for b in range(6):
        assert engine.send_back(sent[50 * b : 50 * (b + 1)], delay_level=1).acknowledged
    clock.advance(1.5)
    assert engine.tick() == 300
    first = engine.poll_retry("c1", 200)
    engine.ack(first[:150])  # done
    engine.send_back(first[150:180], delay_level=0)  # failed again: next level
    engine.dead_letter(first[180:190], reason="key: null")  # 10 dead; 10 stay in the stream
    done = {m.origin_msg_id for m in first[:150]}
    dead = {m.origin_msg_id for m in first[180:190]}
    assert engine.pending() == 300 - 150 - 10

    base = engine.compact_journal()
    assert base is not None
    assert len(base.live) == 140  # what was scheduled or in the stream at that moment

    later = _messages(10, "late-")
    engine.send_back(later, delay_level=2)  # after the base: must come back from the log
    assert _remove_data_files_up_to(Path(config.resolved_journal_path), base.covers) > 0
    real_redis.flushall()
    engine.sync()  # the cursor is gone: a rebuild, from the base

    assert engine.pending() == 150
    delivered = drain(engine, clock, after_s=10)
    counts = Counter(m.origin_msg_id for m in delivered)
    expected = {m.msg_id for m in sent + later} - done - dead
    assert set(counts) == expected, "a message was lost"
    assert set(counts.values()) == {1}, "a message was delivered twice"
    assert engine.pending() == 0


def test_events_committed_while_the_base_was_written_are_not_lost(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    """A base restates the journal as of the version it read; what other writers
    committed after that version and before the base commit is applied on top."""
    config = _config(tmp_path, redis_server, "CID_race")
    engine = RetryEngine(config, clock=clock)
    engine.send_back(_messages(5, "a-"), delay_level=1)
    covered = engine.journal.latest_version()
    assert covered is not None
    engine.send_back(_messages(5, "b-"), delay_level=1)  # lands before the base commit
    base = engine.journal.compact(now_ms=clock.now_ms(), until=covered)
    assert base is not None
    assert base.version > covered + 1
    assert {e.origin_msg_id for e in base.live} == {f"a-{i}" for i in range(5)}

    real_redis.flushall()
    engine.sync()
    assert engine.pending() == 10
    delivered = {m.origin_msg_id for m in drain(engine, clock, after_s=10)}
    assert delivered == {f"{p}-{i}" for p in "ab" for i in range(5)}


def test_a_running_sync_skips_the_base_and_the_cli_compacts_again(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    config = _config(tmp_path, redis_server, "CID_skip")
    engine = RetryEngine(config, clock=clock)
    messages = _messages(40, "m-")
    engine.send_back(messages, delay_level=1)
    clock.advance(1.5)
    engine.tick()
    engine.ack(engine.poll_retry("c1", 15))
    engine.compact_journal()
    # Another process whose Redis cursor stands before the base: nothing to re-apply.
    other = RetryEngine(config, clock=clock)
    assert other.sync().scheduled == 0
    assert other.pending() == 25

    args = ["--group", config.group, "--redis-url", redis_server.url, "--data-dir", str(tmp_path)]
    assert idem_main(["retry", "compact", *args]) == 0  # a second base, from the first
    assert idem_main(["retry", "rebuild", *args]) == 0
    assert engine.pending() == 25
    delivered = drain(engine, clock, after_s=10)
    assert len(delivered) == 25
    audit = audit_states(engine, {m.msg_id for m in messages}, {m.origin_msg_id for m in messages})
    assert audit.ok, audit.describe()


def test_running_schedule_services_compact_the_journal_once_per_interval(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    config = _config(tmp_path, redis_server, "CID_auto")
    engine = RetryEngine(config)
    engine.send_back(_messages(20, "s-"), delay_level=3)  # due in 1 s; nobody consumes
    services = [
        RetryEngine(config).schedule_service(compact_interval_ms=60_000, name=f"svc-{i}")
        for i in range(2)
    ]
    for service in services:
        service.start()
    try:
        deadline = time.monotonic() + 15
        while engine.journal.read_base() is None:
            assert time.monotonic() < deadline, "no service compacted the journal"
            time.sleep(0.1)
        time.sleep(1.5)  # both services have looked at least once by now
    finally:
        for service in services:
            service.stop()
    base = engine.journal.read_base()
    assert base is not None
    assert {e.origin_msg_id for e in base.live} == {f"s-{i}" for i in range(20)}
    history = DeltaTable(config.resolved_journal_path).history()
    assert sum(1 for info in history if BASE_OF in info) == 1  # one per interval, group-wide


def test_a_rebuild_racing_a_new_base_commit_restates_every_live_message(
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Another process commits a base just as a rebuild, after a FLUSHALL, looks for the
    newest one: the rebuild reads that base's rows, not those of the commit before it."""
    config = _config(tmp_path, redis_server, "CID_base_race")
    engine = RetryEngine(config, clock=clock)
    sent = _messages(30, "r-")
    engine.send_back(sent, delay_level=1)
    real_redis.flushall()

    other = RetryJournal(config.resolved_journal_path, config.group)  # another process's
    load = engine.journal._load
    bases: list[JournalBase] = []

    def load_then_base_lands() -> DeltaTable | None:
        table = load()
        if not bases:  # the rebuild's first look at the log: a base lands right after it
            base = other.compact(now_ms=clock.now_ms())
            assert base is not None
            bases.append(base)
        return table

    monkeypatch.setattr(engine.journal, "_load", load_then_base_lands)
    engine.sync()
    monkeypatch.undo()

    assert len(bases[0].live) == 30
    assert engine.pending() == 30, "the rebuild skipped the messages of the base"
    delivered = Counter(m.origin_msg_id for m in drain(engine, clock, after_s=10))
    assert set(delivered) == {m.msg_id for m in sent}
    assert set(delivered.values()) == {1}


def test_history_labels_each_commit_with_its_own_version_on_a_stale_table(
    tmp_path: Path,
) -> None:
    """Commits that land after a table object's snapshot, before or during its history
    listing, are listed under their own versions."""
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"x": [0]}))
    stale = DeltaTable(path)  # version 0
    write_deltalake(path, pa.table({"x": [1]}), mode="append", commit_properties=_tag("one"))
    history = settled_history(stale, 10)
    assert [(info["version"], info.get("tag")) for info in history[:2]] == [(1, "one"), (0, None)]

    listing = stale.history

    def commit_then_list(limit: int | None = None) -> list[dict[str, object]]:
        if stale.version() == 1:  # a writer commits while the listing runs
            write_deltalake(
                path, pa.table({"x": [2]}), mode="append", commit_properties=_tag("two")
            )
        return listing(limit)

    stale.history = commit_then_list  # type: ignore[method-assign]
    history = settled_history(stale, 10)
    assert [(info["version"], info.get("tag")) for info in history[:3]] == [
        (2, "two"),
        (1, "one"),
        (0, None),
    ]
    assert stale.version() == 2


def test_a_base_read_back_short_fails_rather_than_rebuild_from_part_of_it(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis, clock: ManualClock
) -> None:
    config = _config(tmp_path, redis_server, "CID_base_short")
    engine = RetryEngine(config, clock=clock)
    engine.send_back(_messages(5, "s-"), delay_level=1)
    covered = engine.journal.latest_version()
    # a base commit whose rows are missing: its commit info says five, the commit has none
    engine.journal.append([], metadata={BASE_OF: str(covered), BASE_ROWS: "5"})
    real_redis.flushall()
    with pytest.raises(JournalError, match="holds 5 row"):
        engine.journal.sync(engine.store)
    assert engine.store.cursor() is None, "the cursor moved past a base read short"


def _tag(value: str) -> CommitProperties:
    return CommitProperties(custom_metadata={"tag": value})
