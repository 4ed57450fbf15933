"""The fault proxy injects the faults it names, on a real redis-server.

Each fault hits one chosen request: the command still runs on Redis (an unknown
outcome for the client) unless the fault says otherwise, and the client sees what a
real network would show it: a time-out, a late reply, silence, or a reset.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

import pytest
import redis
from proxy import Fault, FaultProxy
from redis.backoff import NoBackoff
from redis.retry import Retry

pytestmark = pytest.mark.faults

TIMEOUT_S = 0.4


def _client(proxy: FaultProxy) -> redis.Redis:
    """A client that does not retry, so the fault shows as it is."""
    return redis.Redis.from_url(proxy.url(socket_timeout=TIMEOUT_S), retry=Retry(NoBackoff(), 0))


def _incr(args: Sequence[bytes]) -> bool:
    """``INCR`` or ``INCRBY`` (what redis-py sends for ``incr``)."""
    return bool(args) and args[0].upper() in (b"INCR", b"INCRBY")


@pytest.mark.parametrize(
    ("fault", "forward", "error", "ran"),
    [
        (Fault.DROP_REPLY, True, redis.TimeoutError, True),
        (Fault.DELAY, True, redis.TimeoutError, True),
        (Fault.HALF_OPEN, True, redis.TimeoutError, True),
        (Fault.HALF_OPEN, False, redis.TimeoutError, False),
        (Fault.RESET, True, redis.ConnectionError, True),
        (Fault.RESET, False, redis.ConnectionError, False),
    ],
)
def test_a_fault_hits_the_matched_command_only(  # noqa: PLR0917 (fixtures and parameters)
    proxy: FaultProxy,
    real_redis: redis.Redis,
    fault: Fault,
    forward: bool,
    error: type[Exception],
    ran: bool,
) -> None:
    client = _client(proxy)
    assert client.set("before", 1)
    proxy.arm(fault, _incr, label="incr", forward=forward, delay_s=TIMEOUT_S * 3)
    with pytest.raises(error) as raised:
        client.incr("counter")
    if fault is Fault.RESET:
        assert "reset" in str(raised.value).lower(), raised.value  # an RST, not a FIN
    assert real_redis.get("counter") == (b"1" if ran else None)
    assert [i.fault for i in proxy.injected_of("incr")] == [fault]
    # a new connection works, and the rule fired once only
    fresh = _client(proxy)
    assert fresh.incr("counter") == (2 if ran else 1)
    assert fresh.get("before") == b"1"
    client.close()
    fresh.close()


def test_a_delayed_reply_arrives_late(proxy: FaultProxy, real_redis: redis.Redis) -> None:
    with socket.create_connection(("127.0.0.1", proxy.port)) as raw:
        proxy.arm(Fault.DELAY, _incr, label="late", delay_s=0.6)
        started = time.monotonic()
        raw.sendall(b"*2\r\n$4\r\nINCR\r\n$1\r\nn\r\n*1\r\n$4\r\nPING\r\n")
        raw.settimeout(3)
        got = b""
        while not got.endswith(b"+PONG\r\n"):
            got += raw.recv(100)
        assert got == b":1\r\n+PONG\r\n"  # in order, the reply after it held back too
        assert time.monotonic() - started >= 0.6
    assert real_redis.get("n") == b"1"


def test_a_cut_resets_every_open_connection(proxy: FaultProxy) -> None:
    sockets = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(3)]
    for raw in sockets:
        raw.sendall(b"*1\r\n$4\r\nPING\r\n")
        raw.settimeout(3)
        assert raw.recv(100) == b"+PONG\r\n"
    assert proxy.cut(Fault.RESET) == 3
    for raw in sockets:
        with pytest.raises(ConnectionResetError):
            raw.recv(100)
        raw.close()
    client = _client(proxy)  # a new connection works
    assert client.ping()
    client.close()


def test_a_half_open_cut_silences_new_connections_until_it_ends(proxy: FaultProxy) -> None:
    client = _client(proxy)
    client.ping()
    proxy.cut(Fault.HALF_OPEN, duration_s=1.0)
    with pytest.raises(redis.TimeoutError):
        client.ping()
    with pytest.raises(redis.TimeoutError):
        _client(proxy).ping()  # accepted, but nothing comes back
    time.sleep(1.0)
    assert _client(proxy).ping()
    client.close()
