"""``--json`` on every ``idem`` command that prints data: stdout is one JSON document.

Each command runs against a real redis-server and real Delta tables holding a
group's completed keys, scheduled retries and dead letters; its stdout is parsed
whole as JSON and the document must say what the command did. Prose goes to
stderr, so a script can pipe stdout into ``jq``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import click
import pytest
from pyspark.sql import SparkSession

from idem.cli import build_cli, main
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.redis_server import RedisServer
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt

pytestmark = pytest.mark.integration

KEYS = [f"ORDERID_{n}" for n in range(40)]

CORE_COMMANDS = {
    "ledger version",
    "ledger audit",
    "ledger expire",
    "ledger compact",
    "index status",
    "index rebuild",
    "retry stats",
    "retry rebuild",
    "retry compact",
    "retry audit",
    "acl user",
    "dlq ls",
    "dlq show",
    "dlq replay",
    "dlq discard",
    "stats",
}
SPARK_COMMANDS = {"run", "demo"}


@pytest.fixture(autouse=True)
def _no_idem_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("IDEM_")]:
        monkeypatch.delenv(name)


def _json_commands(command: click.Command, path: str = "") -> set[str]:
    """Every command of the tree that takes ``--json``, as ``"group action"``."""
    if isinstance(command, click.Group):
        return {
            found
            for name, sub in command.commands.items()
            for found in _json_commands(sub, f"{path} {name}".strip())
        }
    return {path} if any("--json" in p.opts for p in command.params) else set()


def test_every_command_that_takes_json_is_run_by_these_tests() -> None:
    """A new data command must come with its case here."""
    assert _json_commands(build_cli()) == CORE_COMMANDS | SPARK_COMMANDS


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], *, code: int = 0) -> Any:
    """Run ``idem argv --json``; its stdout parsed whole (one document, nothing else)."""
    got = main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert got == code, err
    assert "Traceback" not in err
    return json.loads(out)


def _message(msg_id: str, key: str) -> MessageExt:
    return MessageExt(topic="orders", msg_id=msg_id, body=b'{"order_id": 1}', keys=key)


def test_every_core_data_command_prints_one_json_document(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = IdemConfig(group="orders", redis_url=redis_server.url, data_dir=str(tmp_path))
    redis_server.client().flushall()
    dd = Dedup(config)
    dd.complete(dd.begin(KEYS, owner="batch-1"), batch_id=1, app_id="test")
    dd.settle()
    engine = RetryEngine(config)
    engine.send_back([_message(f"R{n}", f"K{n}") for n in range(3)], delay_level=18)
    dead = [_message(f"D{n}", key) for n, key in enumerate("ABC")]
    assert engine.dead_letter(dead, reason="no price [b]").acknowledged
    engine.close()
    group = ["--group", "orders", "--data-dir", str(tmp_path)]
    common = [*group, "--redis-url", redis_server.url]
    done: set[str] = set()

    def run(argv: list[str], *, code: int = 0) -> Any:
        done.add(" ".join(a for a in argv[:2] if not a.startswith("-")))
        return _json(capsys, [*argv, *(group if argv[0] == "ledger" else common)], code=code)

    version = run(["ledger", "version"])
    assert version["version"] >= 0
    assert version["path"] == config.resolved_ledger_path
    assert run(["ledger", "audit"])["repeated"] == []
    assert run(["ledger", "compact"])["files_removed"] >= 0
    assert run(["ledger", "expire", "--older-than", "30d"])["deleted_rows"] == 0  # all new

    status = run(["index", "status"])
    assert status["keys"] == len(KEYS)
    assert {b["state"] for b in status["buckets"]} == {"current"}
    rebuilt = run(["index", "rebuild", "--all"])
    assert (rebuilt["rebuilt_keys"], rebuilt["rebuilt_buckets"]) == (len(KEYS), config.buckets)

    assert run(["retry", "stats"])["redis"]["live"] == 3
    assert run(["retry", "compact"])["live"] == 3
    assert run(["retry", "rebuild"])["scheduled"] == 3
    audit = run(["retry", "audit"])
    assert (audit["retrying"], audit["retrying_and_dead"], audit["ok"]) == (3, [], True)
    snapshot = run(["stats"])
    assert snapshot["group"] == "orders"
    assert snapshot["retry"]["scheduled_by_level"] == {"18": 3}
    assert snapshot["dlq"]["by_status"] == {"DEAD": 3}
    assert (snapshot["index"]["held_keys"], snapshot["index"]["buckets_behind"]) == (len(KEYS), 0)

    acl = _json(capsys, ["acl", "user", "--group", "orders", "--topic", "orders"])
    done.add("acl user")
    assert acl["line"].startswith("user idem-orders ")
    assert acl["password_placeholder"] is True

    listed = run(["dlq", "ls"])
    assert sorted(row["key"] for row in listed) == ["A", "B", "C"]
    assert all(row["reason"].endswith("no price [b]") for row in listed)
    [shown] = run(["dlq", "show", "--key", "A"])
    assert (shown["key"], shown["status"]) == ("A", "DEAD")
    discarded = run(["dlq", "discard", "--key", "B", "--key", "NOPE"], code=1)
    assert (discarded["marked_discarded"], discarded["unknown"]) == (1, ["NOPE"])
    replayed = run(["dlq", "replay", "--key", "C"])
    assert (replayed["sent"], replayed["marked_replayed"]) == (1, 1)
    assert [row["key"] for row in run(["dlq", "ls"])] == ["A"]  # still DEAD

    assert done == CORE_COMMANDS
    # without --json the same rows are a table; text in brackets is shown, not styled away
    monkeypatch.setenv("COLUMNS", "400")  # wide enough that no cell wraps
    assert main(["dlq", "ls", *common]) == 0
    table = capsys.readouterr().out
    assert table.count("no price [b]") == 1


def test_a_command_that_finds_nothing_says_where_it_looked_on_stderr(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A relative ``--data-dir`` that holds nothing: stdout still holds one JSON document,
    and stderr names the absolute path that was looked at."""
    monkeypatch.chdir(tmp_path)
    argv = ["--group", "orders", "--data-dir", "typo", "--redis-url", redis_server.url]
    audit = _json(capsys, ["ledger", "audit", *argv[:4]])
    assert (audit["exists"], audit["repeated"]) == (False, [])
    main(["ledger", "audit", *argv[:4], "--json"])
    err = capsys.readouterr().err
    assert f"no ledger at {tmp_path / 'typo' / 'orders' / 'ledger'} yet" in err
    assert _json(capsys, ["dlq", "ls", *argv]) == []
    main(["retry", "rebuild", *argv, "--json"])
    err = capsys.readouterr().err
    assert f"no retry journal at {tmp_path / 'typo' / 'orders' / 'retry-journal'} yet" in err
    assert not (tmp_path / "typo").exists()


@pytest.mark.spark
def test_run_and_demo_print_their_report_as_one_json_document(
    spark: SparkSession,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    redis_server: RedisServer,
) -> None:
    source = tmp_path / "in"
    source.mkdir()
    rows = [{"order_id": key, "amount": 1} for key in ("A", "B", "A", "C")]  # A sent twice
    (source / "part-0.json").write_text(
        "".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8"
    )
    report = _json(
        capsys,
        [
            "run", "--source", str(source), "--key", "order_id", "--group", "jsonrun",
            "--redis-url", redis_server.url, "--data-dir", str(tmp_path / "data"),
            "--sink-delta", str(tmp_path / "sink"), "--available-now",
        ],
    )  # fmt: skip
    assert (report["messages"], report["applied"]) == (4, 3)
    assert report["sink"] == {
        "rows": 3, "distinct_keys": 3, "repeated_keys": [], "exactly_once": True,
    }  # fmt: skip

    # the demo's own session would be this one: its engine is named, as test_demo does
    demo = _json(
        capsys,
        ["demo", "--workdir", str(tmp_path / "demo"), "--orders", "60", "--files", "2",
         "--no-crash", "--engine", "delta-rs"],
    )  # fmt: skip
    assert demo["passed"] is True
    assert (demo["missing"], demo["unexpected"]) == ([], [])
    assert demo["report"]["sink"]["exactly_once"] is True
