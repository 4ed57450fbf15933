"""What a ``foreachBatch`` sink function returns, and how ``@exactly_once`` reads it.

A sink reports the rows it could not write (docs/pages/protocol.md, "Step 4"):
``None`` or ``CONSUME_SUCCESS`` (all written), ``RECONSUME_LATER`` (none), the
failed keys, the failed rows (``Row``s, dicts, or a DataFrame of them), or a
``{key or row: error}`` mapping. :func:`failed_keys` turns each into
``{key: error}``; a result it cannot read is a :class:`~idem.errors.ConfigError`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pyspark.sql import Row

from idem.errors import ConfigError
from idem.retry.status import ConsumeConcurrentlyStatus

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

SinkResult = Any
"""What a sink function may return: ``None``, a ``ConsumeConcurrentlyStatus``, failed keys,
a ``{key: error}`` mapping, or a DataFrame of the failed rows."""

SinkFunction = Callable[..., SinkResult]
"""``(fresh_df, batch_id) -> SinkResult``, the ``foreachBatch`` shape."""


def quoted(name: str) -> str:
    """A column name as a Spark SQL identifier."""
    return "`" + name.replace("`", "``") + "`"


def call_sink(fn: SinkFunction, df: DataFrame, batch_id: int) -> SinkResult:
    """``fn(df, batch_id)``, or ``fn(df)`` when it cannot take the batch id as a second
    positional argument (counting its parameters took a keyword-only option for one)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn(df, batch_id)
    try:
        signature.bind(df, batch_id)
    except TypeError:
        return fn(df)
    return fn(df, batch_id)


def failed_keys(result: SinkResult, key: str) -> Mapping[object, str] | None:
    """Normalise what the sink returned to ``{key: error}`` (``None``: all succeeded)."""
    if result is None or result is ConsumeConcurrentlyStatus.CONSUME_SUCCESS:
        return None
    if result is ConsumeConcurrentlyStatus.RECONSUME_LATER:
        return {ConsumeConcurrentlyStatus.RECONSUME_LATER: "RECONSUME_LATER"}
    if isinstance(result, Mapping):
        return {key_of(k, key): str(v) for k, v in result.items()}
    if hasattr(result, "toArrow") and hasattr(result, "columns"):
        if key not in result.columns:
            raise ConfigError(
                f"sink result: the returned DataFrame of failed rows has no key column {key!r}"
            )
        values = result.selectExpr(quoted(key)).toArrow().column(0).to_pylist()
        return dict.fromkeys(values, "rejected by the sink")
    if isinstance(result, str | bytes) or not isinstance(result, Iterable):
        raise ConfigError(
            "sink result: return None, a ConsumeConcurrentlyStatus, the failed keys, a "
            f"{{key: error}} mapping or a DataFrame of failed rows; got {type(result).__name__}"
        )
    return dict.fromkeys((key_of(item, key) for item in result), "rejected by the sink")


def key_of(item: object, key: str) -> object:
    """A returned failed key, or the key of a returned row: a ``Row`` (``df.collect()``
    of the failed rows: a Row used as a key matched no row, and the row was committed as
    done) or a mapping (``row.asDict()``, which failed the batch as unhashable)."""
    if isinstance(item, Mapping):
        if key not in item:
            raise ConfigError(
                f"sink result: a returned row (mapping) has no key column {key!r} "
                f"(fields: {list(item)})"
            )
        return item[key]
    if not isinstance(item, Row):
        return item
    fields = getattr(item, "__fields__", None)
    if fields is None or key not in fields:
        raise ConfigError(
            f"sink result: a returned Row has no key column {key!r} (fields: {fields})"
        )
    return item[key]
