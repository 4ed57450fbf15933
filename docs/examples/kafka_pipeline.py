"""Orders from a Kafka topic into a Delta table, each order exactly once, with idem.

Run it with Spark's Kafka connector on the classpath, e.g.::

    spark-submit --packages org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0 kafka_pipeline.py

Settings come from the environment: ``KAFKA_BOOTSTRAP_SERVERS`` (``host:port,...``),
``KAFKA_TOPIC``, ``SINK_PATH`` (the Delta table), ``CHECKPOINT_PATH``, and idem's own
``IDEM_GROUP``, ``IDEM_REDIS_URL``, ``IDEM_DATA_DIR`` (where the retry journal and the
dead-letter table live), ``IDEM_DELAY_LEVELS``, ...
"""

from __future__ import annotations

import os

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from pyspark.sql.streaming.readwriter import DataStreamWriter

from idem import IdemConfig
from idem.spark import delta_sink, with_retries

ORDER_SCHEMA = "order_id string, amount double"


def orders_from_kafka(spark: SparkSession, servers: str, topic: str) -> DataFrame:
    """One row per Kafka record: the order parsed from its JSON value, and the record's id."""
    records = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", servers)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .load()
    )
    return records.select(
        F.from_json(F.col("value").cast("string"), ORDER_SCHEMA).alias("order"),
        F.concat_ws("-", "topic", "partition", "offset").alias("kafka_id"),
    ).select("order.*", "kafka_id")


def pipeline(
    spark: SparkSession,
    *,
    servers: str,
    topic: str,
    sink_path: str,
    checkpoint: str,
    config: IdemConfig,
) -> DataStreamWriter:
    """The streaming write: Kafka's orders and the group's retries, each order_id once."""
    orders = orders_from_kafka(spark, servers, topic)
    stream = with_retries(orders, config=config)  # + %RETRY%<group>: rows that failed before
    sink = delta_sink(
        sink_path,
        key="order_id",  # the business key: a producer's resend carries the same one
        msg_id="kafka_id",  # dead letters and the table's msg_id name the Kafka record
        fingerprint=False,  # kafka_id differs between resends of one order: compare keys only
        config=config,
    )
    return stream.writeStream.foreachBatch(sink).option("checkpointLocation", checkpoint)


def main() -> None:
    """Run the pipeline until it is stopped."""
    spark = SparkSession.builder.appName("orders-from-kafka").getOrCreate()
    query = pipeline(
        spark,
        servers=os.environ["KAFKA_BOOTSTRAP_SERVERS"],
        topic=os.environ["KAFKA_TOPIC"],
        sink_path=os.environ["SINK_PATH"],
        checkpoint=os.environ["CHECKPOINT_PATH"],
        config=IdemConfig.from_env(),
    ).start()
    query.awaitTermination()


if __name__ == "__main__":
    main()
