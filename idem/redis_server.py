"""A private ``redis-server`` on a free loopback port, for the demo and the tests.

Real Redis, started from the Debian binary with a throw-away directory; never a
mock. ``kill()`` and ``start()`` again on the same directory reproduce a crash
and a restart from the AOF/RDB that was on disk.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import redis

from idem.errors import StoreUnavailable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def redis_server_binary() -> str | None:
    """Path of ``redis-server`` if installed."""
    return shutil.which("redis-server")


class RedisServer:
    """One ``redis-server`` process bound to 127.0.0.1 with its own data directory."""

    def __init__(
        self,
        *,
        port: int | None = None,
        directory: str | Path | None = None,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        maxmemory_policy: str = "noeviction",
        extra: dict[str, str] | None = None,
    ) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise StoreUnavailable(
                "redis-server is not installed (Debian: apt-get install redis-server)"
            )
        self.binary = binary
        self.port = port or free_port()
        self._owns_dir = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="idem-redis-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.maxmemory_policy = maxmemory_policy
        self.extra = dict(extra or {})
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        """A new redis-py client for this server."""
        return redis.Redis.from_url(self.url, **kwargs)

    def _args(self) -> list[str]:
        settings = {
            "port": str(self.port),
            "bind": "127.0.0.1",
            "dir": str(self.directory),
            "save": "",
            "appendonly": "yes" if self.appendonly else "no",
            "appendfsync": self.appendfsync,
            "maxmemory-policy": self.maxmemory_policy,
            "protected-mode": "yes",
            "daemonize": "no",
            "logfile": str(self.directory / "redis.log"),
            **self.extra,
        }
        args = [self.binary]
        for name, value in settings.items():
            args += [f"--{name}", value]
        return args

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        # stderr to a file: a pipe nobody reads would block the server once it filled up
        errors = self.directory / "redis.stderr"
        with errors.open("wb") as sink:
            self._proc = subprocess.Popen(self._args(), stdout=subprocess.DEVNULL, stderr=sink)
        deadline = time.monotonic() + timeout
        probe = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    err = errors.read_text(errors="replace")
                    log = self.directory / "redis.log"
                    detail = log.read_text() if log.exists() else err
                    raise StoreUnavailable(f"redis-server exited at start: {detail[-2000:]}")
                with contextlib.suppress(redis.ConnectionError, redis.BusyLoadingError):
                    if probe.ping():
                        return self
                time.sleep(0.02)
        finally:
            probe.close()
        self.kill()
        raise StoreUnavailable(f"redis-server on port {self.port} did not answer in {timeout}s")

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed beyond what the server already wrote."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def stop(self) -> None:
        """Kill the process and remove the directory if it was ours."""
        self.kill()
        if self._owns_dir:
            shutil.rmtree(self.directory, ignore_errors=True)

    def restart(self) -> RedisServer:
        """Crash and start again on the same port and data directory."""
        self.kill()
        return self.start()

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
