"""Configuration: validated once, refusals name the setting and the limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from idem.config import DedupMode, IdemConfig, MismatchPolicy, parse_duration_ms
from idem.delay_levels import DelayLevels
from idem.errors import ConfigError
from idem.retry.consumer import ConsumerSettings

pytestmark = pytest.mark.unit


def test_defaults_match_the_documented_ones() -> None:
    config = IdemConfig(group="orders")
    assert config.mode is DedupMode.INDEX
    assert config.max_key_bytes == 512
    assert config.lease_ms == 5 * 60_000
    assert config.dedup_window_ms == 7 * 86_400_000
    assert config.max_reconsume_times == 16
    assert config.max_message_bytes == 4 * 1024 * 1024  # RocketMQ's maxMessageSize
    assert config.retry_horizon_ms == (4 * 3600 + 45 * 60 + 40) * 1000
    assert config.resolved_ledger_path.endswith("orders/ledger")


def test_a_window_shorter_than_the_retry_horizon_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"dedup_window_ms.*4 h 45 min 40 s"):
        IdemConfig(group="orders", dedup_window_ms=4 * 3600 * 1000)


def test_a_short_ladder_allows_a_short_window() -> None:
    config = IdemConfig(group="demo", delay_levels="1s 1s 1s 1s", dedup_window_ms=60_000)
    assert config.retry_horizon_ms == 16_000  # 16 retries clamped to the top level, 1 s each


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"group": "a{b}"}, "group"),
        ({"group": ""}, "group"),
        ({"redis_url": "http://x"}, r"redis_url: 'http://x' must start with .*redis\+cluster://"),
        ({"buckets": 0}, r"buckets: 0 is outside the allowed range 1..1024"),
        ({"max_key_bytes": 10**6}, "max_key_bytes"),
        ({"max_message_bytes": 4}, r"max_message_bytes: 4 is outside the allowed range 1024\.\."),
        ({"max_message_bytes": 2**30}, r"max_message_bytes: .* range 1024..268435456"),
        ({"mode": "eventual"}, r"mode: 'eventual' is not one of index, strict"),
        ({"mismatch_policy": "ignore"}, "mismatch_policy"),
        ({"delay_levels": "1s 5x"}, r"level 2 is '5x'"),
        ({"delay_levels": 5}, r"delay_levels: expected levels like '1s 5s 10s', got 5"),
        ({"group": "orders\n"}, r"group: 'orders\\n' must be"),  # '$' matched before a newline
        ({"group": ".."}, r"group: '\.\.' .* not only dots"),  # the ledger escaped data_dir
        ({"data_dir": None}, r"data_dir: expected a directory path or URI, got None"),
        ({"ledger_path": 5}, r"ledger_path: expected a directory path or URI, got 5"),
    ],
)
def test_bad_settings_are_refused_by_name(changes: dict[str, object], message: str) -> None:
    settings: dict[str, object] = {"group": "orders", **changes}
    with pytest.raises(ConfigError, match=message):
        IdemConfig(**settings)  # type: ignore[arg-type]


def test_a_cluster_url_is_a_redis_url() -> None:
    config = IdemConfig(group="orders", redis_url="rediss+cluster://idem:pw@node-1:7000")
    assert config.redis_url.startswith("rediss+cluster://")


def test_environment_variables_are_read_and_overridden_by_arguments() -> None:
    env = {
        "IDEM_GROUP": "billing",
        "IDEM_BUCKETS": "4",
        "IDEM_DEDUP_WINDOW_MS": "2d",
        "IDEM_MODE": "strict",
        "IDEM_MISMATCH_POLICY": "raise",
        "IDEM_DELAY_LEVELS": "1s 2s 3s",
        "IDEM_MAX_MESSAGE_BYTES": "1048576",
    }
    config = IdemConfig.from_env(env, buckets=32)
    assert config.group == "billing"
    assert config.buckets == 32
    assert config.dedup_window_ms == 2 * 86_400_000
    assert config.mode is DedupMode.STRICT
    assert config.mismatch_policy is MismatchPolicy.RAISE
    assert config.delay_levels == DelayLevels.parse("1s 2s 3s")
    assert config.max_message_bytes == 1_048_576


def test_environment_errors_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="IDEM_BUCKETS"):
        IdemConfig.from_env({"IDEM_GROUP": "g", "IDEM_BUCKETS": "many"})
    with pytest.raises(ConfigError, match="IDEM_MAX_MESSAGE_BYTES: '4MiB'"):
        IdemConfig.from_env({"IDEM_GROUP": "g", "IDEM_MAX_MESSAGE_BYTES": "4MiB"})
    with pytest.raises(ConfigError, match="IDEM_LEASE_MS"):
        IdemConfig.from_env({"IDEM_GROUP": "g", "IDEM_LEASE_MS": "soon"})
    with pytest.raises(ConfigError, match="IDEM_GROUP"):
        IdemConfig.from_env({})


def test_durations() -> None:
    assert parse_duration_ms("250", setting="x") == 250
    assert parse_duration_ms("10s", setting="x") == 10_000
    assert parse_duration_ms("2h", setting="x") == 7_200_000
    with pytest.raises(ConfigError, match=r"x: '1\.5h'"):
        parse_duration_ms("1.5h", setting="x")


def test_object_store_data_dirs_keep_their_scheme() -> None:
    config = IdemConfig(group="orders", data_dir="s3://bucket/idem/")
    assert config.resolved_ledger_path == "s3://bucket/idem/orders/ledger"
    assert config.resolved_dlq_path == "s3://bucket/idem/orders/dlq"


def test_a_path_object_is_taken_as_its_text() -> None:
    config = IdemConfig(group="orders", data_dir=Path("/srv/idem"))  # type: ignore[arg-type]
    assert config.resolved_ledger_path == "/srv/idem/orders/ledger"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"consume_timestamp_ms": "yesterday"}, "consume_timestamp_ms: expected a whole number"),
        ({"consume_timestamp_ms": -1}, r"consume_timestamp_ms: -1 is outside .* 0\.\."),
        ({"max_reconsume_times": 1.5}, "max_reconsume_times: expected a whole number, got 1.5"),
        ({"max_reconsume_times": 10**9}, r"max_reconsume_times: .* range -1\.\.1000"),
        ({"heartbeat_expire_ms": "600"}, "heartbeat_expire_ms: expected a whole number"),
        ({"lock_ttl_ms": 10**18}, r"lock_ttl_ms: .* range 10\.\.86400000"),
        ({"offset_store_dir": 5}, "offset_store_dir: expected a path, got 5"),
    ],
)
def test_bad_consumer_settings_are_refused_by_name(
    changes: dict[str, object], message: str
) -> None:
    """Refused at construction, not taken as given: a text timestamp would leave the consumer
    never pulling (a warning every rebalance), a text or fractional count would fail later
    with a TypeError."""
    with pytest.raises(ConfigError, match=message):
        ConsumerSettings(**changes)  # type: ignore[arg-type]
