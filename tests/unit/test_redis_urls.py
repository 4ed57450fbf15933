"""Redis URLs in logs and error messages never show the password."""

from __future__ import annotations

import pytest

from idem.errors import StoreUnavailable
from idem.redis_client import redacted
from idem.redis_server import free_port
from idem.spark.run import check_redis

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://idem:s3cret@10.0.0.1:6379/0", "redis://idem:***@10.0.0.1:6379/0"),
        ("rediss://:s3cret@redis.example:6380", "rediss://:***@redis.example:6380"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://idem@127.0.0.1:6379", "redis://idem@127.0.0.1:6379"),
    ],
)
def test_a_password_in_a_redis_url_is_masked(url: str, shown: str) -> None:
    assert redacted(url) == shown


def test_an_unreachable_redis_is_named_without_its_password() -> None:
    url = f"redis://idem:s3cret@127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailable) as info:
        check_redis(url, timeout=0.5)
    assert "s3cret" not in str(info.value)
    assert "redis://idem:***@127.0.0.1" in str(info.value)
