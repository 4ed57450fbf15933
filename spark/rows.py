"""Rows as JSON with their Spark schema: how a row travels through retries and the DLQ.

A failed row leaves Spark as the JSON of its values (a JSON object in schema
order) and comes back, through the retry stream or a DLQ replay, as the same
typed values. The schema travels with it as Spark's own schema JSON, so a
replay months later still knows what the bytes mean. Never pickle.

Encodings of the types JSON lacks: decimals as strings (exact), dates and
timestamps as ISO-8601 (timestamps in UTC with microseconds), binary as
base64, maps as ``[[key, value], ...]`` (keys need not be strings), floats
that are not finite as ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.

Decoding checks each value against its column's type as well as its JSON
form: a whole number must fit the integer type, a decimal the precision and
scale, a float the float's range. A body written under another schema (the
job changed a column's type while the row waited for a retry) then fails with
the column and the limit named, instead of turning into a wrong value or an
error later in Spark. :meth:`RowCodec.decode_columns` decodes what it can and
names what it cannot, column by column.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

import pyarrow as pa
from pyspark.errors import ParseException
from pyspark.sql import types as st

from idem.errors import SerializationError

_UTC = dt.UTC
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

Encoder = Callable[[Any, str], Any]
Decoder = Callable[[Any, str], Any]


def schema_from_json(text: str) -> st.StructType:
    """A Spark schema from its JSON form (``StructType.json()``)."""
    try:
        parsed = st.StructType.fromJson(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise SerializationError(f"schema: not a Spark schema JSON ({exc})") from exc
    return parsed


def schema_from_ddl(text: str) -> st.StructType:
    """A Spark schema from a DDL string like ``"order_id string, amount double"``.

    Needs an active Spark session (Spark's own parser reads the DDL).
    """
    try:
        parsed = st._parse_datatype_string(text)
    except ParseException as exc:
        raise SerializationError(
            f"schema: {text!r} is not a column list: {_first_line(exc)}"
        ) from None
    if not isinstance(parsed, st.StructType):
        raise SerializationError(f"schema: {text!r} is not a struct (column list)")
    return parsed


def _first_line(exc: Exception) -> str:
    """The first line of a Spark error, without its SQLSTATE."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return re.sub(r"\s*SQLSTATE: \w+", "", lines[0] if lines else type(exc).__name__)


BODY = ""
"""The key of :attr:`DecodedRow.errors` for a body that is not a JSON object at all."""


@dataclass(frozen=True, slots=True)
class DecodedRow:
    """One body decoded column by column: the values, and what did not decode."""

    values: tuple[Any, ...]
    """The typed values in schema order; null where the column did not decode."""
    errors: Mapping[str, str] = field(default_factory=dict)
    """Column name -> why it did not decode (the message names the column); ``BODY`` ->
    why nothing decoded (not a JSON object)."""


class RowCodec:
    """Encode rows of one Spark schema to JSON bytes and decode them back to typed values."""

    def __init__(self, schema: st.StructType) -> None:
        if not isinstance(schema, st.StructType):
            raise SerializationError(f"schema: expected a StructType, got {type(schema).__name__}")
        self.schema = schema
        self.names: tuple[str, ...] = tuple(schema.fieldNames())
        self._known = frozenset(self.names)
        codecs = [_codec(f.dataType, f.name) for f in schema.fields]
        self._encoders = [encode for encode, _ in codecs]
        self._decoders = [decode for _, decode in codecs]
        self.schema_json = schema.json()

    @classmethod
    def from_schema_json(cls, text: str) -> RowCodec:
        """A codec for the schema in Spark's JSON form."""
        return cls(schema_from_json(text))

    def encode(self, row: Mapping[str, Any]) -> bytes:
        """The row (a mapping of column name to Python value) as compact JSON bytes."""
        out: dict[str, Any] = {}
        for name, enc in zip(self.names, self._encoders, strict=True):
            value = row.get(name)
            out[name] = None if value is None else enc(value, name)
        try:
            text = json.dumps(out, separators=(",", ":"), ensure_ascii=False)
            return text.encode("utf-8", "surrogateescape")  # bytes kept as they came
        except (TypeError, ValueError) as exc:  # pragma: no cover - encoders cover the types
            raise SerializationError(f"row: cannot encode as JSON ({exc})") from exc

    def encode_table(self, table: pa.Table, indices: Iterable[int] | None = None) -> list[bytes]:
        """Encode rows of an Arrow table (e.g. ``DataFrame.toArrow()``), optionally a subset.

        A string Spark let through that is not UTF-8 keeps its bytes: the body holds them
        as they were (it is then not UTF-8 either), rather than the row failing its batch.
        """
        wanted = [n for n in self.names if n in table.column_names]
        if indices is not None:
            table = table.select(wanted).take(pa.array(list(indices), pa.int64()))
        else:
            table = table.select(wanted)
        try:
            rows = table.to_pylist()
        except UnicodeDecodeError:
            columns = [python_values(table.column(n), "surrogateescape") for n in wanted]
            rows = [dict(zip(wanted, values, strict=True)) for values in zip(*columns, strict=True)]
        return [self.encode(row) for row in rows]

    def decode(self, body: bytes | str) -> tuple[Any, ...]:
        """The typed values of one encoded row, in schema order (missing columns are null)."""
        obj = _json_object(body)
        return tuple(
            None if (value := obj.get(name)) is None else dec(value, name)
            for name, dec in zip(self.names, self._decoders, strict=True)
        )

    def decode_columns(self, body: bytes | str, *, extra_fields: bool = False) -> DecodedRow:
        """:meth:`decode`, column by column: a column that does not decode is null and its
        error is kept, so the columns that did decode (the key, say) are not lost. A body
        field with a value but no column is an error too (its value would vanish), unless
        ``extra_fields`` (a source line, whose reader ignores fields outside the schema)."""
        try:
            obj = _json_object(body)
        except SerializationError as exc:
            return DecodedRow((None,) * len(self.names), {BODY: str(exc)})
        values: list[Any] = []
        errors: dict[str, str] = {}
        for name, dec in zip(self.names, self._decoders, strict=True):
            value = obj.get(name)
            try:
                values.append(None if value is None else dec(value, name))
            except SerializationError as exc:
                values.append(None)
                errors[name] = str(exc)
            except Exception as exc:  # any other failure stays with its column too
                values.append(None)
                errors[name] = f"column {name!r}: {type(exc).__name__}: {exc}"
        for name, value in obj.items():  # a value the schema has no column for would be lost
            if value is not None and name not in self._known and not extra_fields:
                errors[name] = (
                    f"body field {name!r}: has a value ({_excerpt(value)}) but the schema has "
                    "no such column (renamed or dropped while the row waited?)"
                )
        return DecodedRow(tuple(values), errors)

    def decode_dict(self, body: bytes | str) -> dict[str, Any]:
        """One encoded row as ``{column: value}``."""
        return dict(zip(self.names, self.decode(body), strict=True))


def _excerpt(value: Any, limit: int = 40) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else f"{text[:limit]}..."


def _json_object(body: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SerializationError(f"body: not JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise SerializationError(f"body: expected a JSON object, got {type(obj).__name__}")
    return obj


# -- per-type encoders / decoders ----------------------------------------------------------


def _unsupported(kind: st.DataType, name: str) -> SerializationError:
    return SerializationError(
        f"column {name!r}: type {kind.simpleString()} cannot travel through the retry path "
        "(supported: strings, numbers, booleans, decimals, dates, timestamps, binary, "
        "arrays, maps, structs)"
    )


def _codec(kind: st.DataType, name: str) -> tuple[Encoder, Decoder]:
    """The encoder and decoder of a column of type ``kind``, built together."""
    scalar = _scalar_codec(kind)
    if scalar is not None:
        return scalar
    if isinstance(kind, st.ArrayType):
        item_enc, item_dec = _codec(kind.elementType, f"{name}[]")
        return (
            lambda v, n: [None if x is None else item_enc(x, n) for x in v],
            lambda v, n: [None if x is None else item_dec(x, n) for x in _as_list(v, n)],
        )
    if isinstance(kind, st.MapType):
        k_enc, k_dec = _codec(kind.keyType, f"{name}.key")
        v_enc, v_dec = _codec(kind.valueType, f"{name}.value")

        def decode_map(v: Any, n: str) -> dict[Any, Any]:
            out: dict[Any, Any] = {}
            for k, x in _as_pairs(v, n):
                out[_map_key(k_dec(k, n), n)] = None if x is None else v_dec(x, n)
            return out

        return (
            lambda v, n: [
                [k_enc(k, n), None if x is None else v_enc(x, n)] for k, x in _map_items(v)
            ],
            decode_map,
        )
    if isinstance(kind, st.StructType):
        nested = RowCodec(kind)
        fields = tuple(zip(nested.names, nested._decoders, strict=True))

        def decode_struct(v: Any, n: str) -> st.Row:
            if not isinstance(v, dict):
                raise SerializationError(f"column {n!r}: expected a JSON object, got {v!r}")
            return st.Row(
                **{f: None if (x := v.get(f)) is None else dec(x, f"{n}.{f}") for f, dec in fields}
            )

        return (
            lambda v, n: json.loads(nested.encode(v if isinstance(v, Mapping) else v.asDict())),
            decode_struct,
        )
    raise _unsupported(kind, name)


def _scalar_codec(kind: st.DataType) -> tuple[Encoder, Decoder] | None:
    """The codec of a scalar type (``None``: not a scalar); integers, decimals and floats
    decode only values their type holds."""
    if isinstance(kind, st.IntegralType):
        return _identity, _int_decoder(kind)
    if isinstance(kind, st.DecimalType):
        return _encode_decimal, _decimal_decoder(kind)
    if isinstance(kind, st.FloatType):
        return _encode_float, _decode_float32
    return next(((enc, dec) for scalar, enc, dec in _SCALARS if isinstance(kind, scalar)), None)


class _KeyList(list[Any]):
    """A decoded array that is a map key: Spark allows array (and struct) keys, a Python
    dict needs them hashable. Still a ``list``, which is what Spark's row converter takes."""

    __slots__ = ()

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self))


def _map_key(value: Any, name: str) -> Any:
    """``value`` as a dict key: arrays (also inside structs) hash by their items."""
    if isinstance(value, list):
        return _KeyList(_map_key(x, name) for x in value)
    if isinstance(value, st.Row):
        return st.Row(**{f: _map_key(x, name) for f, x in value.asDict().items()})
    if isinstance(value, dict):
        raise SerializationError(f"column {name!r}: a map key that holds a map cannot be read")
    return value


def _identity(value: Any, name: str) -> Any:
    return value


def _encode_float(value: Any, name: str) -> Any:
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "Infinity" if number > 0 else "-Infinity"
    return number


def _encode_decimal(value: Any, name: str) -> str:
    return f"{value}"


def _encode_timestamp(value: Any, name: str) -> str:
    if not isinstance(value, dt.datetime):
        raise SerializationError(f"column {name!r}: expected a datetime, got {value!r}")
    # Spark hands naive datetimes in the session's zone; idem's sessions use UTC.
    moment: dt.datetime = value if value.tzinfo is not None else value.replace(tzinfo=_UTC)
    return moment.astimezone(_UTC).isoformat(timespec="microseconds")


def _encode_timestamp_ntz(value: Any, name: str) -> str:
    if not isinstance(value, dt.datetime):
        raise SerializationError(f"column {name!r}: expected a datetime, got {value!r}")
    return value.replace(tzinfo=None).isoformat(timespec="microseconds")


def _encode_date(value: Any, name: str) -> str:
    if not isinstance(value, dt.date):
        raise SerializationError(f"column {name!r}: expected a date, got {value!r}")
    return value.isoformat()


def _encode_binary(value: Any, name: str) -> str:
    return base64.b64encode(bytes(value)).decode("ascii")


def _map_items(value: Any) -> Iterable[tuple[Any, Any]]:
    if isinstance(value, Mapping):
        return value.items()
    return [(k, v) for k, v in value]  # Arrow gives maps as lists of (key, value)


def _decode_str(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise SerializationError(f"column {name!r}: expected text, got {value!r}")
    return f"{value}"


def _decode_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise SerializationError(f"column {name!r}: expected true/false, got {value!r}")
    return value


def _decode_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SerializationError(f"column {name!r}: expected a whole number, got {value!r}")
    return value


_INT_BITS: dict[type[st.DataType], int] = {
    st.ByteType: 8,
    st.ShortType: 16,
    st.IntegerType: 32,
    st.LongType: 64,
}


def _int_decoder(kind: st.IntegralType) -> Decoder:
    """Whole numbers within the range of ``kind`` (``int``: 32 bits, ``bigint``: 64...)."""
    bits = _INT_BITS.get(type(kind), 64)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    label = kind.simpleString()

    def decode(value: Any, name: str) -> int:
        number = _decode_int(value, name)
        if not low <= number <= high:
            raise SerializationError(
                f"column {name!r}: {number} does not fit {label} ({low} to {high})"
            )
        return number

    return decode


def _decode_float(value: Any, name: str) -> float:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SerializationError(f"column {name!r}: expected a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise SerializationError(f"column {name!r}: {value} does not fit double") from None


_FLOAT_MAX = 3.4028234663852886e38
"""The largest finite 32-bit float (Spark's ``float``)."""


def _decode_float32(value: Any, name: str) -> float:
    number = _decode_float(value, name)
    if math.isfinite(number) and abs(number) > _FLOAT_MAX:
        # Arrow would store it as an infinity without a word.
        raise SerializationError(f"column {name!r}: {number!r} does not fit float")
    return number


def _decode_decimal(value: Any, name: str) -> Decimal:
    try:
        return Decimal(str(value))
    except InvalidOperation:
        raise SerializationError(f"column {name!r}: {value!r} is not a decimal") from None


def _decimal_decoder(kind: st.DecimalType) -> Decoder:
    """Decimals that ``kind`` holds exactly: Spark would round away extra decimal places
    without a word and fail the whole batch on extra integer digits."""
    precision, scale = kind.precision, kind.scale
    label = kind.simpleString()

    def decode(value: Any, name: str) -> Decimal:
        number = _decode_decimal(value, name)
        if not number.is_finite():
            raise SerializationError(f"column {name!r}: {value!r} is not a finite decimal")
        if number:
            exact = number.normalize()
            places = max(0, -int(exact.as_tuple().exponent))
            whole_digits = max(0, exact.adjusted() + 1)
            if places > scale or whole_digits > precision - scale:
                raise SerializationError(
                    f"column {name!r}: {value} does not fit {label} (at most "
                    f"{precision - scale} digit(s) before the point and {scale} after)"
                )
        return number

    return decode


def _parse_iso(value: Any, name: str) -> dt.datetime:
    try:
        return dt.datetime.fromisoformat(str(value))
    except ValueError:
        raise SerializationError(f"column {name!r}: {value!r} is not an ISO timestamp") from None


def _decode_timestamp(value: Any, name: str) -> dt.datetime:
    parsed = _parse_iso(value, name)
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=_UTC)


def _decode_date(value: Any, name: str) -> dt.date:
    try:
        return dt.date.fromisoformat(str(value))
    except ValueError:
        raise SerializationError(f"column {name!r}: {value!r} is not an ISO date") from None


def _decode_binary(value: Any, name: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except ValueError:
        raise SerializationError(f"column {name!r}: {value!r} is not base64") from None


def _as_list(value: Any, name: str) -> Sequence[Any]:
    if not isinstance(value, list):
        raise SerializationError(f"column {name!r}: expected a JSON array, got {value!r}")
    return value


def _as_pairs(value: Any, name: str) -> Iterable[tuple[Any, Any]]:
    if isinstance(value, dict):  # tolerate the plain-object form for string keys
        return value.items()
    pairs = _as_list(value, name)
    if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise SerializationError(f"column {name!r}: expected [[key, value], ...], got {value!r}")
    return [(p[0], p[1]) for p in pairs]


def _decode_null(value: Any, name: str) -> None:
    return None


def _decode_timestamp_ntz(value: Any, name: str) -> dt.datetime:
    return _parse_iso(value, name).replace(tzinfo=None)


_SCALARS: tuple[tuple[type[st.DataType], Encoder, Decoder], ...] = (
    (st.StringType, _identity, _decode_str),
    (st.BooleanType, _identity, _decode_bool),
    (st.NullType, _identity, _decode_null),
    (st.DoubleType, _encode_float, _decode_float),
    (st.TimestampNTZType, _encode_timestamp_ntz, _decode_timestamp_ntz),  # before TimestampType
    (st.TimestampType, _encode_timestamp, _decode_timestamp),
    (st.DateType, _encode_date, _decode_date),
    (st.BinaryType, _encode_binary, _decode_binary),
)
"""Each scalar Spark type with its JSON encoder and decoder, checked in this order (integers,
decimals and floats come first, with their ranges: see :func:`_scalar_codec`)."""


def python_values(values: pa.ChunkedArray | pa.Array, errors: str) -> list[Any]:
    """``values.to_pylist()``; a string column holding bytes that are not UTF-8 (Spark
    does not check its strings) is decoded with ``errors`` instead of failing the batch."""
    try:
        python: list[Any] = values.to_pylist()
        return python
    except UnicodeDecodeError:
        binary = pa.large_binary() if pa.types.is_large_string(values.type) else pa.binary()
        raw = values.cast(binary)
        return [None if v is None else v.decode("utf-8", errors) for v in raw.to_pylist()]
