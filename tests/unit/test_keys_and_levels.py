"""Keys and delay levels: the small pure pieces every batch goes through."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idem.delay_levels import DEFAULT_DELAY_LEVELS, DelayLevels
from idem.errors import ConfigError, InvalidKey
from idem.keys import UnreadableKey, bucket_of, fingerprint, group_by_bucket, validate_key

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "null"),
        ("", "empty"),
        (" \t", "empty"),
        (3, "not_text"),
        (b"\xc3", "undecodable"),
        ("ORDER_\ud800", "undecodable"),  # a lone surrogate (JSON's "\ud800") cannot be sent
        (UnreadableKey("the body is not JSON"), "undecodable"),  # says why, not "null"
    ],
)
def test_bad_keys_are_named(value: object, reason: str) -> None:
    with pytest.raises(InvalidKey) as info:
        validate_key(value, field="order_id")
    assert info.value.reason == reason
    assert info.value.field == "order_id"
    assert "order_id" in str(info.value)


def test_the_length_limit_counts_utf8_bytes() -> None:
    assert validate_key("é" * 256, max_bytes=512) == "é" * 256
    with pytest.raises(InvalidKey, match=r"513 bytes; the limit is 512 bytes"):
        validate_key("é" * 256 + "x", max_bytes=512)


def test_bytes_keys_decode() -> None:
    assert validate_key(b"ORDERID_100") == "ORDERID_100"


@given(st.lists(st.text(min_size=1), max_size=50), st.integers(min_value=1, max_value=64))
def test_grouping_keeps_every_key_in_its_bucket(keys: list[str], buckets: int) -> None:
    grouped = group_by_bucket(keys, buckets)
    assert sorted(k for ks in grouped.values() for k in ks) == sorted(keys)
    assert all(bucket_of(k, buckets) == b for b, ks in grouped.items() for k in ks)


def test_fingerprints_are_stable_and_distinguish_payloads() -> None:
    assert fingerprint(b"a") == fingerprint("a")
    assert fingerprint(b"a") != fingerprint(b"b")
    assert fingerprint(None) == ""
    assert len(fingerprint(b"a")) == 32


def test_default_ladder_is_rocketmqs() -> None:
    levels = DelayLevels.parse(DEFAULT_DELAY_LEVELS)
    assert levels.max_level == 18
    assert levels.delay_ms(3) == 10_000
    assert levels.delay_ms(18) == 7_200_000
    assert levels.queue_id(3) == 2
    assert [levels.level_for_retry(k) for k in (0, 1, 15, 30)] == [3, 4, 18, 18]
    assert levels.retry_horizon_ms() == 17_140_000  # 4 h 45 min 40 s


@pytest.mark.parametrize("text", ["", "1s,5s", "1 s", "0s", "5w", "-1s"])
def test_bad_ladders_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="delay_levels"):
        DelayLevels.parse(text)


def test_a_delay_past_a_week_is_refused_naming_the_level_and_the_limit() -> None:
    assert DelayLevels.parse("1s 7d").delay_ms(2) == 7 * 86_400_000
    with pytest.raises(ConfigError, match=r"^delay_levels: level 2 is 604800001 ms; the limit"):
        DelayLevels.parse("1s 604800001ms")
    with pytest.raises(ConfigError, match=r"level 1 is .* ms; the limit is 604800000 ms \(7d\)"):
        DelayLevels.parse("99999999999999999999d")
