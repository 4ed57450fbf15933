"""The maintenance commands against a real redis-server and real Delta tables: exit codes,
what a refused command leaves behind, and what they print about Redis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from idem.cli import main
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.redis_server import RedisServer, free_port
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _no_idem_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("IDEM_")]:
        monkeypatch.delenv(name)


def _exit(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def _complete(config: IdemConfig, keys: list[str]) -> None:
    dd = Dedup(config)
    dd.complete(dd.begin(keys, owner="batch-1"), batch_id=1, app_id="test")
    dd.settle()


# -- idem index rebuild ------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [[], ["--all"]], ids=["gaps", "all"])
def test_index_rebuild_with_redis_unreachable_is_exit_3_in_one_line(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    flags: list[str],
) -> None:
    """Without ``--all`` it was a ``redis.exceptions.ConnectionError`` traceback, exit 1."""
    config = IdemConfig(group="orders", redis_url=redis_server.url, data_dir=str(tmp_path))
    _complete(config, ["A", "B"])
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    argv = ["index", "rebuild", "--group", "orders", "--data-dir", str(tmp_path)]
    code, _, err = _exit(capsys, [*argv, "--redis-url", nowhere, *flags])
    assert code == 3, err
    [line] = [line for line in err.splitlines() if "error:" in line]
    assert line.startswith("idem: error: ")
    assert "Connection refused" in line


def test_index_rebuild_all_of_another_ledger_is_refused_before_dropping_anything(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
) -> None:
    """The refusal (the group's index covers another ledger) came after every bucket's
    watermark was dropped: the next batch had to rebuild the whole window."""
    real, other = tmp_path / "real", tmp_path / "other"
    config = IdemConfig(
        group="orders", redis_url=redis_server.url, data_dir=str(tmp_path), ledger_path=str(other)
    )
    _complete(config, ["X"])
    real_redis.flushall()
    _complete(config.with_changes(ledger_path=str(real)), [f"K{n}" for n in range(50)])
    common = ["--group", "orders", "--redis-url", redis_server.url, "--data-dir", str(tmp_path)]

    code, _, err = _exit(
        capsys, ["index", "rebuild", "--all", *common, "--ledger-path", str(other)]
    )
    assert code == 2
    assert "is indexed for the ledger at" in err
    code, out, _ = _exit(capsys, ["index", "status", "--json", *common, "--ledger-path", str(real)])
    states = {bucket["state"] for bucket in json.loads(out)["buckets"]}
    assert (code, states) == (0, {"current"})


# -- idem retry rebuild ------------------------------------------------------------------------


def _send_back(url: str, data_dir: Path, count: int) -> None:
    engine = RetryEngine(IdemConfig(group="orders", redis_url=url, data_dir=str(data_dir)))
    messages = [
        MessageExt(topic="orders", msg_id=f"m{n}", body=b"{}", keys=f"K{n}") for n in range(count)
    ]
    engine.send_back(messages, delay_level=18)
    engine.close()


def _live(capsys: pytest.CaptureFixture[str], url: str, data_dir: Path) -> int:
    argv = ["retry", "stats", "--json", "--group", "orders", "--redis-url", url]
    argv += ["--data-dir", str(data_dir)]
    code, out, _ = _exit(capsys, argv)
    assert code == 0
    return int(json.loads(out)["redis"]["live"])


def test_retry_rebuild_where_there_is_no_journal_clears_nothing(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
) -> None:
    """A mistyped ``--data-dir`` cleared the group's scheduled retries and printed
    "rebuilt orders from <a journal that does not exist>: 0 scheduled"."""
    data = tmp_path / "data"
    _send_back(redis_server.url, data, 3)
    assert _live(capsys, redis_server.url, data) == 3
    typo = tmp_path / "dta"
    argv = ["retry", "rebuild", "--group", "orders", "--redis-url", redis_server.url]
    code, out, _ = _exit(capsys, [*argv, "--data-dir", str(typo)])
    assert code == 0
    assert out.strip() == (
        f"idem retry rebuild: no retry journal at {typo}/orders/retry-journal yet, nothing "
        "to rebuild from; Redis left as it is"
    )
    assert _live(capsys, redis_server.url, data) == 3
    assert not typo.exists()
    code, out, _ = _exit(capsys, [*argv, "--data-dir", str(data)])  # the right one still works
    assert (code, out.split(":")[0]) == (0, f"rebuilt orders from {data}/orders/retry-journal")
    assert _live(capsys, redis_server.url, data) == 3


# -- idem schedule -----------------------------------------------------------------------------


def _schedule(argv: list[str], *, wait_s: float) -> tuple[int | None, str]:
    """Run ``idem schedule`` for up to ``wait_s``; its exit code (``None``: still running,
    then stopped with SIGTERM) and its stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEM_")}
    service = subprocess.Popen(
        [sys.executable, "-m", "idem.cli", "schedule", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        code: int | None = service.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        code = None
        service.send_signal(signal.SIGTERM)
    _, err = service.communicate(timeout=30)
    return code, err


def test_schedule_names_its_redis_without_a_query_password(tmp_path: Path) -> None:
    """``idem schedule`` prints the Redis it serves on start: redis-py's ``?password=``
    was printed as it is."""
    with RedisServer() as server:
        server.client().config_set("requirepass", "s3cret")
        url = f"redis://127.0.0.1:{server.port}/0?password=s3cret"
        env = {k: v for k, v in os.environ.items() if not k.startswith("IDEM_")}
        argv = ["--group", "g", "--redis-url", url, "--data-dir", str(tmp_path)]
        service = subprocess.Popen(
            [sys.executable, "-m", "idem.cli", "schedule", *argv],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert service.stderr is not None
        first = service.stderr.readline()  # printed once it serves, however long start-up takes
        service.send_signal(signal.SIGTERM)
        err = first + service.communicate(timeout=30)[1]
    assert first.startswith(
        f"idem schedule: group g, redis://127.0.0.1:{server.port}/0?password=***"
    )
    assert "s3cret" not in err


def test_schedule_refuses_an_evicting_redis_at_start_up(tmp_path: Path) -> None:
    """The service ran on an ``allkeys-lru`` Redis, which may evict scheduled retries."""
    with RedisServer(maxmemory_policy="allkeys-lru") as server:
        started = time.monotonic()
        code, err = _schedule(
            ["--group", "g", "--redis-url", server.url, "--data-dir", str(tmp_path)], wait_s=20
        )
    assert code == 1, err
    assert time.monotonic() - started < 20
    assert "idem: error: Redis maxmemory-policy is 'allkeys-lru'" in err
    assert "Traceback" not in err
