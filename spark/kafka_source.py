"""``idem run``'s Kafka source: ``--source kafka://HOST:PORT[,HOST:PORT...]/TOPIC``.

The topic is read with Spark's own Kafka connector (``spark-sql-kafka-0-10``, which
must be on the session's classpath); ``--kafka-option KEY=VALUE`` settings go to its
reader as they are (``startingOffsets``, ``maxOffsetsPerTrigger``,
``kafka.security.protocol``, ...). ``startingOffsets`` is ``earliest`` unless given: a
first run takes what the topic holds. Each record's value is JSON parsed with
``--schema`` (required: a stream has no files to infer it from; it is kept in the
checkpoint as for files); the business key is a field of the value (``--key``), not
the record's Kafka key.

A record's message id is ``<topic>-<partition>-<offset>``: the dead letters, the
retries and the ledger's ``msg_id`` name the record they came from. A producer's
resend is another record (another offset) with the same business key, which the
dedup layer suppresses. The id rides in a bookkeeping column, so it is neither part
of the payload's fingerprint (a resend is the same payload) nor a column of the sink.

A value that is not JSON for the schema keeps its text in ``_idem_raw_body`` and says
why in ``_idem_malformed``, as a file source's line does: it is dead-lettered with the
value as its body. So is a null (a tombstone) or empty value, its body the row of
nulls. A value without the key field, or with a null one, is a bad key: dead-lettered
with that reason, as for any source.

With ``--available-now`` the run takes the records there when it starts, then waits for
the retries they caused; records that arrive meanwhile are taken too (a directory
source leaves new files for the next run), so ``--timeout`` bounds a busy topic's run.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from pyspark.errors import AnalysisException
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention
from pyspark.sql.types import StringType, StructField, StructType

from idem.errors import ConfigError
from idem.spark.file_source import SCHEMA_FILE, source_schema
from idem.spark.messages import MALFORMED_COLUMN, RAW_BODY_COLUMN, SOURCE_ID_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

SCHEME: Final = "kafka://"

CONNECT_TIMEOUT_S: Final = 3.0
"""How long the start-up check waits for a TCP connection to each bootstrap server."""

DEFAULT_OPTIONS: Final = {"startingOffsets": "earliest"}
"""Reader settings idem chooses when ``--kafka-option`` does not: a first run reads the
topic from its start (Spark's own default, ``latest``, would skip what is there)."""

_RESERVED: Final = {
    "kafka.bootstrap.servers": "the servers are named in --source kafka://HOST:PORT/TOPIC",
    "subscribe": "the topic is named in --source kafka://HOST:PORT/TOPIC",
    "subscribepattern": "the topic is named in --source kafka://HOST:PORT/TOPIC",
    "assign": "the topic is named in --source kafka://HOST:PORT/TOPIC",
}
"""Reader settings ``--source`` makes (lower case: Spark's option names ignore case)."""

CONNECTOR_HINT: Final = (
    "Spark's Kafka connector is not on the classpath: add org.apache.spark:"
    "spark-sql-kafka-0-10_2.13 matching your Spark (e.g. --spark-conf "
    "spark.jars.packages=org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0, or the jars "
    "of deploy/jars with --spark-conf spark.jars=...)"
)


@dataclass(frozen=True)
class KafkaSource:
    """The bootstrap servers and the topic of a ``kafka://`` source."""

    servers: tuple[tuple[str, int], ...]
    topic: str

    @property
    def bootstrap(self) -> str:
        """``host:port,host:port`` as Kafka's ``bootstrap.servers`` takes it."""
        return ",".join(f"{host}:{port}" for host, port in self.servers)


def is_kafka(source: str) -> bool:
    """Whether ``--source`` names a Kafka topic (``kafka://...``)."""
    return source.lower().startswith(SCHEME)


def parse_source(source: str) -> KafkaSource:
    """``kafka://HOST:PORT[,HOST:PORT...]/TOPIC``, or a :class:`ConfigError` naming the part."""
    rest = source[len(SCHEME) :]
    servers_text, sep, topic = rest.partition("/")
    form = "kafka://HOST:PORT[,HOST:PORT...]/TOPIC"
    if not sep or not topic:
        raise ConfigError(f"--source: {source!r} names no topic; write {form}")
    if "/" in topic or not topic.strip() or topic != topic.strip():
        raise ConfigError(f"--source: {topic!r} is not a Kafka topic name ({form})")
    servers: list[tuple[str, int]] = []
    for part in servers_text.split(","):
        host, colon, port_text = part.strip().rpartition(":")
        host = host.strip("[]")  # [::1]:9092
        if not colon or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ConfigError(
                f"--source: {part.strip()!r} is not HOST:PORT (a port 1-65535) in {form}"
            )
        servers.append((host, int(port_text)))
    return KafkaSource(servers=tuple(servers), topic=topic)


def parse_options(pairs: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` settings of the Kafka reader, checked; a :class:`ConfigError` names
    ``--kafka-option`` and the setting that is malformed or made by ``--source``."""
    options: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"--kafka-option: {pair!r} must look like KEY=VALUE")
        why = _RESERVED.get(name.lower())
        if why is not None:
            raise ConfigError(f"--kafka-option: {name} cannot be set here: {why}")
        options[name] = value
    return options


def check_reachable(source: KafkaSource, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """At least one bootstrap server takes a TCP connection within ``timeout`` seconds.

    Kafka's client would otherwise retry an unreachable server for minutes inside the
    query. One reachable server is enough (the client learns the cluster from it); the
    others are named in a warning.
    """
    failures: list[str] = []
    for host, port in source.servers:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                pass
        except OSError as exc:
            failures.append(f"{host}:{port} ({exc.strerror or exc})")
    if len(failures) == len(source.servers):
        raise ConfigError(
            f"--source: cannot reach the Kafka broker{'s' if len(failures) > 1 else ''} "
            f"{', '.join(failures)} within {timeout:g} s"
        )
    if failures:
        log.warning("Kafka bootstrap server(s) not reachable: %s", ", ".join(failures))


def kafka_schema(
    spark: SparkSession,
    *,
    ddl: str | None,
    checkpoint: str,
    fields: Mapping[str, str | None],
) -> StructType:
    """The values' schema: ``--schema``, else the one kept in the checkpoint by a run before."""
    if not ddl and not (Path(checkpoint) / SCHEMA_FILE).is_file():
        raise ConfigError(
            "--schema: required with a kafka:// source (a stream has no files to infer the "
            "fields from), e.g. --schema 'order_id string, amount double'"
        )
    return source_schema(spark, source="", ddl=ddl, checkpoint=checkpoint, fields=fields)


def kafka_rows(
    spark: SparkSession,
    schema: StructType,
    *,
    source: KafkaSource,
    options: Mapping[str, str],
) -> DataFrame:
    """The topic's records as a stream of rows of ``schema``, with the bookkeeping columns
    ``_idem_raw_body``, ``_idem_malformed`` and the message id (see the module doc)."""
    reader = spark.readStream.format("kafka")
    for name, setting in {**DEFAULT_OPTIONS, **options}.items():
        reader = reader.option(name, setting)
    reader = reader.option("kafka.bootstrap.servers", source.bootstrap).option(
        "subscribe", source.topic
    )
    try:
        records = reader.load()
    except AnalysisException as exc:
        if "kafka" in str(exc).lower() and "find data source" in str(exc).lower():
            raise ConfigError(f"--source: {CONNECTOR_HINT}") from None
        raise
    with_raw = StructType([*schema.fields, StructField(RAW_BODY_COLUMN, StringType(), True)])
    msg_id = F.concat_ws("-", F.col("topic"), F.col("partition"), F.col("offset"))
    value = F.col("value").cast("string")
    parsed = records.select(
        F.from_json(
            value,
            with_raw,
            {"mode": "PERMISSIVE", "columnNameOfCorruptRecord": RAW_BODY_COLUMN},
        ).alias("v"),
        value.alias("_value"),
        msg_id.alias(SOURCE_ID_COLUMN),
    )
    unparsable = F.concat(
        F.lit("value of Kafka record "),
        F.col(SOURCE_ID_COLUMN),
        F.lit(" is not valid JSON for the schema"),
    )
    record = F.concat(F.lit("Kafka record "), F.col(SOURCE_ID_COLUMN))
    why = (
        F.when(F.col("_value").isNull(), F.concat(record, F.lit(" has a null value")))
        .when(F.col("_value") == "", F.concat(record, F.lit(" has an empty value")))
        .when(F.col("v").getField(RAW_BODY_COLUMN).isNotNull(), unparsable)
        .when(F.col("v").isNull(), unparsable)
    )
    raw = F.when(F.col("v").isNull(), F.col("_value")).otherwise(
        F.col("v").getField(RAW_BODY_COLUMN)
    )
    return parsed.select(
        *(F.col("v").getField(f.name).alias(f.name) for f in schema.fields),
        raw.alias(RAW_BODY_COLUMN),
        why.alias(MALFORMED_COLUMN),
        F.col(SOURCE_ID_COLUMN),
    )
