"""``%RETRY%<group>`` as a Spark streaming source (a PySpark Python data source).

::

    retries = retry_stream(spark, config=config, schema=orders.schema)
    stream = orders.unionByName(retries, allowMissingColumns=True)
    stream.writeStream.foreachBatch(sink).start()

Rows come back with the columns they had when they failed (decoded from the
JSON of the row with its schema), plus ``reconsume_times`` and
``_idem_message`` (the message's envelope, so a second failure resends the
same message). Union the retry stream right before ``foreachBatch``: its rows
are the rows the sink saw.

A message whose body no longer fits the schema (the job changed a column's
type while the row waited, a long that became an ``int``, a decimal with
more places) still becomes a row: the columns that fit keep their values,
the others are null (a column that is not nullable gets its type's zero) and
``_idem_malformed`` names each column and its problem. ``@exactly_once``
dead-letters such a row with its message as it was; the rest of the batch
flows on. One bad message never fails the query, which would replay the same
offsets and fail again on every restart.

Offsets are Redis stream ids of the retry topic. Each trigger the source
first runs the schedule service's step (due messages move from their delay
level to the topic), so retries start batches even when the main source is
idle. A batch reads the id range ``(start, end]`` (``XRANGE``): a replay after
a crash reads the same messages, and messages are acknowledged (journaled,
then removed) only when Spark commits the batch.

An entry of the topic that is not a message at all (no ``m`` field, bytes that are
not idem's wire form) has no row to become: the batch leaves it out, and when Spark
commits the batch it is dead-lettered with its reason and raw bytes, then removed.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Final

import pyarrow as pa
from pyspark.sql import types as st
from pyspark.sql.conversion import LocalDataToArrowConversion
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_type
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
from pyspark.sql.types import IntegerType, StringType, StructField, StructType

from idem.config import IdemConfig
from idem.errors import ConfigError
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt
from idem.retry.topic import RetryEntries
from idem.spark.messages import (
    BOOKKEEPING_COLUMNS,
    MALFORMED_COLUMN,
    MESSAGE_COLUMN,
    RECONSUME_TIMES_COLUMN,
    SOURCE_LINE_PROPERTY,
)
from idem.spark.rows import BODY, RowCodec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger(__name__)

FORMAT: Final = "idem_retry"
"""The source's short name (``spark.readStream.format("idem_retry")``)."""

_START: Final = "0-0"


def config_to_options(config: IdemConfig) -> dict[str, str]:
    """The config as data source options (strings only; never pickled)."""
    out: dict[str, str] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if value is not None:
            out[f"idem.{f.name}"] = str(value)
    return out


def config_from_options(options: Mapping[str, str]) -> IdemConfig:
    """Inverse of :func:`config_to_options`."""
    ints = {f.name for f in fields(IdemConfig) if f.type in ("int", int)}
    values: dict[str, Any] = {}
    for name, raw in options.items():
        if not name.lower().startswith("idem."):
            continue
        setting = name[len("idem.") :]
        # Spark lower-cases option names; map them back to the dataclass fields.
        match = next(
            (f.name for f in fields(IdemConfig) if f.name.lower() == setting.lower()), None
        )
        if match is None:
            continue
        values[match] = int(raw) if match in ints else raw
    if "group" not in values:
        raise ConfigError("retry stream: option idem.group is missing")
    return IdemConfig(**values)


def _retry_schema(schema: StructType) -> StructType:
    clash = set(BOOKKEEPING_COLUMNS) & set(schema.fieldNames())
    if clash:
        raise ConfigError(
            f"retry stream: the schema already has column(s) {', '.join(sorted(clash))}; "
            "pass the schema of the rows as the sink sees them, without the retry columns"
        )
    return StructType(
        [
            *schema.fields,
            StructField(RECONSUME_TIMES_COLUMN, IntegerType(), True),
            StructField(MESSAGE_COLUMN, StringType(), True),
            StructField(MALFORMED_COLUMN, StringType(), True),
        ]
    )


class RetryDataSource(DataSource):
    """The ``idem_retry`` data source: options ``idem.*`` (the config) and ``schema`` (JSON)."""

    @classmethod
    def name(cls) -> str:
        """``idem_retry``."""
        return FORMAT

    def schema(self) -> StructType:
        """The rows' schema plus ``reconsume_times``, ``_idem_message``, ``_idem_malformed``."""
        raw = self.options.get("schema")
        if not raw:
            raise ConfigError(
                "retry stream: option 'schema' (the rows' Spark schema JSON) is missing"
            )
        return _retry_schema(RowCodec.from_schema_json(raw).schema)

    def streamReader(  # noqa: N802 - Spark's name
        self, schema: StructType
    ) -> DataSourceStreamReader:
        """The reader over the group's retry topic."""
        return RetryStreamReader(dict(self.options))


class _RangePartition(InputPartition):
    """Stream ids ``(after, until]`` of the retry topic."""

    def __init__(self, after: str, until: str) -> None:
        super().__init__((after, until))
        self.after = after
        self.until = until


def _stream_id(text: str) -> tuple[int, int]:
    millis, _, seq = text.partition("-")
    return int(millis), int(seq or 0)


class RetryStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans batches by stream id and reads them with ``XRANGE``."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.options = dict(options)
        self.config = config_from_options(self.options)
        self._engine: RetryEngine | None = None
        self._target: str | None = None

    @property
    def engine(self) -> RetryEngine:
        """The group's retry engine (one per planner process)."""
        if self._engine is None:
            self._engine = _engine(self.config)
        return self._engine

    def initialOffset(self) -> dict[str, str]:  # noqa: N802 - Spark's name
        """A new query starts at the beginning of the topic (unacknowledged messages)."""
        return {"id": _START}

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802 - Spark's name
        """``Trigger.AvailableNow``: stop at the messages that are in the topic (or due) now."""
        self._target = self._latest(_START, None)

    def latestOffset(  # noqa: N802 - Spark's name
        self, start: dict[str, str] | None = None, limit: Any = None
    ) -> dict[str, str]:
        """Move due messages into the topic, then report the newest id (capped by a target)."""
        after = (start or {}).get("id", _START)
        latest = self._latest(after, limit)
        if self._target is not None and _stream_id(latest) > _stream_id(self._target):
            latest = self._target if _stream_id(self._target) > _stream_id(after) else after
        return {"id": latest}

    def _latest(self, after: str, limit: Any) -> str:
        try:
            self.engine.tick()
        except Exception:  # a transient failure must not stop the query; next trigger retries
            log.warning("retry stream: schedule step failed", exc_info=True)
        max_rows = getattr(limit, "max_rows", None)
        client = self.engine.store.client
        key = self.engine.store.keys.stream
        if max_rows:
            entries = client.xrange(key, min=f"({after}", max="+", count=int(max_rows))
        else:
            entries = client.xrevrange(key, max="+", min=f"({after}", count=1)
        if not entries:
            return after
        last = entries[-1][0] if max_rows else entries[0][0]
        return last.decode() if isinstance(last, bytes) else str(last)

    def partitions(self, start: dict[str, str], end: dict[str, str]) -> list[InputPartition]:
        """One partition per batch: the retry topic is one queue (``retryQueueNums = 1``)."""
        if start.get("id") == end.get("id"):
            return []
        return [_RangePartition(start.get("id", _START), end["id"])]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        """The rows of the messages in the partition's id range."""
        assert isinstance(partition, _RangePartition)
        rows = RetryRows(RowCodec.from_schema_json(self.options["schema"]))
        entries = _entries_between(self.config, partition.after, partition.until)
        for damaged in entries.damaged:
            log.warning("retry stream: %s; dead-lettered when the batch commits", damaged.reason)
        for message in entries.messages:
            yield rows.row(message)

    def commit(self, end: dict[str, str]) -> None:
        """Spark committed up to ``end``: acknowledge those messages (journal, then Redis),
        and dead-letter the entries that were not messages (then remove them)."""
        until = end.get("id", _START)
        if until == _START:
            return
        entries = _entries_between(self.config, _START, until, engine=self.engine)
        if entries.damaged:
            self.engine.dead_letter_damaged(entries.damaged)
        if entries.messages:
            self.engine.ack(entries.messages)

    def stop(self) -> None:
        """Close the engine's connections."""
        if self._engine is not None:
            close = getattr(self._engine, "close", None)
            if callable(close):
                close()


def _engine(config: IdemConfig) -> RetryEngine:
    return RetryEngine(config)


def _entries_between(
    config: IdemConfig, after: str, until: str, *, engine: RetryEngine | None = None
) -> RetryEntries:
    """Entries of the retry topic with ids in ``(after, until]``, decoded as a consumer sees
    them (nothing is dead-lettered here: a task may run again)."""
    own = engine is None
    engine = engine or _engine(config)
    try:
        entries = engine.store.client.xrange(
            engine.store.keys.stream, min=after if after == _START else f"({after}", max=until
        )
        return engine.topic.decode(entries)
    finally:
        if own:
            close = getattr(engine, "close", None)
            if callable(close):
                close()


class RetryRows:
    """Rows of the retry stream from messages, whatever their bodies hold (see module doc).

    Each value is tried the way Spark will take it (the Python data source's own
    converter, then Arrow) before it is handed over: a value Spark would refuse
    fails its row here, named, instead of the whole micro-batch later.
    """

    def __init__(self, codec: RowCodec) -> None:
        self.codec = codec
        self.fields = tuple(codec.schema.fields)
        self._checks = tuple(_arrow_check(f) for f in self.fields)

    def row(self, message: MessageExt) -> tuple[Any, ...]:
        """The row of ``message``: its values, ``reconsume_times``, the envelope, the problem."""
        decoded = self.codec.decode_columns(
            message.body, extra_fields=message.properties.get(SOURCE_LINE_PROPERTY) == "1"
        )
        values = list(decoded.values)
        errors = dict(decoded.errors)
        for i, (field, check) in enumerate(zip(self.fields, self._checks, strict=True)):
            if values[i] is not None:
                problem = check(values[i])
                if problem is None:
                    continue
                errors[field.name] = f"column {field.name!r}: {problem}"
                values[i] = None
            if not field.nullable:
                if field.name not in errors and BODY not in errors:
                    errors[field.name] = f"column {field.name!r}: no value, and it is not nullable"
                values[i] = _zero(field.dataType)  # never seen: the row is dead-lettered
        reason = "; ".join(errors.values()) or None
        if reason is not None:
            log.warning(
                "retry stream: message %s does not fit the schema (it will be dead-lettered): %s",
                message.msg_id,
                reason,
            )
        return (*values, message.reconsume_times, message.to_wire(), reason)


def _arrow_check(field: StructField) -> Callable[[Any], str | None]:
    """What Spark makes of one value of ``field`` (``None``: it takes it; else why not)."""
    convert = LocalDataToArrowConversion._create_converter(field.dataType, field.nullable)
    arrow_type = to_arrow_type(field.dataType, timezone="UTC")

    def check(value: Any) -> str | None:
        try:
            pa.array([convert(value)], type=arrow_type)
        except Exception as exc:  # whatever Spark would fail the batch with fails the row
            text = next((line for line in str(exc).splitlines() if line.strip()), "")
            return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        return None

    return check


def _zero(kind: st.DataType) -> Any:
    """A value of ``kind`` for a column that must not be null but has no value."""
    if isinstance(kind, st.StructType):
        return tuple(None if f.nullable else _zero(f.dataType) for f in kind.fields)
    return next((zero for kind_type, zero in _ZEROS if isinstance(kind, kind_type)), None)


_ZEROS: tuple[tuple[type[st.DataType], Any], ...] = (
    (st.StringType, ""),
    (st.BinaryType, b""),
    (st.BooleanType, False),
    (st.IntegralType, 0),
    (st.DecimalType, Decimal(0)),  # before FractionalType, its base
    (st.FractionalType, 0.0),
    (st.DateType, dt.date(1970, 1, 1)),
    (st.TimestampNTZType, dt.datetime(1970, 1, 1)),  # before TimestampType
    (st.TimestampType, dt.datetime(1970, 1, 1, tzinfo=dt.UTC)),
    (st.ArrayType, []),
    (st.MapType, {}),
)
"""The zero of each type :func:`_zero` fills in, checked in this order."""


def retry_stream(
    spark: SparkSession,
    *,
    schema: StructType,
    config: IdemConfig | None = None,
    group: str | None = None,
) -> DataFrame:
    """The group's retry topic as a streaming DataFrame of the failed rows (see module doc).

    Args:
        spark: The session the stream is read in (the data source is registered
            in it).
        schema: The schema of the rows as the sink sees them; a failed row's body
            is decoded with it.
        config: The group's settings (Redis URL, delay levels, journal and DLQ
            paths). Without it, they come from ``IDEM_*`` variables.
        group: The consumer group; overrides ``config.group``.

    Returns:
        A streaming DataFrame of ``schema``'s columns plus ``reconsume_times`` and
        ``_idem_message``; union it right before the ``foreachBatch`` sink.
    """
    if config is None:
        config = IdemConfig.from_env(group=group) if group else IdemConfig.from_env()
    elif group is not None and group != config.group:
        config = config.with_changes(group=group)
    spark.dataSource.register(RetryDataSource)
    options = {**config_to_options(config), "schema": schema.json()}
    return spark.readStream.format(FORMAT).options(**options).load()


def with_retries(
    df: DataFrame, *, config: IdemConfig | None = None, group: str | None = None
) -> DataFrame:
    """``df`` unioned with its group's retry stream (same columns, plus the retry columns).

    The rows an ``@exactly_once`` sink of the same group could not take come back
    through this stream on the delay ladder, with the columns they had when they
    failed. Apply it right before ``foreachBatch``: the retried rows must be rows
    the sink saw, so no transformation may come between.

    Args:
        df: The streaming DataFrame of the source (one row per message); its schema
            decodes the retried rows.
        config: The group's settings (Redis URL, delay levels, journal and DLQ
            paths). Without it, they come from ``IDEM_*`` variables.
        group: The consumer group; overrides ``config.group``.

    Returns:
        ``df.unionByName(retry_stream(...), allowMissingColumns=True)``: ``df``'s
        columns plus ``reconsume_times`` and ``_idem_message``.
    """
    retries = retry_stream(df.sparkSession, schema=df.schema, config=config, group=group)
    return df.unionByName(retries, allowMissingColumns=True)
