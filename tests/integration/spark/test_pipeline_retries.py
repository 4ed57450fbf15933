"""Failed rows go round RocketMQ's ladder; poison and bad rows end in ``%DLQ%<group>``.

One pipeline run (local Spark, real redis-server, real Delta tables, delay
levels "1s 1s 1s", max_reconsume_times 2) with a sink that fails some keys
transiently and one key always; the tests read what a user would look at.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from spark_helpers import config_for, dead_letters, delta_run, order, sink_key_counts, write_files

from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry.dlq import DeadLetter
from idem.spark.run import Pipeline, RunReport

pytestmark = [pytest.mark.integration, pytest.mark.spark]

FLAKY = {"ORDERID_2": 1, "ORDERID_5": 2}
"""Key -> deliveries that fail before the sink accepts it."""
POISON = "ORDERID_4"


class FlakySink:
    """Fails FLAKY keys on their first deliveries and POISON always; records every attempt."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()

    def __call__(self, fresh: DataFrame, batch_id: int) -> dict[str, str]:
        failed: dict[str, str] = {}
        for row in fresh.select("order_id", "reconsume_times").toArrow().to_pylist():
            key, times = row["order_id"], row["reconsume_times"]
            self.attempts[key] += 1
            if key == POISON:
                failed[key] = "ValueError: cannot price this order"
            elif times < FLAKY.get(key, 0):
                failed[key] = "TimeoutError: downstream timed out"
            else:
                self.accepted[key] += 1
        return failed


@dataclass
class Outcome:
    config: IdemConfig
    sink: FlakySink
    report: RunReport
    sink_path: Path
    letters: list[DeadLetter]


@pytest.fixture(scope="module")
def outcome(
    spark: SparkSession, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Outcome:
    tmp = tmp_path_factory.mktemp("retries")
    client = redis_server.client()
    client.flushall()
    write_files(
        tmp / "in",
        [
            [order(1), order(2), order(3), order(4)],
            [order(5), order(6), order(6), {"order_id": None, "amount": 1.0}],
            [order(7), {"order_id": "", "amount": 2.0}, order(4)],  # the poison one redelivered
        ],
    )
    config = config_for(tmp, redis_server.url, "retries")
    sink = FlakySink()
    spec = delta_run(tmp, max_files_per_trigger=1)
    report = Pipeline(spark, config, spec, sink_fn=sink, client=client).run()
    return Outcome(config, sink, report, tmp / "sink", dead_letters(config))


def test_transient_failures_succeed_on_a_later_level_with_no_duplicate(outcome: Outcome) -> None:
    counts = sink_key_counts(outcome.sink_path)
    assert counts == {f"ORDERID_{n}": 1 for n in (1, 2, 3, 5, 6, 7)}
    # The sink saw the flaky keys once per delivery until it accepted them, then never again.
    assert outcome.sink.attempts["ORDERID_2"] == 2
    assert outcome.sink.attempts["ORDERID_5"] == 3
    assert outcome.sink.accepted == {f"ORDERID_{n}": 1 for n in (1, 2, 3, 5, 6, 7)}
    # Retries went to the level the ladder gives (3 + reconsume_times, clamped to 3 here):
    # one per failed delivery (flaky 1 + 2, poison 2, its redelivered copy maybe 1).
    levels = outcome.report.totals.retried_by_level
    assert set(levels) == {3}
    assert levels[3] in (5, 6)
    assert outcome.report.pending_retries == 0


def test_a_poison_row_ends_as_one_dlq_row_after_max_reconsume_times(outcome: Outcome) -> None:
    # It was redelivered while it waited for a retry: the copy is the same message
    # (same key and payload), joins the same retry chain and adds no DLQ row.
    poison = [d for d in outcome.letters if d.key == POISON]
    assert len(poison) == 1
    letter = poison[0]
    assert letter.reconsume_times == outcome.config.max_reconsume_times
    assert outcome.sink.attempts[POISON] >= outcome.config.max_reconsume_times + 1
    assert "cannot price this order" in (letter.last_error or "")
    assert len(letter.errors) == outcome.config.max_reconsume_times + 1
    assert POISON not in sink_key_counts(outcome.sink_path)


def test_rows_with_bad_keys_go_to_the_dlq_at_once_with_their_reason(outcome: Outcome) -> None:
    bad = [d for d in outcome.letters if d.key != POISON]
    assert sorted((d.key or "") for d in bad) == ["", ""]
    reasons = sorted(d.last_error or "" for d in bad)
    assert "null" in reasons[0] + reasons[1]
    assert "empty" in reasons[0] + reasons[1]
    assert all(d.reconsume_times == 0 for d in bad)
    assert outcome.report.totals.invalid == 2
    assert outcome.report.dead_letters == 3
