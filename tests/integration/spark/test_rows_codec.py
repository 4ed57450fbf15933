"""Rows travel as JSON with their schema and come back with the same typed values."""

from __future__ import annotations

import datetime as dt
import math
from decimal import Decimal

import pytest
from pyspark.sql import types as st

from idem.errors import SerializationError
from idem.spark.rows import RowCodec

pytestmark = pytest.mark.integration

SCHEMA = st.StructType(
    [
        st.StructField("id", st.StringType()),
        st.StructField("n", st.LongType()),
        st.StructField("ok", st.BooleanType()),
        st.StructField("price", st.DecimalType(12, 4)),
        st.StructField("ratio", st.DoubleType()),
        st.StructField("at", st.TimestampType()),
        st.StructField("local", st.TimestampNTZType()),
        st.StructField("day", st.DateType()),
        st.StructField("raw", st.BinaryType()),
        st.StructField("tags", st.ArrayType(st.StringType())),
        st.StructField("counts", st.MapType(st.IntegerType(), st.LongType())),
        st.StructField("address", st.StructType([st.StructField("city", st.StringType())])),
    ]
)


def test_every_supported_type_round_trips_exactly() -> None:
    codec = RowCodec(SCHEMA)
    row = {
        "id": "ORDERID_1 ü",
        "n": 2**53 + 1,
        "ok": False,
        "price": Decimal("12345678.0001"),
        "ratio": 0.1 + 0.2,
        "at": dt.datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=dt.UTC),
        "local": dt.datetime(2024, 1, 1, 8, 0, 0, 1),
        "day": dt.date(1999, 12, 31),
        "raw": b"\x00\xff\x10",
        "tags": ["a", None, "c"],
        "counts": [(1, 10), (2, None)],  # Arrow's form of a map
        "address": {"city": "Hangzhou"},
    }
    values = RowCodec.from_schema_json(codec.schema_json).decode(codec.encode(row))
    assert values[:10] == (
        "ORDERID_1 ü", 2**53 + 1, False, Decimal("12345678.0001"), 0.1 + 0.2,
        row["at"], row["local"], row["day"], b"\x00\xff\x10", ["a", None, "c"],
    )  # fmt: skip
    assert values[10] == {1: 10, 2: None}
    assert values[11].city == "Hangzhou"


def test_non_finite_floats_and_nulls_survive() -> None:
    codec = RowCodec(SCHEMA)
    values = codec.decode(codec.encode({"id": None, "ratio": -math.inf}))
    assert values[0] is None
    assert values[4] == -math.inf
    assert math.isnan(codec.decode(codec.encode({"ratio": math.nan}))[4])


def test_a_body_that_does_not_fit_the_schema_names_the_column() -> None:
    codec = RowCodec(SCHEMA)
    with pytest.raises(SerializationError, match="column 'n': expected a whole number"):
        codec.decode(b'{"n": "seven"}')
    with pytest.raises(SerializationError, match="body: not JSON"):
        codec.decode(b"\x80not json")
