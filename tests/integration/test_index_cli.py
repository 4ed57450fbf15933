"""``idem index status|rebuild`` against a real redis-server and a real Delta ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from idem.cli import main
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.redis_server import RedisServer

pytestmark = pytest.mark.integration


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, object]]]:
    """The exit code and the data of ``idem argv --json``: the buckets of ``index status``,
    else the one report in a list."""
    code = main([*argv, "--json"])
    document = json.loads(capsys.readouterr().out)
    if "buckets" in document:
        return code, document["buckets"]
    return code, [document]


def test_rebuild_warms_a_flushed_redis_before_traffic(
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = IdemConfig(group="orders", redis_url=redis_server.url, data_dir=str(tmp_path))
    keys = [f"ORDERID_{n}" for n in range(500)]
    dd = Dedup(config)
    dd.complete(dd.begin(keys, owner="batch-1"), batch_id=1, app_id="test")
    common = ("--group", "orders", "--redis-url", redis_server.url, "--data-dir", str(tmp_path))

    real_redis.flushall()  # Redis lost everything
    code, buckets = _run(capsys, "index", "status", *common)
    assert code == 0
    assert {b["state"] for b in buckets} == {"missing"}
    assert sum(int(str(b["keys"])) for b in buckets) == 0

    code, [report] = _run(capsys, "index", "rebuild", *common)
    assert code == 0
    assert report["rebuilt_keys"] == 500
    assert report["rebuilt_buckets"] == config.buckets

    code, buckets = _run(capsys, "index", "status", *common)
    assert {b["state"] for b in buckets} == {"current"}
    assert sum(int(str(b["keys"])) for b in buckets) == 500
    # The next batch needs no rebuild of its own: every key is a known duplicate.
    fresh = Dedup(config)
    claim = fresh.begin(keys, owner="batch-2")
    assert len(claim.duplicates) == 500
    assert fresh.stats.rebuilt_buckets == 0

    code, [again] = _run(capsys, "index", "rebuild", *common)
    assert (again["rebuilt_buckets"], again["caught_up_keys"]) == (0, 0)  # nothing missing
    code, [forced] = _run(capsys, "index", "rebuild", "--all", *common)
    assert (forced["rebuilt_buckets"], forced["rebuilt_keys"]) == (config.buckets, 500)


def test_the_maintenance_commands_take_the_bucket_count_the_ledger_records(
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A group with 4 buckets (not the default 16): ``idem index`` and ``idem ledger`` work
    with no IDEM_BUCKETS, and the rebuilt index answers the group's own claims."""
    monkeypatch.delenv("IDEM_BUCKETS", raising=False)
    config = IdemConfig(group="four", redis_url=redis_server.url, data_dir=str(tmp_path), buckets=4)
    keys = [f"ORDERID_{n}" for n in range(200)]
    dd = Dedup(config)
    dd.complete(dd.begin(keys, owner="batch-1"), batch_id=1, app_id="test")
    common = ("--group", "four", "--data-dir", str(tmp_path))

    code, [version] = _run(capsys, "ledger", "version", *common)
    assert code == 0
    assert version["version"] == 0
    real_redis.flushall()
    code, [report] = _run(capsys, "index", "rebuild", "--redis-url", redis_server.url, *common)
    assert code == 0
    assert (report["rebuilt_buckets"], report["rebuilt_keys"]) == (4, 200)
    claim = Dedup(config).begin(keys, owner="batch-2")
    assert len(claim.duplicates) == 200


def test_pointed_at_the_wrong_ledger_status_says_ahead_and_rebuild_drops_nothing(
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Delta sink's table is its group's ledger; the default path holds none. ``status``
    called the buckets 'current' (Redis had indexed version 0 of a ledger at version -1),
    and ``rebuild --all`` dropped every watermark and rebuilt from nothing."""
    sink = tmp_path / "orders-table"
    config = IdemConfig(
        group="sinked", redis_url=redis_server.url, data_dir=str(tmp_path), ledger_path=str(sink)
    )
    dd = Dedup(config)
    dd.complete(dd.begin(["A", "B"], owner="batch-1"), batch_id=1, app_id="test")
    common = ("--group", "sinked", "--redis-url", redis_server.url, "--data-dir", str(tmp_path))

    assert main(["index", "status", "--json", *common]) == 1
    out, err = capsys.readouterr()
    states = {bucket["state"] for bucket in json.loads(out)["buckets"]}
    assert "ahead" in states
    assert "A Delta sink's table is its own ledger: pass --ledger-path TABLE" in err
    code, [report] = _run(capsys, "index", "rebuild", "--all", *common)
    assert (code, report["ledger_version"], report["rebuilt_keys"]) == (0, -1, 0)
    code, buckets = _run(capsys, "index", "status", *common, "--ledger-path", str(sink))
    assert code == 0
    assert sum(int(str(b["keys"])) for b in buckets) == 2
    assert {b["state"] for b in buckets} <= {"current", "missing"}
