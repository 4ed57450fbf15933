"""The documented Spark job (``docs/examples/kafka_pipeline.py``) runs against a real broker:
a producer's resends land in its Delta table once, a poison record in the DLQ once."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from kafka_broker import Record
from kafka_helpers import KafkaCase, dead_letters, resent_orders, sink_counts, topic_values

pytestmark = [pytest.mark.integration, pytest.mark.spark]

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "kafka_pipeline.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kafka_pipeline", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_kafka_job_writes_each_order_once(case: KafkaCase) -> None:
    keys = [f"ORDERID_{i}" for i in range(100)]
    poison: Record = (None, "not an order", 0)
    case.produce([*resent_orders(keys, seed=7), poison])
    config = case.config("example")
    sink = case.tmp_path / "sink"

    writer = _example().pipeline(
        case.spark,
        servers=case.bootstrap,
        topic=case.topic,
        sink_path=str(sink),
        checkpoint=str(case.tmp_path / "checkpoint"),
        config=config,
    )
    query = writer.trigger(availableNow=True).start()
    try:
        assert query.awaitTermination(240)
    finally:
        query.stop()
    assert query.exception() is None

    assert sink_counts(sink) == dict.fromkeys(keys, 1)
    letters = dead_letters(config)
    assert len(letters) == 1
    assert "key is null" in (letters[0].last_error or "")
    assert topic_values(case.spark, case.bootstrap, case.topic)[letters[0].msg_id] == poison[1]
