"""A row whose values cannot be read is dead-lettered on its own, with the reason and its
original body; the rest of its batch flows on and the query keeps running.

Real local Spark, a real redis-server and real Delta tables: the retry stream is the one a
job unions, and the rows reach ``@exactly_once`` the way ``foreachBatch`` hands them over.
"""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as st
from spark_helpers import config_for, dead_letters, delta_run, sink_key_counts, sink_rows

from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry.engine import RetryEngine
from idem.spark.decorator import ExactlyOnce, exactly_once
from idem.spark.dlq import Selection, replay
from idem.spark.retry_source import retry_stream
from idem.spark.run import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.spark]


class Keeper:
    """A sink that keeps the rows it is given and fails every one while ``failing``."""

    def __init__(self, *, failing: bool) -> None:
        self.failing = failing
        self.rows: list[dict[str, Any]] = []

    def __call__(self, fresh: DataFrame, batch_id: int) -> list[str]:
        got = fresh.toArrow().to_pylist()
        self.rows += got
        return [r["order_id"] for r in got] if self.failing else []


def _wait_until_due(config: IdemConfig, client: redis.Redis) -> None:
    engine = RetryEngine(config, client=client)
    due = engine.next_due_ms()
    assert due is not None
    engine.clock.sleep(max(0, due - engine.clock.now_ms()) / 1000 + 0.05)


def test_retries_that_no_longer_fit_the_schema_are_dead_lettered_and_the_rest_flow_on(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "schema-change")
    rows = [
        ("A", 2**40, Decimal("1.000")),  # qty no longer fits an int
        ("B", 1, Decimal("9.990")),  # fits: 9.99
        ("C", 2, Decimal("1.234")),  # a third decimal place the new column cannot keep
        ("D", 3, Decimal("2.500")),  # with a map keyed by arrays (Python cannot build one)
    ]
    bins = "IF(order_id = 'D', map(array(1, 2), 3, array(4), 5), NULL) AS bins"
    failed = spark.createDataFrame(rows, "order_id string, qty bigint, price decimal(6,3)")
    failed = failed.selectExpr("*", bins)
    # The job is redeployed: qty is an int now, price keeps 2 places; bins is unchanged.
    after = st.StructType(
        [
            st.StructField("order_id", st.StringType()),
            st.StructField("qty", st.IntegerType()),
            st.StructField("price", st.DecimalType(5, 2)),
            failed.schema["bins"],
        ]
    )
    first = exactly_once(key="order_id", config=config, client=real_redis)(Keeper(failing=True))
    first.query_id = "before"
    assert first.process(failed, 0).failed == 4
    _wait_until_due(config, real_redis)

    # The redeployed job's retry stream brings the rows back.
    keeper, sink = _drain_retries(spark, config, real_redis, after, tmp_path / "checkpoint")

    got = {r["order_id"]: r for r in keeper.rows}
    assert sorted(got) == ["B", "D"]
    assert got["B"]["qty"] == 1
    assert got["B"]["price"] == Decimal("9.99")
    assert sorted(got["D"]["bins"]) == [([1, 2], 3), ([4], 5)]
    letters = {d.key: d for d in dead_letters(config)}
    assert sorted(letters) == ["A", "C"]
    assert "column 'qty': 1099511627776 does not fit int" in (letters["A"].last_error or "")
    assert "column 'price': 1.234 does not fit decimal(5,2)" in (letters["C"].last_error or "")
    assert "key is null" not in (letters["A"].last_error or "")
    # The dead letter keeps the message as it was, with every column's original value.
    assert b'"qty":1099511627776' in letters["A"].body
    assert b'"price":"1.234"' in letters["C"].body
    totals = sink.stats.totals()
    assert (totals.malformed, totals.invalid, totals.applied) == (2, 0, 2)
    assert RetryEngine(config, client=real_redis).pending() == 0


def test_a_retry_whose_value_has_no_column_any_more_is_dead_lettered_not_dropped(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The job renamed ``amount`` to ``amount_cents`` while rows waited for a retry. A row
    with an amount must not reach the sink with ``amount_cents`` null and its amount gone."""
    config = config_for(tmp_path, redis_server.url, "renamed")
    first = exactly_once(key="order_id", config=config, client=real_redis)(Keeper(failing=True))
    first.query_id = "before"
    failed = spark.createDataFrame([("A", 7), ("B", None)], "order_id string, amount int")
    assert first.process(failed, 0).failed == 2
    _wait_until_due(config, real_redis)

    after = st.StructType(
        [
            st.StructField("order_id", st.StringType()),
            st.StructField("amount_cents", st.IntegerType()),
        ]
    )
    keeper, _ = _drain_retries(spark, config, real_redis, after, tmp_path / "checkpoint")

    assert [(r["order_id"], r["amount_cents"]) for r in keeper.rows] == [("B", None)]
    [letter] = dead_letters(config)
    assert letter.key == "A"
    assert "body field 'amount': has a value (7) but the schema has no such column" in (
        letter.last_error or ""
    )
    assert b'"amount":7' in letter.body


def test_a_retry_without_a_value_for_a_column_that_is_not_nullable_is_dead_lettered(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "not-nullable")
    first = exactly_once(key="order_id", config=config, client=real_redis)(Keeper(failing=True))
    first.query_id = "before"
    first.process(spark.createDataFrame([("A",)], "order_id string"), 0)
    _wait_until_due(config, real_redis)

    # The job now has a column that must not be null, which the waiting row never had.
    after = st.StructType(
        [
            st.StructField("order_id", st.StringType()),
            st.StructField("region", st.StringType(), False),
        ]
    )
    keeper, _ = _drain_retries(spark, config, real_redis, after, tmp_path / "checkpoint")
    assert keeper.rows == []
    [letter] = dead_letters(config)
    assert letter.key == "A"
    assert "column 'region': no value, and it is not nullable" in (letter.last_error or "")


def test_a_row_marked_malformed_is_dead_lettered_with_its_reason_and_never_claimed(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "malformed-column")
    keeper = Keeper(failing=False)
    sink = ExactlyOnce(keeper, config=config, key="order_id", client=real_redis)
    sink.query_id = "q"
    schema = "order_id string, qty int, _idem_malformed string"
    df = spark.createDataFrame(
        [("A", None, "column 'qty': 7.5 is not a whole number"), ("B", 2, None)], schema
    )
    outcome = sink.process(df, 0)
    assert (outcome.applied, outcome.malformed, outcome.invalid, outcome.dead) == (1, 1, 0, 1)
    assert keeper.rows == [{"order_id": "B", "qty": 2}]  # no bookkeeping column either
    [letter] = dead_letters(config)
    assert letter.key == "A"
    assert "malformed: column 'qty': 7.5 is not a whole number" in (letter.last_error or "")
    # A is not claimed: a later good copy of it is fresh.
    again = sink.process(spark.createDataFrame([("A", 1, None)], schema), 1)
    assert again.applied_keys == ("A",)


def test_idem_run_dead_letters_a_line_that_is_not_json_for_the_schema_with_the_line_kept(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    truncated = '{"order_id": "ORDERID_8", "amount": 8.0, "note": "trunc'
    wrong_type = '{"order_id": "ORDERID_9", "amount": "abc"}'
    source = tmp_path / "in"
    source.mkdir()
    (source / "part-0000.json").write_text(
        "\n".join(['{"order_id": "ORDERID_7", "amount": 7.0}', truncated, wrong_type]) + "\n",
        encoding="utf-8",
    )
    config = config_for(tmp_path, redis_server.url, "corrupt-lines")
    spec = delta_run(tmp_path, source, schema="order_id string, amount double")
    pipeline = Pipeline(spark, config, spec, client=redis_server.client())
    try:
        report = pipeline.run()
    finally:
        pipeline.close()

    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_7": 1}
    [row] = sink_rows(tmp_path / "sink")
    assert {"_idem_raw_body", "_idem_malformed"}.isdisjoint(row)  # bookkeeping stays out
    letters = sorted(dead_letters(config), key=lambda d: d.body)
    assert [d.body.decode() for d in letters] == [truncated, wrong_type]
    assert [d.key for d in letters] == [None, "ORDERID_9"]  # what Spark could parse of it
    for letter in letters:
        assert "line of part-0000.json is not valid JSON for the schema" in (
            letter.last_error or ""
        )
    assert (report.totals.malformed, report.totals.invalid, report.dead_letters) == (2, 0, 2)
    assert report.pending_retries == 0


def test_a_dead_lettered_line_replayed_after_the_schema_is_fixed_lands_with_extra_fields_ignored(
    spark: SparkSession, redis_server: RedisServer, tmp_path: Path
) -> None:
    """The source ignores a line's fields outside ``--schema``; the replay of a line it
    could not parse did not: it was dead-lettered again for its extra field ("has a value
    but the schema has no such column"), so a malformed line could never be replayed."""
    line = '{"order_id": "ORDERID_9", "amount": 8.5, "qty": "two", "note": "gift wrap"}'
    source = tmp_path / "in"
    source.mkdir()
    (source / "part-0000.json").write_text(
        '{"order_id": "ORDERID_7", "amount": 7.0, "qty": 1}\n' + line + "\n", encoding="utf-8"
    )
    config = config_for(tmp_path, redis_server.url, "fixed-schema")
    client = redis_server.client()

    def run(schema: str) -> None:
        spec = delta_run(tmp_path, source, schema=schema)
        pipeline = Pipeline(spark, config, spec, client=client)
        try:
            pipeline.run()
        finally:
            pipeline.close()

    run("order_id string, amount double, qty int")  # "two" is no int: the line is dead-lettered
    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_7": 1}
    [letter] = dead_letters(config)
    assert letter.body.decode() == line

    replay(RetryEngine(config, client=client), Selection(keys=("ORDERID_9",)))
    _wait_until_due(config, client)
    run("order_id string, amount double")  # the fix: qty is no longer read from the source
    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_7": 1, "ORDERID_9": 1}
    landed = {r["order_id"]: r for r in sink_rows(tmp_path / "sink")}
    assert (landed["ORDERID_9"]["amount"], landed["ORDERID_9"]["qty"]) == (8.5, None)
    assert "note" not in landed["ORDERID_9"]
    [letter] = dead_letters(config)
    assert letter.status.value == "REPLAYED"


def test_text_that_is_not_utf8_is_dead_lettered_not_a_failed_batch(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Spark does not check that its strings are UTF-8 (``CAST(binary AS STRING)``, a
    source line with a stray byte): such a key, or such a line, is dead-lettered, and
    the rest of the batch lands; before, every run of the batch failed on it."""
    config = config_for(tmp_path, redis_server.url, "not-utf8")
    keeper = Keeper(failing=False)
    sink = ExactlyOnce(keeper, config=config, key="order_id", client=real_redis)
    sink.query_id = "q"
    raw = spark.createDataFrame([(bytearray(b"K\xff"),), (bytearray(b"OK"),)], "k binary")
    outcome = sink.process(raw.selectExpr("CAST(k AS STRING) AS order_id"), 0)
    assert (outcome.applied, outcome.invalid) == (1, 1)
    assert keeper.rows == [{"order_id": "OK"}]
    [letter] = dead_letters(config)
    assert "not valid Unicode" in (letter.last_error or "")

    source = tmp_path / "in"
    source.mkdir()
    (source / "part-0000.json").write_bytes(
        b'{"order_id": "U\xff1", "amount": 1}\n{"order_id": "OK1", "amount": 2}\n'
    )
    run_config = config_for(tmp_path / "run", redis_server.url, "not-utf8-run")
    spec = delta_run(tmp_path / "run", source, schema="order_id string, amount double")
    pipeline = Pipeline(spark, run_config, spec, client=redis_server.client())
    try:
        report = pipeline.run()
    finally:
        pipeline.close()
    assert sink_key_counts(tmp_path / "run" / "sink") == {"OK1": 1}
    assert report.dead_letters == 1
    assert len(dead_letters(run_config)) == 1


def test_a_row_that_does_not_fit_the_sink_tables_types_is_dead_lettered_the_rest_land(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    ledger_engine: str,
) -> None:
    """The Delta sink table took its types from its first batch; a later batch brings a
    value that does not fit (text where a double is, a number past an int's range). That
    row is dead-lettered naming the column and the value; the others land, and the commit
    (and so every replay of the batch) does not fail."""
    config = config_for(tmp_path, redis_server.url, "misfits", engine=ledger_engine)
    table = tmp_path / "sink"
    sink = ExactlyOnce(
        None, config=config, key="order_id", client=real_redis, sink_table=str(table)
    )
    sink.query_id = "q"
    first = spark.createDataFrame([("A", 1.5, 7)], "order_id string, amount double, qty int")
    assert sink.process(first, 0).applied == 1
    later = spark.createDataFrame(
        [("B", "2.5", 8), ("C", "abc", 9), ("D", "4", 2**40)],
        "order_id string, amount string, qty bigint",
    )
    outcome = sink.process(later, 1)
    assert (outcome.applied, outcome.dead) == (1, 2)
    assert sink_key_counts(table) == {"A": 1, "B": 1}
    assert {r["order_id"]: r["amount"] for r in sink_rows(table)} == {"A": 1.5, "B": 2.5}
    letters = {d.key: d.last_error or "" for d in dead_letters(config)}
    assert "column 'amount': 'abc' does not fit the sink table's double" in letters["C"]
    assert "column 'qty': 1099511627776 does not fit the sink table's int32" in letters["D"]
    assert "schema_mismatch" in letters["C"]


def test_a_batch_lacking_a_column_or_naming_one_in_another_case_lands_as_delta_writes_it(
    spark: SparkSession, real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    """A later batch lacks the table's ``note`` column, another names ``amount`` as
    ``AMOUNT``. Delta fills a missing nullable column with null, and its names are
    case-insensitive: the commit takes both batches (neither ``number of fields does not
    match`` nor ``Duplicate field name (case-insensitive)``), so no replay fails either."""
    config = config_for(tmp_path, redis_server.url, "columns")
    table = tmp_path / "sink"
    sink = ExactlyOnce(
        None, config=config, key="order_id", client=real_redis, sink_table=str(table)
    )
    sink.query_id = "q"
    first = spark.createDataFrame([("A", 1, "x")], "order_id string, amount int, note string")
    lacking = spark.createDataFrame([("B", 2)], "order_id string, amount int")
    shouting = spark.createDataFrame([("C", 3, "z")], "order_id string, AMOUNT int, note string")
    applied = [sink.process(batch, n).applied for n, batch in enumerate((first, lacking, shouting))]
    assert applied == [1, 1, 1]
    rows = {r["order_id"]: (r["amount"], r["note"]) for r in sink_rows(table)}
    assert rows == {"A": (1, "x"), "B": (2, None), "C": (3, "z")}
    assert dead_letters(config) == []


def _drain_retries(
    spark: SparkSession,
    config: IdemConfig,
    client: redis.Redis,
    schema: st.StructType,
    checkpoint: Path,
) -> tuple[Keeper, ExactlyOnce]:
    """The redeployed job: its retry stream (under ``schema``) through the decorator, until
    nothing is available; returns what reached the sink, and the decorated sink."""
    keeper = Keeper(failing=False)
    sink = exactly_once(key="order_id", config=config, client=client)(keeper)
    query = (
        retry_stream(spark, schema=schema, config=config)
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(120)
    assert query.exception() is None
    return keeper, sink
