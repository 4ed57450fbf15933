"""``idem acl user``: bad input is refused naming the field, and a password never appears
unless the user gave one."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from idem.acl import acl_user_line, producer_user_line, setuser_args
from idem.cli import main as idem_main
from idem.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: acl_user_line("orders*"), r"group: 'orders\*' must be 1\.\.200 characters"),
        (lambda: acl_user_line(".."), "group: '..' must be"),
        (lambda: acl_user_line("orders", topics=["my topic"]), "topic: 'my topic' must be"),
        (lambda: acl_user_line("orders", topics=["a:b"]), "topic: 'a:b' must be"),
        (lambda: acl_user_line("orders", user="bad user"), "user: 'bad user' must be"),
        (lambda: acl_user_line("orders", password="two words"), "password: must be"),
        (lambda: acl_user_line("orders", password_sha256="abc"), "password_sha256: must be"),
        (lambda: producer_user_line("shop", topics=[]), "topics: a producer's user needs"),
        (lambda: setuser_args("on >pw"), "ACL line: "),
    ],
)
def test_bad_input_is_refused_naming_the_field(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()


def test_passwords_are_placeholders_unless_given() -> None:
    assert ">CHANGE-ME-idem-orders-password" in acl_user_line("orders").split()
    assert ">s3cret" in acl_user_line("orders", password="s3cret").split()
    digest = hashlib.sha256(b"s3cret").hexdigest()
    line = acl_user_line("orders", password_sha256=digest)
    assert f"#{digest}" in line.split()
    assert ">" not in line
    assert setuser_args(line)[:2] == ["idem-orders", "reset"]


def test_cli_reads_the_password_from_the_named_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORDERS_PW", "s3cret")
    assert idem_main(["acl", "user", "--group", "orders", "--password-env", "ORDERS_PW"]) == 0
    out, err = capsys.readouterr()
    assert out.split()[:4] == ["user", "idem-orders", "on", ">s3cret"]
    assert err == ""
    assert idem_main(["acl", "user", "--group", "orders", "--password-env", "UNSET_PW_X"]) == 2
    assert "--password-env: the variable UNSET_PW_X is not set" in capsys.readouterr().err
    assert idem_main(["acl", "user", "--group", "orders"]) == 0
    out, err = capsys.readouterr()
    assert ">CHANGE-ME-idem-orders-password" in out
    assert "CHANGE-ME" in err
    assert idem_main(["acl", "user", "--producer", "--topic", "orders"]) == 2
    assert "--user: a producer's user needs a name" in capsys.readouterr().err


def test_a_topic_the_group_also_sends_to_is_writable_and_the_others_read_only() -> None:
    rules = acl_user_line("orders", topics=["orders", "audit"], write_topics=["audit"]).split()
    assert "~rmq:topic:{audit}:*" in rules
    assert "%R~rmq:topic:{orders}:*" in rules
    assert not any(r.endswith("rmq:topic:{audit}:*") and r.startswith("%R") for r in rules)
