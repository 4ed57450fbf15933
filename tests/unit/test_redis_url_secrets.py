"""A Redis password is never echoed back, however the URL carries it.

A password holding an unencoded ``/``, ``?`` or ``#`` ends urllib's host part early,
so what follows it was read as the port, the database or the query, and quoted in
the refusal; a password given as redis-py's ``?password=`` query argument was
printed as it is by ``idem schedule``'s start-up line.
"""

from __future__ import annotations

import pytest

from idem.cli import main
from idem.config import IdemConfig
from idem.errors import ConfigError
from idem.redis_client import redacted, redis_url_problem

pytestmark = pytest.mark.unit

SECRET = "s3cret"

SPILLED = [
    f"redis://idem:PW9/{SECRET}@10.0.0.5:6379/0",
    f"redis://idem:PW9?{SECRET}@10.0.0.5:6379/0",
    f"redis://idem:PW9#{SECRET}@10.0.0.5:6379/0",
    f"rediss://idem:1234/{SECRET}@10.0.0.5:6380/0",
    f"redis+cluster://idem:PW9/{SECRET}@10.0.0.5:7000",
]
"""URLs whose password holds an unencoded reserved character."""


@pytest.mark.parametrize("url", SPILLED)
def test_a_password_with_an_unencoded_reserved_character_is_refused_unechoed(url: str) -> None:
    """It said ``port 'pa' is not a number`` or ``database 's3cret@10.0.0.5:6379/0' ...``."""
    problem = redis_url_problem(url)
    assert problem is not None
    assert SECRET not in problem
    assert "PW9" not in problem
    assert "1234" not in problem
    assert "percent-encode" in problem
    with pytest.raises(ConfigError) as info:
        IdemConfig(group="g", redis_url=url)
    assert SECRET not in str(info.value)


@pytest.mark.parametrize("url", SPILLED)
def test_redacted_hides_a_password_urllib_cannot_find(url: str) -> None:
    shown = redacted(url)
    assert SECRET not in shown
    assert shown.endswith("@10.0.0.5:" + url.rpartition("@10.0.0.5:")[2])


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            f"redis://idem@10.0.0.5:6379/0?password={SECRET}",
            "redis://idem@10.0.0.5:6379/0?password=***",
        ),
        (
            f"redis://10.0.0.5:6379/0?socket_timeout=5&password={SECRET}&db=0",
            "redis://10.0.0.5:6379/0?socket_timeout=5&password=***&db=0",
        ),
        (f"redis://10.0.0.5:6379/0?password=a@{SECRET}", "redis://10.0.0.5:6379/0?password=***"),
    ],
)
def test_redacted_hides_a_password_in_the_query(url: str, shown: str) -> None:
    """redis-py takes ``?password=`` (and the URL is valid): it was shown as it is."""
    assert redis_url_problem(url) is None
    assert redacted(url) == shown


def test_valid_urls_are_still_taken() -> None:
    for url in (
        "redis://idem:pa%2Fss@10.0.0.5:6379/0",
        f"redis://10.0.0.5:6379/0?password=a@{SECRET}",
        "unix://:pw@/run/redis/redis.sock?db=0",
    ):
        assert redis_url_problem(url) is None, url


def test_a_spilled_password_flag_is_exit_2_without_the_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["retry", "stats", "--group", "g", "--redis-url", SPILLED[0]]) == 2
    err = capsys.readouterr().err
    assert "idem: error: --redis-url:" in err
    assert SECRET not in err


def test_an_ssl_key_password_in_the_query_is_redacted() -> None:
    url = f"rediss://10.0.0.5:6380/0?ssl_keyfile=/k.pem&ssl_password={SECRET}"
    assert redacted(url) == "rediss://10.0.0.5:6380/0?ssl_keyfile=/k.pem&ssl_password=***"


def test_a_configs_repr_shows_no_secret_of_its_redis_url() -> None:
    config = IdemConfig(
        group="orders", redis_url=f"rediss://idem:{SECRET}@10.0.0.5:6380/0?ssl_password={SECRET}"
    )
    assert SECRET not in repr(config)
    assert SECRET not in f"{config}"
    assert "rediss://idem:***@10.0.0.5:6380/0" in repr(config)
