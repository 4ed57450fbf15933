"""idem packs its big script calls itself: the bytes on the wire are redis-py's."""

from __future__ import annotations

import pytest
import redis

from idem.redis_stream import pack_script_call

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_a_script_call_is_packed_as_redis_py_packs_it(encoding: str) -> None:
    connection = redis.Connection(encoding=encoding)
    keys = ["idem:{g:0}:wm", "idem:{g:0}:c:86400000:20000"]
    args = ["idem:{g:0}", "owner", 17, "ORDERID_100", "ÄÖÜ", "", "x" * 5000, b"\xff\x00raw"]
    ours = b"".join(pack_script_call(connection, "a" * 40, keys, args))
    theirs = b"".join(connection.pack_command("EVALSHA", "a" * 40, len(keys), *keys, *args))
    assert ours == theirs
    assert ours.startswith(b"*13\r\n$7\r\nEVALSHA\r\n")


def test_an_argument_hiredis_cannot_pack_goes_through_redis_py() -> None:
    connection = redis.Connection()
    ours = b"".join(pack_script_call(connection, "a" * 40, [], [bytearray(b"k"), memoryview(b"v")]))
    assert ours == b"".join(connection.pack_command("EVALSHA", "a" * 40, 0, b"k", b"v"))
