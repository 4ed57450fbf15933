"""A TCP fault proxy between idem and a redis-server, on 127.0.0.1 only.

Clients connect to the proxy as if it were Redis; each connection gets its own
upstream connection and one thread that moves bytes both ways. The proxy reads
the Redis protocol in both directions (requests are arrays of bulk strings,
replies RESP2 or RESP3 values), so a fault hits one chosen request and its own
reply, never a byte range:

- ``DROP_REPLY``: the request reaches Redis and runs; its reply (and every later
  one on that connection) is swallowed, the connection stays open, the client's
  socket time-out fires: an unknown outcome.
- ``DELAY``: the request runs; its reply (and the later ones) arrives ``delay_s``
  later, past the client's time-out.
- ``HALF_OPEN``: from the request on nothing moves either way and the proxy never
  closes the connection (a peer gone without a FIN). With ``forward=True`` the
  request itself still reached Redis.
- ``RESET``: the request runs, its reply is read and thrown away, and the client
  gets a TCP RST (``SO_LINGER`` 0), not a FIN.

:meth:`FaultProxy.arm` aims a fault at the next request(s) a :data:`Matcher`
accepts (see :mod:`redis_ops` for idem's operations); :meth:`FaultProxy.cut`
hits every open connection at once (a network cut). Every fault injected is
recorded in :attr:`FaultProxy.injected`.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType

LOOPBACK = "127.0.0.1"

Matcher = Callable[[Sequence[bytes]], bool]
"""Whether a request (its command name and arguments, as sent) is one to fault."""


class Fault(StrEnum):
    """What the proxy does to a matched request (see the module doc)."""

    DROP_REPLY = "drop-reply"
    DELAY = "delay"
    HALF_OPEN = "half-open"
    RESET = "reset"


@dataclass(frozen=True)
class Injected:
    """One fault the proxy injected."""

    fault: Fault
    label: str
    command: str
    at: float
    """``time.monotonic()`` when it was injected."""


@dataclass
class Rule:
    """Inject ``fault`` into the next ``times`` requests ``when`` accepts (after ``skip``)."""

    fault: Fault
    when: Matcher
    label: str
    times: int = 1
    skip: int = 0
    forward: bool = True
    delay_s: float = 3.0
    fired: int = 0


# -- the Redis protocol, incrementally ---------------------------------------------------

_BULK = b"$!="  # a length, then that many bytes
_AGGREGATE = b"*~>"  # n values
_PAIRS = b"%|"  # 2n values
_OUT_OF_BAND = b">|"  # a push, or attributes before the real reply: no reply of their own


def _value_end(buf: bytes | bytearray, pos: int) -> int | None:
    """Where the RESP value starting at ``pos`` ends, or ``None`` when it is incomplete."""
    stack = [1]
    while stack:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        kind = buf[pos : pos + 1]
        nxt = eol + 2
        stack[-1] -= 1
        if kind and kind in _BULK:
            size = int(buf[pos + 1 : eol])
            if size >= 0:
                nxt += size + 2
                if len(buf) < nxt:
                    return None
        elif kind and kind in _AGGREGATE + _PAIRS:
            count = int(buf[pos + 1 : eol])
            if count > 0:
                stack.append(count * (2 if kind in _PAIRS else 1))
        pos = nxt
        while stack and stack[-1] == 0:
            stack.pop()
    return pos


def _request(buf: bytearray) -> tuple[list[bytes], int] | None:
    """The first complete request in ``buf`` (its arguments) and where it ends."""
    if not buf:
        return None
    if buf[:1] != b"*":  # an inline command (redis-cli style)
        eol = buf.find(b"\r\n")
        return None if eol < 0 else (bytes(buf[:eol]).split(), eol + 2)
    end = _value_end(buf, 0)
    if end is None:
        return None
    args: list[bytes] = []
    eol = buf.find(b"\r\n")
    pos = eol + 2
    for _ in range(int(buf[1:eol])):
        head = buf.find(b"\r\n", pos)
        size = int(buf[pos + 1 : head])
        args.append(bytes(buf[head + 2 : head + 2 + size]))
        pos = head + 2 + size + 2
    return args, end


def command_text(args: Sequence[bytes]) -> str:
    """A short text of a request for records and messages."""
    head = " ".join(a.decode("utf-8", "replace")[:48] for a in args[:3])
    return head + (" ..." if len(args) > 3 else "")


# -- one proxied connection ----------------------------------------------------------------


def _reset(sock: socket.socket) -> None:
    """Close with an RST rather than a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


@dataclass
class _Connection:
    proxy: FaultProxy
    client: socket.socket
    upstream: socket.socket | None
    blackhole: bool = False
    pubsub: bool = False
    requests: int = 0
    """Requests forwarded so far: the next one's reply is reply number ``requests``."""
    replies: int = 0
    mute_from: int | None = None
    delay_from: int | None = None
    delay_s: float = 0.0
    reset_at: int | None = None
    reset_deadline: float = 0.0
    reset_now: bool = False
    closed: bool = False
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    held: list[tuple[float, bytes]] = field(default_factory=list)

    def run(self) -> None:
        try:
            self._loop()
        except OSError:
            pass
        finally:
            self._close()

    def _close(self) -> None:
        self.closed = True
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self.proxy._forget(self)

    def _loop(self) -> None:
        while not self.closed and not self.proxy._stopping.is_set():
            overdue = self.reset_at is not None and time.monotonic() > self.reset_deadline
            if self.reset_now or overdue:
                _reset(self.client)
                return
            socks = [self.client] + ([self.upstream] if self.upstream is not None else [])
            wait = 0.05
            if self.held:
                wait = max(0.0, min(wait, self.held[0][0] - time.monotonic()))
            readable, _, _ = select.select(socks, [], [], wait)
            if self.client in readable:
                data = self.client.recv(1 << 16)
                if not data:
                    return
                if not self.blackhole:
                    self._from_client(data)
            if self.upstream is not None and self.upstream in readable and not self.closed:
                data = self.upstream.recv(1 << 16)
                if not data:
                    return  # Redis went away: so does the client's connection
                if not self.blackhole:
                    self._from_server(data)
            self._release_held()

    def _from_client(self, data: bytes) -> None:
        self.inbuf += data
        out = bytearray()
        while (parsed := _request(self.inbuf)) is not None:
            args, end = parsed
            raw = bytes(self.inbuf[:end])
            del self.inbuf[:end]
            if args and args[0].upper() in (b"SUBSCRIBE", b"PSUBSCRIBE", b"SSUBSCRIBE"):
                self.pubsub = True  # replies no longer pair with requests
            rule = None if self.pubsub else self.proxy._match(args)
            if rule is None:
                out += raw
                self.requests += 1
                continue
            self.proxy._record(rule, args)
            if rule.forward or rule.fault in (Fault.DROP_REPLY, Fault.DELAY):
                out += raw
                index = self.requests
                self.requests += 1
            else:
                index = -1
            if rule.fault is Fault.DROP_REPLY:
                self.mute_from = index if self.mute_from is None else self.mute_from
            elif rule.fault is Fault.DELAY:
                self.delay_from, self.delay_s = index, rule.delay_s
            elif rule.fault is Fault.HALF_OPEN:
                self._send_upstream(out)
                self.blackhole = True
                self.inbuf.clear()
                return
            else:  # RESET: once the request has run (its reply came back), or at once
                self._send_upstream(out)
                self.inbuf.clear()
                if index < 0:
                    self.reset_now = True
                else:
                    self.reset_at, self.reset_deadline = index, time.monotonic() + 5.0
                return
        self._send_upstream(out)

    def _send_upstream(self, data: bytes | bytearray) -> None:
        if data and self.upstream is not None:
            self.upstream.sendall(data)

    def _from_server(self, data: bytes) -> None:
        self.outbuf += data
        if self.pubsub:
            out, self.outbuf = bytes(self.outbuf), bytearray()
            self._to_client(out, self.replies)
            return
        while (end := _value_end(self.outbuf, 0)) is not None:
            frame = bytes(self.outbuf[:end])
            del self.outbuf[:end]
            index = self.replies
            if frame[:1] not in _OUT_OF_BAND:
                self.replies += 1
            if self.reset_at is not None and index >= self.reset_at:
                self.reset_now = True
                return
            self._to_client(frame, index)

    def _to_client(self, frame: bytes, index: int) -> None:
        if self.mute_from is not None and index >= self.mute_from:
            return
        if self.delay_from is not None and index >= self.delay_from:
            self.held.append((time.monotonic() + self.delay_s, frame))
            return
        if self.held:  # keep the order of replies
            self.held.append((self.held[-1][0], frame))
            return
        self.client.sendall(frame)

    def _release_held(self) -> None:
        now = time.monotonic()
        while self.held and self.held[0][0] <= now:
            _, frame = self.held.pop(0)
            try:
                self.client.sendall(frame)
            except OSError:  # the client gave up on this connection long ago
                self.held.clear()
                return


# -- the proxy -----------------------------------------------------------------------------


class FaultProxy:
    """A Redis-aware TCP proxy on 127.0.0.1 in front of ``upstream_port``."""

    def __init__(self, upstream_port: int, *, port: int = 0) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, port))
        self._listener.listen(128)
        self._listener.settimeout(0.1)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._connections: list[_Connection] = []
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._cut_until = 0.0
        self.injected: list[Injected] = []
        self.accepted = 0
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name="fault-proxy")

    def url(self, socket_timeout: float | None = None) -> str:
        """A Redis URL of the proxy (with the clients' socket time-out, when given)."""
        query = "" if socket_timeout is None else f"?socket_timeout={socket_timeout:g}"
        return f"redis://{LOOPBACK}:{self.port}/0{query}"

    def start(self) -> FaultProxy:
        """Accept connections (in a daemon thread)."""
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Close every connection and stop accepting."""
        self._stopping.set()
        self._acceptor.join(5)
        with contextlib.suppress(OSError):
            self._listener.close()
        for thread in list(self._threads):
            thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- faults --------------------------------------------------------------------------

    def arm(
        self,
        fault: Fault,
        when: Matcher,
        *,
        label: str,
        times: int = 1,
        skip: int = 0,
        forward: bool = True,
        delay_s: float = 3.0,
    ) -> Rule:
        """Inject ``fault`` into the next ``times`` requests ``when`` accepts, after letting
        ``skip`` of them through."""
        rule = Rule(fault, when, label, times=times, skip=skip, forward=forward, delay_s=delay_s)
        with self._lock:
            self._rules.append(rule)
        return rule

    def disarm(self) -> None:
        """Forget every rule not fired yet."""
        with self._lock:
            self._rules.clear()

    def cut(self, fault: Fault, *, duration_s: float = 0.0, label: str = "cut") -> int:
        """Hit every open connection now: ``RESET`` resets them, ``HALF_OPEN`` makes them
        (and every connection accepted for ``duration_s``) silent for good. Returns how
        many connections were hit."""
        if fault not in (Fault.RESET, Fault.HALF_OPEN):
            raise ValueError(f"fault: a cut is RESET or HALF_OPEN, not {fault}")
        with self._lock:
            hit = list(self._connections)
            if fault is Fault.HALF_OPEN:
                self._cut_until = time.monotonic() + duration_s
            what = f"{len(hit)} connections"
            self.injected.append(Injected(fault, label, what, time.monotonic()))
        for conn in hit:
            if fault is Fault.RESET:
                conn.reset_now = True
            else:
                conn.blackhole = True
        return len(hit)

    def injected_of(self, label: str) -> list[Injected]:
        """The faults injected by rules (or cuts) labelled ``label``."""
        with self._lock:
            return [i for i in self.injected if i.label == label]

    @property
    def connections(self) -> int:
        """Connections open now."""
        with self._lock:
            return len(self._connections)

    def _match(self, args: Sequence[bytes]) -> Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.fired >= rule.times or not rule.when(args):
                    continue
                if rule.skip > 0:
                    rule.skip -= 1
                    continue
                rule.fired += 1
                return rule
        return None

    def _record(self, rule: Rule, args: Sequence[bytes]) -> None:
        with self._lock:
            self.injected.append(
                Injected(rule.fault, rule.label, command_text(args), time.monotonic())
            )

    # -- connections -----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                cut = time.monotonic() < self._cut_until
            upstream: socket.socket | None = None
            if not cut:
                try:
                    upstream = socket.create_connection((LOOPBACK, self.upstream_port), timeout=2)
                except OSError:  # Redis is down: so is the proxy, for this client
                    client.close()
                    continue
                upstream.settimeout(None)
                upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, client, upstream, blackhole=cut)
            thread = threading.Thread(target=conn.run, daemon=True, name="fault-proxy-conn")
            with self._lock:
                self.accepted += 1
                self._connections.append(conn)
                self._threads = [t for t in self._threads if t.is_alive()]
                self._threads.append(thread)
            thread.start()

    def _forget(self, conn: _Connection) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._connections.remove(conn)
