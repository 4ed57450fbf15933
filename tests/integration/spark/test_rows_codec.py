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


@pytest.mark.parametrize(
    ("kind", "fits", "too_big"),
    [
        (st.ByteType(), -128, 128),
        (st.ShortType(), 32767, -32769),
        (st.IntegerType(), 2**31 - 1, 2**40),
        (st.LongType(), -(2**63), 2**63),
    ],
)
def test_a_whole_number_must_fit_its_integer_type(
    kind: st.DataType, fits: int, too_big: int
) -> None:
    codec = RowCodec(st.StructType([st.StructField("qty", kind)]))
    assert codec.decode(f'{{"qty": {fits}}}') == (fits,)
    with pytest.raises(SerializationError, match=f"column 'qty': {too_big} does not fit"):
        codec.decode(f'{{"qty": {too_big}}}')


def test_a_decimal_must_fit_its_precision_and_scale_exactly() -> None:
    codec = RowCodec(st.StructType([st.StructField("price", st.DecimalType(5, 2))]))
    assert codec.decode('{"price": "999.99"}') == (Decimal("999.99"),)
    assert codec.decode('{"price": "1.230"}') == (Decimal("1.230"),)  # no digit is lost
    assert codec.decode('{"price": "0.00"}') == (Decimal("0.00"),)
    for text in ("1.234", "1000", "-1000.5"):  # Spark would round the first, fail the others
        with pytest.raises(SerializationError, match=r"column 'price': .* does not fit decimal"):
            codec.decode(f'{{"price": "{text}"}}')
    with pytest.raises(SerializationError, match="not a finite decimal"):
        codec.decode('{"price": "NaN"}')


def test_a_float_must_fit_its_range() -> None:
    codec = RowCodec(
        st.StructType([st.StructField("f", st.FloatType()), st.StructField("d", st.DoubleType())])
    )
    assert codec.decode('{"f": 1.5, "d": 1e300}') == (1.5, 1e300)
    with pytest.raises(SerializationError, match=r"column 'f': 1e\+300 does not fit float"):
        codec.decode('{"f": 1e300}')
    with pytest.raises(SerializationError, match=r"column 'd': .* does not fit double"):
        codec.decode('{"d": 1' + "0" * 400 + "}")


def test_maps_keyed_by_arrays_and_structs_round_trip() -> None:
    keyed = st.StructType(
        [
            st.StructField("by_array", st.MapType(st.ArrayType(st.IntegerType()), st.LongType())),
            st.StructField(
                "by_struct",
                st.MapType(
                    st.StructType([st.StructField("bins", st.ArrayType(st.IntegerType()))]),
                    st.StringType(),
                ),
            ),
        ]
    )
    codec = RowCodec(keyed)
    row = {"by_array": [([1, 2], 3), ([4], None)], "by_struct": [({"bins": [7]}, "x")]}
    by_array, by_struct = codec.decode(codec.encode(row))
    assert list(by_array.items()) == [([1, 2], 3), ([4], None)]
    [(key, value)] = by_struct.items()
    assert key.bins == [7]
    assert value == "x"


def test_decode_columns_keeps_what_decodes_and_names_what_does_not() -> None:
    codec = RowCodec(SCHEMA)
    decoded = codec.decode_columns(b'{"id": "ORDERID_1", "n": "seven", "day": "yesterday"}')
    assert decoded.values[0] == "ORDERID_1"
    assert decoded.values[1] is None
    assert set(decoded.errors) == {"n", "day"}
    assert "column 'n': expected a whole number" in decoded.errors["n"]
    assert "column 'day': 'yesterday' is not an ISO date" in decoded.errors["day"]
    assert codec.decode_columns(b'{"id": "ORDERID_1"}').errors == {}
    whole = codec.decode_columns(b"[1, 2]")
    assert whole.values == (None,) * len(SCHEMA.fields)
    assert list(whole.errors.values()) == ["body: expected a JSON object, got list"]
