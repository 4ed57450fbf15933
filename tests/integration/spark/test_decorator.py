"""``@exactly_once`` on Spark DataFrames: what reaches the sink, what is sent back, replays.

The decorator is called the way ``foreachBatch`` calls it, with DataFrames of a
real local Spark session, against a real redis-server and real Delta tables.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from pyspark.sql import types as st
from spark_helpers import (
    config_for,
    dead_letters,
    engines_of,
    order,
    sink_key_counts,
    sink_rows,
    write_files,
)

from idem.cli import parse_args
from idem.config import MismatchPolicy
from idem.dedup import Dedup
from idem.errors import ConfigError
from idem.redis_cluster import LocalCluster
from idem.redis_server import RedisServer
from idem.retry.engine import RetryEngine
from idem.spark.cli import run_spec
from idem.spark.decorator import ExactlyOnce, exactly_once, fingerprint_hash
from idem.spark.delta_sink import delta_sink
from idem.spark.faults import CrashPlan, CrashPoint, SimulatedCrash
from idem.spark.ids import spark_hex
from idem.spark.retry_source import retry_stream
from idem.spark.rows import RowCodec
from idem.spark.run import Pipeline, QueryFailed

pytestmark = [pytest.mark.integration, pytest.mark.spark]

SCHEMA = st.StructType(
    [
        st.StructField("order_id", st.StringType()),
        st.StructField("amount", st.DecimalType(10, 2)),
        st.StructField("placed_at", st.TimestampType()),
        st.StructField("tags", st.ArrayType(st.StringType())),
    ]
)


def _rows(*keys: str, amount: str = "9.99") -> list[tuple[Any, ...]]:
    at = dt.datetime(2024, 5, 1, 10, 0, 0, 123456, tzinfo=dt.UTC)
    return [(k, Decimal(amount), at, ["a", k]) for k in keys]


def _df(spark: SparkSession, *keys: str, amount: str = "9.99") -> DataFrame:
    return spark.createDataFrame(_rows(*keys, amount=amount), SCHEMA)


class Recorder:
    """A user sink that keeps what it was given and fails the keys it is told to."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.rows: list[dict[str, Any]] = []
        self.fail = fail or set()

    def __call__(self, fresh: DataFrame, batch_id: int) -> list[str]:
        got = fresh.toArrow().to_pylist()
        self.rows += got
        return [r["order_id"] for r in got if r["order_id"] in self.fail]


def test_only_fresh_rows_reach_the_delta_sink_table_which_is_its_own_ledger(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    ledger_engine: str,
) -> None:
    config = config_for(tmp_path, redis_server.url, "decorated", engine=ledger_engine)
    sink = delta_sink(str(tmp_path / "orders"), key="order_id", config=config, client=real_redis)
    sink.query_id = "q1"
    first = sink.process(_df(spark, "A", "B", "A"), 0)
    second = sink.process(_df(spark, "B", "C"), 1)

    assert sink_key_counts(tmp_path / "orders") == {"A": 1, "B": 1, "C": 1}
    assert first.duplicates == {"in_batch": 1}
    assert second.duplicates == {"completed": 1}
    # The table holds the user's columns, typed as they were, next to the ledger's.
    row = next(r for r in sink_rows(tmp_path / "orders") if r["key"] == "C")
    assert row["order_id"] == "C"
    assert row["amount"] == Decimal("9.99")
    assert row["tags"] == ["a", "C"]
    assert row["batch_id"] == 1
    assert row["owner"] == "q1:1"
    assert engines_of(tmp_path / "orders") == {ledger_engine}


def test_a_replayed_batch_of_the_delta_sink_writes_each_key_once(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    ledger_engine: str,
) -> None:
    config = config_for(tmp_path, redis_server.url, "replayed", engine=ledger_engine)
    for point in (CrashPoint.AFTER_SINK, CrashPoint.AFTER_COMMIT):
        table = tmp_path / point.value
        sink = ExactlyOnce(
            None, config=config.with_changes(group=f"r-{point.value}".replace("_", "-")),
            key="order_id", client=real_redis, sink_table=str(table), query_id="q",
            crash_plan=CrashPlan(point, 0),
        )  # fmt: skip
        batch = _df(spark, "A", "B", "C")
        with pytest.raises(SimulatedCrash):
            sink.process(batch, 0)
        replay = sink.process(batch, 0)  # Spark runs batch 0 again after the crash
        assert sink_key_counts(table) == {"A": 1, "B": 1, "C": 1}
        assert replay.applied == 3  # the batch's own work, whichever attempt committed it
        assert sink.stats.totals().replayed_batches == 1


def test_the_delta_sink_takes_no_leases_and_another_query_is_not_held_up_by_a_crashed_one(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    ledger_engine: str,
) -> None:
    config = config_for(tmp_path, redis_server.url, "noleases", engine=ledger_engine)
    table = str(tmp_path / "orders")

    def sink(query: str, crash: CrashPlan | None = None) -> ExactlyOnce:
        return ExactlyOnce(
            None, config=config, key="order_id", client=real_redis, sink_table=table,
            query_id=query, crash_plan=crash,
        )  # fmt: skip

    crashed = sink("q1", CrashPlan(CrashPoint.AFTER_CLAIM, 0))
    with pytest.raises(SimulatedCrash):
        crashed.process(_df(spark, "A", "B", "C"), 0)
    # The sink table's commit is checked against the ledger, so the crashed batch left
    # nothing in Redis that holds its keys: another query writes them at once.
    assert not list(real_redis.scan_iter("idem:{noleases:*}:p:*"))
    other = sink("q2").process(_df(spark, "B", "C", "D"), 0)
    assert other.busy == 0
    assert other.applied == 3
    replay = sink("q1").process(_df(spark, "A", "B", "C"), 0)  # Spark replays q1's batch 0
    assert replay.applied == 1
    assert replay.duplicates == {"completed": 2}
    assert sink_key_counts(tmp_path / "orders") == {"A": 1, "B": 1, "C": 1, "D": 1}
    # A function sink still holds its keys while it runs (sharing the group, it shares the
    # ledger: a group's index covers one).
    recorder = Recorder()
    shared_ledger = config.with_changes(ledger_path=table)
    held = exactly_once(key="order_id", config=shared_ledger, client=real_redis)(recorder)
    held.query_id = "q3"
    held.crash_plan = CrashPlan(CrashPoint.AFTER_SINK, 0)
    with pytest.raises(SimulatedCrash):
        held.process(_df(spark, "E"), 0)
    assert list(real_redis.scan_iter("idem:{noleases:*}:p:*"))
    assert sink("q4").process(_df(spark, "E"), 0).busy == 1
    # So does the Delta sink when asked to (a function sink shares its group).
    shared = ExactlyOnce(
        None, config=config, key="order_id", client=real_redis, sink_table=table,
        query_id="q5", crash_plan=CrashPlan(CrashPoint.AFTER_CLAIM, 0), leases=True,
    )  # fmt: skip
    with pytest.raises(SimulatedCrash):
        shared.process(_df(spark, "F"), 0)
    assert sink("q6").process(_df(spark, "F"), 0).busy == 1


def test_idem_run_with_leases_holds_a_crashed_batchs_keys_against_a_function_sink(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    write_files(tmp_path / "in", [[order(1), order(2)]])
    config = config_for(tmp_path, redis_server.url, "leasedrun")
    args = parse_args(
        ["run", "--source", str(tmp_path / "in"), "--key", "order_id", "--group", "leasedrun",
         "--sink-delta", str(tmp_path / "orders"), "--checkpoint", str(tmp_path / "cp"),
         "--available-now", "--leases"]
    )  # fmt: skip
    pipeline = Pipeline(
        spark, config, run_spec(args), client=real_redis,
        crash_plan=CrashPlan(CrashPoint.AFTER_CLAIM, 0),
    )  # fmt: skip
    with pytest.raises(QueryFailed, match="simulated driver crash at after_claim"):
        pipeline.run()
    pipeline.close()
    # The crashed run's leases still hold its keys: a function sink of the group (keeping
    # its done-records in the same ledger, as a group's index covers one) waits.
    recorder = Recorder()
    shared_ledger = config.with_changes(ledger_path=str(tmp_path / "orders"))
    other = exactly_once(key="order_id", config=shared_ledger, client=real_redis)(recorder)
    other.query_id = "fn"
    assert other.process(_df(spark, "ORDERID_1", "ORDERID_3"), 0).busy == 1
    assert [r["order_id"] for r in recorder.rows] == ["ORDERID_3"]


def test_a_function_sink_sees_a_replayed_batch_again_with_the_same_idempotency_keys(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "repeat")
    recorder = Recorder()
    sink = exactly_once(key="order_id", config=config, client=real_redis,
                        idempotency_column="idem_key")(recorder)  # fmt: skip
    sink.query_id = "q"
    sink.crash_plan = CrashPlan(CrashPoint.AFTER_SINK, 0)
    with pytest.raises(SimulatedCrash):
        sink.process(_df(spark, "A", "B"), 0)
    replay = sink.process(_df(spark, "A", "B"), 0)
    sink.process(_df(spark, "A", "B"), 1)  # a later batch with the same keys: duplicates

    seen = [r["order_id"] for r in recorder.rows]  # a DataFrame's rows come in no set order
    assert len(seen) == 4
    assert sorted(seen[:2]) == sorted(seen[2:]) == ["A", "B"]
    assert {r["idem_key"] for r in recorder.rows} == {"repeat:A", "repeat:B"}
    assert replay.retaken == 2
    assert sink.stats.totals().possible_repeats == 2


def test_failed_keys_are_sent_back_and_an_exception_fails_every_fresh_row(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "failing")
    recorder = Recorder(fail={"B"})
    sink = exactly_once(key="order_id", config=config, client=real_redis)(recorder)
    sink.query_id = "q"
    outcome = sink.process(_df(spark, "A", "B"), 0)
    assert outcome.applied_keys == ("A",)
    assert outcome.failed_keys == ("B",)
    assert outcome.retried_by_level == {3: 1}

    def broken(fresh: DataFrame, batch_id: int) -> None:
        raise ConnectionError("warehouse is down")

    sink_down = exactly_once(key="order_id", config=config, client=real_redis)(broken)
    sink_down.query_id = "q2"
    down = sink_down.process(_df(spark, "C", "D", "A"), 0)
    assert down.applied == 0
    assert sorted(down.failed_keys) == ["C", "D"]
    assert down.duplicates == {"completed": 1}
    engine = RetryEngine(config, client=real_redis)
    assert engine.pending() == 3  # B, C and D wait on their delay level


def test_failed_rows_returned_as_collected_rows_are_retried_not_committed(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """``df.collect()`` of the failed rows (a list of Rows) matched no key: the rows were
    committed as done and never retried, with only a warning in the log."""
    config = config_for(tmp_path, redis_server.url, "collected")

    def collected(fresh: DataFrame, batch_id: int) -> list[Any]:
        return fresh.where("order_id = 'B'").collect()

    sink = exactly_once(key="order_id", config=config, client=real_redis)(collected)
    sink.query_id = "q"
    outcome = sink.process(_df(spark, "A", "B"), 0)
    assert outcome.applied_keys == ("A",)
    assert outcome.failed_keys == ("B",)
    assert RetryEngine(config, client=real_redis).pending() == 1

    def keyless(fresh: DataFrame, batch_id: int) -> list[Any]:
        return fresh.select("amount").collect()

    sink = exactly_once(key="order_id", config=config, client=real_redis)(keyless)
    sink.query_id = "q2"
    with pytest.raises(ConfigError, match="sink result: a returned Row has no key column"):
        sink.process(_df(spark, "C"), 0)


def test_a_column_of_the_users_named_reconsume_times_is_refused_not_dropped(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """It was taken for the retry stream's and left out of the payload: the Delta sink
    table had no such column, and fingerprints and retried bodies lacked it."""
    config = config_for(tmp_path, redis_server.url, "own-column")
    sink = delta_sink(str(tmp_path / "sink"), key="id", config=config, client=real_redis)
    sink.query_id = "q"
    df = spark.createDataFrame([("A", 5)], "id string, reconsume_times int")
    with pytest.raises(ConfigError, match="reconsume_times: the batch has this column but not"):
        sink.process(df, 0)
    assert not (tmp_path / "sink").exists()  # refused before anything was claimed or written


def test_an_idempotency_column_the_rows_already_have_is_refused(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The sink got two columns of that name: any reference to it failed as ambiguous,
    every row climbed the retry ladder and ended in the DLQ."""
    config = config_for(tmp_path, redis_server.url, "two-keys")
    recorder = Recorder()
    sink = exactly_once(
        key="order_id", config=config, client=real_redis, idempotency_column="order_ref"
    )(recorder)
    sink.query_id = "q"
    df = spark.createDataFrame([("A", "mine")], "order_id string, order_ref string")
    with pytest.raises(ConfigError, match="idempotency_column: the rows already have a column"):
        sink.process(df, 0)
    assert recorder.rows == []
    assert RetryEngine(config, client=real_redis).pending() == 0


def test_a_replay_that_fails_other_rows_than_the_first_attempt_retries_them_too(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first attempt fails A, sends it back, and dies before sending back B, which
    another owner held (busy). In Spark's replay B is free and the sink fails it. B must
    be journaled and retried, not counted as done because the batch's send-back txn was
    committed by the first attempt (with A only)."""
    config = config_for(tmp_path, redis_server.url, "flaky-replay")
    other = Dedup(config, client=real_redis)
    held = other.begin(["B"], owner="other:0")
    failing = iter([{"A"}, {"B"}])
    calls: list[list[str]] = []

    def flaky(fresh: DataFrame, batch_id: int) -> list[str]:
        keys = [r["order_id"] for r in fresh.toArrow().to_pylist()]
        calls.append(keys)
        fail = next(failing)
        return [k for k in keys if k in fail]

    def dies(*args: Any, **kwargs: Any) -> None:
        raise SimulatedCrash("the driver died between the two send-backs")

    sink = exactly_once(key="order_id", config=config, client=real_redis)(flaky)
    sink.query_id = "q"
    batch = _df(spark, "A", "B", "C")
    monkeypatch.setattr(sink.retry, "send_back_busy", dies)
    with pytest.raises(SimulatedCrash):
        sink.process(batch, 0)
    monkeypatch.undo()
    other.release(held)  # the other owner gives B up before the replay
    replay = sink.process(batch, 0)
    assert [sorted(c) for c in calls] == [["A", "C"], ["A", "B"]]
    assert replay.failed_keys == ("B",)
    engine = RetryEngine(config, client=real_redis)
    assert engine.pending() == 2  # A from the first attempt, B from the replay
    real_redis.flushall()  # and both are in the journal, not only in Redis
    engine.tick()
    assert engine.pending() == 2


def test_close_lands_the_last_batchs_redis_update_so_nobody_reloads_it(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "closing")
    sink = delta_sink(str(tmp_path / "orders"), key="order_id", config=config, client=real_redis)
    sink.query_id = "q1"
    sink.process(_df(spark, "A", "B", "C"), 0)  # its Redis update runs in the background
    sink.close()
    # another query of the group (its ledger is the sink table), not waiting for writers
    ledger = config.with_changes(ledger_path=str(tmp_path / "orders"))
    other = Dedup(ledger, client=real_redis, catch_up_grace_ms=0)
    seen = other.begin(["A", "B", "C"], owner="q2:0")
    assert len(seen.duplicates) == 3
    assert other.stats.caught_up_keys == 0  # Redis knew them: nothing reloaded from the ledger


def test_failed_rows_come_back_through_the_retry_stream_with_their_typed_columns(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "stream")
    sink = exactly_once(key="order_id", config=config, client=real_redis)(Recorder(fail={"X"}))
    sink.query_id = "q"
    sink.process(_df(spark, "X", "Y", amount="12.34"), 0)
    engine = RetryEngine(config, client=real_redis)
    due = engine.next_due_ms()
    assert due is not None
    engine.clock.sleep(max(0, due - engine.clock.now_ms()) / 1000 + 0.05)

    got: list[dict[str, Any]] = []
    query = (
        retry_stream(spark, schema=SCHEMA, config=config)
        .writeStream.foreachBatch(lambda df, _bid: got.extend(df.toArrow().to_pylist()))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    [row] = got
    assert row["order_id"] == "X"
    assert row["amount"] == Decimal("12.34")
    assert row["placed_at"] == dt.datetime(2024, 5, 1, 10, 0, 0, 123456, tzinfo=dt.UTC)
    assert row["tags"] == ["a", "X"]
    assert row["reconsume_times"] == 1


def test_a_completed_key_with_a_different_payload_is_dead_lettered_when_asked(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(
        tmp_path, redis_server.url, "mismatch", mismatch_policy=MismatchPolicy.DEAD_LETTER
    )
    sink = ExactlyOnce(
        None, config=config, key="order_id", client=real_redis,
        sink_table=str(tmp_path / "orders"), query_id="q",
    )  # fmt: skip
    sink.process(_df(spark, "A", "B"), 0)
    later = sink.process(_df(spark, "A", amount="10.00"), 1)  # same key, other payload
    sink.process(_df(spark, "B"), 2)  # same key, same payload: a plain duplicate
    assert later.mismatched == 1
    assert later.dead == 1
    [letter] = dead_letters(config)
    assert letter.key == "A"
    assert "payload_mismatch" in (letter.last_error or "")
    assert sink_key_counts(tmp_path / "orders") == {"A": 1, "B": 1}


def test_a_fresh_copy_and_its_retry_in_one_batch_keep_the_retry_chain_going(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "chain", max_reconsume_times=3)
    sink = exactly_once(key="order_id", config=config, client=real_redis)(Recorder(fail={"P"}))
    sink.query_id = "q"
    sink.process(_df(spark, "P"), 0)  # fails: P waits on its first retry
    engine = RetryEngine(config, client=real_redis)
    due = engine.next_due_ms()
    assert due is not None
    engine.clock.sleep(max(0, due - engine.clock.now_ms()) / 1000 + 0.05)
    engine.tick()
    [retried] = engine.poll_retry("test", 10)
    codec = RowCodec(SCHEMA)
    retry_schema = st.StructType(
        [*SCHEMA.fields, st.StructField("reconsume_times", st.IntegerType()),
         st.StructField("_idem_message", st.StringType())]
    )  # fmt: skip
    rows = [
        (*_rows("P")[0], None, None),  # the message delivered again by the source
        (*codec.decode(retried.body), retried.reconsume_times, retried.to_wire()),
    ]
    outcome = sink.process(spark.createDataFrame(rows, retry_schema), 1)

    assert outcome.failed_keys == ("P",)
    assert outcome.duplicates == {"in_batch": 1}
    # The retry (reconsume_times 1) was kept and sent back as the chain's next message.
    assert engine.pending() == 1
    assert outcome.retried_by_level == {3: 1}


def test_a_busy_key_comes_back_without_counting_toward_the_dead_letter_limit(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "busy", max_reconsume_times=1)
    other = Dedup(config, client=real_redis)
    held = other.begin(["K"], owner="other-query:0")  # another query holds K (live lease)
    recorder = Recorder()
    sink = exactly_once(key="order_id", config=config, client=real_redis)(recorder)
    sink.query_id = "q"
    engine = RetryEngine(config, client=real_redis)
    codec = RowCodec(SCHEMA)
    retry_schema = st.StructType(
        [*SCHEMA.fields, st.StructField("reconsume_times", st.IntegerType()),
         st.StructField("_idem_message", st.StringType())]
    )  # fmt: skip

    def redeliver() -> DataFrame:
        due = engine.next_due_ms()
        assert due is not None
        engine.clock.sleep(max(0, due - engine.clock.now_ms()) / 1000 + 0.05)
        engine.tick()
        [back] = engine.poll_retry("test", 10)
        assert back.reconsume_times == 0  # busy is not a failure: nothing counted
        row = (*codec.decode(back.body), back.reconsume_times, back.to_wire())
        return spark.createDataFrame([row], retry_schema)

    outcome = sink.process(_df(spark, "K"), 0)
    assert outcome.busy == 1
    for batch_id in (1, 2, 3):  # busy three times, more than max_reconsume_times
        assert sink.process(redeliver(), batch_id).busy == 1
    assert dead_letters(config) == []
    other.release(held)  # the other query failed K and gave it back
    done = sink.process(redeliver(), 4)
    assert done.applied == 1
    assert [r["order_id"] for r in recorder.rows] == ["K"]
    assert engine.pending() == 0


def test_a_replay_that_accepts_a_row_the_first_attempt_rejected_still_writes_it(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Spark replays a batch under the same id; the sink's verdicts may differ the second time."""
    config = config_for(tmp_path, redis_server.url, "verdicts")
    calls: list[int] = []

    def fail_a_once(fresh: DataFrame, batch_id: int) -> list[str]:
        calls.append(batch_id)
        return ["A"] if len(calls) == 1 else []

    sink = delta_sink(
        str(tmp_path / "orders"), key="order_id", config=config, client=real_redis,
        validate=fail_a_once,
    )  # fmt: skip
    sink.query_id = "q"
    sink.crash_plan = CrashPlan(CrashPoint.AFTER_COMMIT, 0)  # B committed, A not yet sent back
    with pytest.raises(SimulatedCrash):
        sink.process(_df(spark, "A", "B"), 0)
    sink.process(_df(spark, "A", "B"), 0)
    assert sink_key_counts(tmp_path / "orders") == {"A": 1, "B": 1}


def test_fingerprints_keep_sparks_hex_form_and_copies_share_a_message_id(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Spark ships the 64-bit hashes and Arrow makes their text: the fingerprints must stay
    what ``hex(xxhash64(...))`` stored before (keys completed then still compare equal),
    and a redelivered copy of a row must get the same message id as the original."""
    hashes = spark.range(2000).select(
        F.xxhash64("id").alias("h"), F.hex(F.xxhash64("id")).alias("spark_hex")
    )
    edges = spark.createDataFrame(
        [(v, format(v & (2**64 - 1), "X")) for v in (0, 1, 15, 16, -1, -(2**63), 2**63 - 1)],
        "h long, spark_hex string",
    )
    table = hashes.unionByName(edges).toArrow()
    assert spark_hex(table.column("h")).to_pylist() == table.column("spark_hex").to_pylist()

    config = config_for(tmp_path, redis_server.url, "ids")
    sink = delta_sink(str(tmp_path / "orders"), key="order_id", config=config, client=real_redis)
    sink.query_id = "q"
    sink.process(_df(spark, "A", "B"), 0)
    rows = {r["key"]: r for r in sink_rows(tmp_path / "orders")}
    expected = (
        _df(spark, "A", "B")
        .select("order_id", F.hex(fingerprint_hash(SCHEMA)).alias("fp"))
        .toArrow()
        .to_pylist()
    )
    assert {r["order_id"]: r["fp"] for r in expected} == {
        k: r["fingerprint"] for k, r in rows.items()
    }
    assert all(len(r["msg_id"]) == 32 for r in rows.values())

    # A copy of A in another group fails and is sent back: same key and payload, same id.
    other = config.with_changes(group="ids-2")
    copy = exactly_once(key="order_id", config=other, client=real_redis)(Recorder(fail={"A"}))
    copy.query_id = "q2"
    copy.process(_df(spark, "A"), 0)
    engine = RetryEngine(other, client=real_redis)
    due = engine.next_due_ms()
    assert due is not None
    engine.clock.sleep(max(0, due - engine.clock.now_ms()) / 1000 + 0.05)
    engine.tick()
    [message] = engine.poll_retry("test", 10)
    assert message.origin_msg_id == rows["A"]["msg_id"]  # a resend keeps ORIGIN_MESSAGE_ID


def test_the_sql_fingerprint_is_the_column_formula_earlier_versions_stored(
    spark: SparkSession,
) -> None:
    """The fingerprint is one SQL projection now (one py4j call); its values must be those
    of the Column formula the ledger and Redis hold from before, for odd names and maps."""
    schema = st.StructType(
        [
            *SCHEMA.fields,
            st.StructField("a`b c", st.StringType()),
            st.StructField("attrs", st.MapType(st.StringType(), st.LongType())),
        ]
    )
    rows = [(*r, "x", {"k": 1}) for r in _rows("A", "B")] + [(None,) * len(schema.fields)]
    df = spark.createDataFrame(rows, schema)
    cols = [F.col("`" + f.name.replace("`", "``") + "`") for f in schema.fields]
    values = [
        F.to_json(c) if isinstance(f.dataType, st.MapType) else c
        for c, f in zip(cols, schema.fields, strict=True)
    ]
    earlier = F.xxhash64(*values, *(c.isNull() for c in cols))
    both = df.select(fingerprint_hash(schema).alias("now"), earlier.alias("before")).toArrow()
    assert len(set(both.column("now").to_pylist())) == 3
    assert both.column("now").to_pylist() == both.column("before").to_pylist()


def test_column_names_with_backticks_and_spaces_work_as_key_and_payload(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Spark SQL needs such names quoted with doubled backticks; a sink returning a
    DataFrame of failed rows is read back by that name too."""
    seen: list[dict[str, Any]] = []

    def sink(fresh: DataFrame, batch_id: int) -> DataFrame:
        seen.extend(fresh.toArrow().to_pylist())
        return fresh.where(F.col("`my value`") < 0)

    config = config_for(tmp_path, redis_server.url, "quoted")
    wrapped = exactly_once(key="order`id", config=config, client=real_redis)(sink)
    wrapped.query_id = "q"
    rows = spark.createDataFrame(
        [("A", 1), ("B", -1), ("A", 1)], "`order``id` string, `my value` int"
    )
    first = wrapped.process(rows, 0)
    assert sorted(r["order`id"] for r in seen) == ["A", "B"]
    assert first.applied_keys == ("A",)
    assert first.failed_keys == ("B",)
    assert first.duplicates == {"in_batch": 1}
    again = wrapped.process(rows, 1)
    assert again.duplicates == {"in_batch": 1, "completed": 1}
    assert again.failed_keys == ("B",)


def test_on_a_redis_cluster_the_sinks_stay_exactly_once_and_failures_are_retried(
    spark: SparkSession, redis_cluster: LocalCluster, cluster_redis: Any, tmp_path: Path
) -> None:
    """The same decorator, built from a ``redis+cluster://`` URL: nothing else changes."""
    config = config_for(tmp_path, redis_cluster.url, "clustered", buckets=16)
    sink = delta_sink(str(tmp_path / "orders"), key="order_id", config=config)
    sink.query_id = "q1"
    keys = [f"O{i}" for i in range(300)]
    sink.process(_df(spark, *keys, *keys[:50]), 0)
    second = sink.process(_df(spark, *keys[100:], "O-new"), 1)
    sink.close()
    assert sink_key_counts(tmp_path / "orders") == dict.fromkeys([*keys, "O-new"], 1)
    assert second.duplicates == {"completed": 200}

    recorder = Recorder(fail={"O-new"})
    fn_sink = exactly_once(key="order_id", config=config.with_changes(group="clustered-fn"))(
        recorder
    )
    fn_sink.query_id = "q2"
    outcome = fn_sink.process(_df(spark, "O-new", "O1"), 0)
    assert outcome.failed_keys == ("O-new",)
    assert outcome.retried_by_level == {3: 1}
    assert RetryEngine(config.with_changes(group="clustered-fn")).pending() == 1


class CustomerWriter(Recorder):
    """A user's sink object whose attributes share names with the decorator's."""

    def __init__(self) -> None:
        super().__init__()
        self.key = "customer_id"  # the target table's partition key
        self.config = {"table": "orders_by_customer"}
        self.schemas: list[st.StructType] = []

    def __call__(self, fresh: DataFrame, batch_id: int) -> list[str]:
        self.schemas.append(fresh.schema)
        return super().__call__(fresh, batch_id)


def test_a_sink_object_keeps_its_own_attributes_and_gets_the_batchs_column_types(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "object")
    writer = CustomerWriter()
    sink = exactly_once(key="order_id", config=config, client=real_redis,
                        idempotency_column="idem_key")(writer)  # fmt: skip
    sink.query_id = "q"
    at = dt.datetime(2024, 5, 1, 10, 0, 0)
    schema = "order_id string, customer_id string, placed_at timestamp_ntz, note string not null"
    rows = [("O1", "C1", at, "x"), ("O2", "C1", at, "y"), ("O3", "C2", at, "z")]
    outcome = sink.process(spark.createDataFrame(rows, schema), 0)
    # Two orders of one customer are two keys: the decorator's key is order_id.
    assert sorted(r["order_id"] for r in writer.rows) == ["O1", "O2", "O3"]
    assert outcome.applied == 3
    assert (sink.key, writer.key) == ("order_id", "customer_id")
    got = writer.schemas[0]
    assert got["placed_at"].dataType == st.TimestampNTZType()
    assert got["note"].nullable is False
    assert got["idem_key"].dataType == st.StringType()
    assert writer.rows[0]["placed_at"] == at


def test_a_delta_sink_of_rows_that_are_only_their_key_writes_them(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "bare")
    sink = delta_sink(str(tmp_path / "keys"), key="key", config=config, client=real_redis)
    sink.query_id = "q"
    first = sink.process(spark.createDataFrame([("A",), ("B",), ("A",)], "key string"), 0)
    second = sink.process(spark.createDataFrame([("B",), ("C",)], "key string"), 1)
    assert sink_key_counts(tmp_path / "keys") == {"A": 1, "B": 1, "C": 1}
    assert (first.applied, second.applied) == (2, 1)


def test_a_column_clashing_with_the_ledgers_in_another_case_fails_before_any_claim(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "clash")
    sink = ExactlyOnce(None, config=config, key="order_id", client=real_redis,
                       sink_table=str(tmp_path / "orders"), query_id="q", leases=True)  # fmt: skip
    df = spark.createDataFrame([("A", "alice")], "order_id string, Owner string")
    with pytest.raises(ConfigError, match="Owner"):
        sink.process(df, 0)
    # Nothing was claimed: another writer of the group takes A at once.
    assert Dedup(config, client=real_redis).begin(["A"], owner="other:1").fresh == (0,)


def test_a_key_that_is_not_text_is_dead_lettered_under_its_printed_value(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "decimal-keys")
    recorder = Recorder()
    sink = exactly_once(key="order_id", config=config, client=real_redis)(recorder)
    sink.query_id = "q"
    df = spark.createDataFrame([(Decimal("12.50"), "x")], "order_id decimal(10,2), note string")
    outcome = sink.process(df, 0)
    assert outcome.applied == 0
    assert recorder.rows == []
    [letter] = dead_letters(config)
    assert letter.key == "12.50"
    assert "order_id: key must be text, got Decimal" in (letter.last_error or "")
    # The row says why it is dead: the bad key, not the reconsume limit it never reached.
    assert "dead-letter requested" in letter.reason
    assert "order_id: key must be text, got Decimal" in letter.reason
    assert "reconsume times" not in letter.reason
