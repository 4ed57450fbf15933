"""Helpers of the Kafka tier: order records with a producer's resends, what the topic and
the sink hold, and ``idem run`` against the broker."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltalake import DeltaTable
from kafka_broker import Record, produce
from pyspark.sql import SparkSession

from idem.config import IdemConfig
from idem.ledger import read_table
from idem.retry.dlq import DeadLetter, DeadLetterTable

SCHEMA = "order_id string, amount double"


def order_value(key: str) -> str:
    """The JSON value of order ``key`` (the same text every time it is sent)."""
    return json.dumps({"order_id": key, "amount": float(sum(map(ord, key)) % 97)})


def resent_orders(keys: list[str], *, seed: int, partitions: int = 3) -> list[Record]:
    """Each key sent 2-4 times, its copies at random places of the stream and partitions
    (a producer that resends after time-outs), the same value each time."""
    rng = random.Random(seed)
    records: list[Record] = []
    for key in keys:
        copies = rng.randint(2, 4)
        records += [(key, order_value(key), rng.randrange(partitions)) for _ in range(copies)]
    rng.shuffle(records)
    return records


def config(tmp_path: Path, url: str, group: str, engine: str, **extra: Any) -> IdemConfig:
    """A test config: the given Delta engine, short delay levels, tables under ``tmp_path``."""
    settings: dict[str, Any] = {
        "engine": engine,
        "delay_levels": "1s 1s 1s",
        "max_reconsume_times": 2,
        "buckets": 4,
        **extra,
    }
    return IdemConfig(group=group, redis_url=url, data_dir=str(tmp_path / "idem-data"), **settings)


def sink_counts(path: str | Path) -> Counter[str]:
    """How often each key is in a Delta sink table."""
    return Counter(read_table(DeltaTable(str(path)), ["key"]).column("key").to_pylist())


def sink_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a Delta sink table."""
    rows: list[dict[str, Any]] = read_table(DeltaTable(str(path))).to_pylist()
    return rows


def dead_letters(cfg: IdemConfig) -> list[DeadLetter]:
    """The group's ``%DLQ%<group>`` rows."""
    return DeadLetterTable(cfg.resolved_dlq_path, cfg.group).list()


def topic_values(spark: SparkSession, bootstrap: str, topic: str) -> dict[str, str | None]:
    """``{"<topic>-<partition>-<offset>": value}`` of every record in ``topic``."""
    records = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .load()
        .selectExpr("topic", "partition", "offset", "CAST(value AS STRING) AS value")
        .collect()
    )
    return {f"{r['topic']}-{r['partition']}-{r['offset']}": r["value"] for r in records}


@dataclass(frozen=True)
class KafkaCase:
    """One test's topic on the shared broker, its Redis, Delta engine and directory."""

    spark: SparkSession
    bootstrap: str
    topic: str
    redis_url: str
    engine: str
    tmp_path: Path

    @property
    def source(self) -> str:
        """``idem run``'s ``--source`` for the topic."""
        return f"kafka://{self.bootstrap}/{self.topic}"

    def config(self, name: str) -> IdemConfig:
        """A config for group ``<name>-<topic>`` on this case's engine and Redis."""
        return config(self.tmp_path, self.redis_url, f"{name}-{self.topic}", self.engine)

    def produce(self, records: list[Record]) -> None:
        """Write ``records`` to the topic."""
        produce(self.spark, self.bootstrap, self.topic, records)
