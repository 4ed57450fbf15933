"""``idem run`` and ``idem dlq`` say clearly what is wrong, with documented exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from spark_helpers import sink_rows

from idem.cli import main
from idem.config import IdemConfig
from idem.redis_server import RedisServer, free_port
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt

pytestmark = pytest.mark.integration


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def _message(msg_id: str, key: str, body: bytes = b"{}") -> MessageExt:
    return MessageExt(
        topic="orders", msg_id=msg_id, body=body, keys=key, queue_id=0, queue_offset=0,
        born_timestamp=0, store_timestamp=0, reconsume_times=0, properties={},
    )  # fmt: skip


def test_a_missing_source_directory_is_exit_2_naming_the_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    code, err = _run(
        capsys, "run", "--source", str(missing), "--key", "id", "--group", "g",
        "--sink-delta", str(tmp_path / "sink"),
    )  # fmt: skip
    assert code == 2
    assert f"--source: directory {missing} does not exist" in err


def test_no_sink_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(capsys, "run", "--source", str(tmp_path), "--key", "id", "--group", "g")
    assert code == 2
    assert "a sink is required" in err


def test_an_unreachable_redis_is_exit_3_naming_the_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    code, err = _run(
        capsys, "run", "--source", str(tmp_path), "--key", "id", "--group", "g",
        "--sink-delta", str(tmp_path / "sink"), "--redis-url", url,
    )  # fmt: skip
    assert code == 3
    assert f"cannot reach Redis at {url}" in err


def test_bad_settings_are_exit_2_naming_the_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _run(
        capsys, "run", "--source", str(tmp_path), "--key", "id", "--group", "g",
        "--sink-delta", str(tmp_path / "sink"), "--delay-levels", "1s fast",
    )  # fmt: skip
    assert code == 2
    assert "--delay-levels: level 2 is 'fast'" in err


def test_a_missing_argument_is_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--key", "id", "--group", "g"]) == 2
    assert "idem: error: --source: required" in capsys.readouterr().err


def test_dlq_replay_without_a_selection_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(capsys, "dlq", "replay", "--group", "g")
    assert code == 2
    assert "name --key K, --msg-id ID or --all" in err


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--timeout", "0", "--timeout: must be a number of seconds above 0, got 0"),
        ("--timeout", "-3", "--timeout: must be a number of seconds above 0, got -3"),
        ("--trigger-seconds", "-1", "--trigger-seconds: must be 0 or more seconds, got -1"),
        ("--max-files-per-trigger", "0", "--max-files-per-trigger: must be at least 1, got 0"),
    ],
)
def test_a_bad_number_for_idem_run_is_exit_2_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, says: str
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # refused before Redis is even tried
    code, err = _run(
        capsys, "run", "--source", str(tmp_path), "--key", "id", "--group", "g",
        "--sink-delta", str(tmp_path / "sink"), "--redis-url", url, flag, value,
    )  # fmt: skip
    assert code == 2
    assert err.strip() == f"idem: error: {says}"


def test_demo_sizes_it_cannot_be_made_of_are_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _run(capsys, "demo", "--orders", "2")
    assert code == 2
    assert err.strip() == (
        "idem: error: --orders: the demo needs at least 6 orders (3 poison, one good, "
        "one in each of 6 file(s)), got 2"
    )
    code, err = _run(capsys, "demo", "--files", "0")
    assert code == 2
    assert err.strip() == "idem: error: --files: the demo needs at least 1 file, got 0"


def test_jars_that_are_not_there_are_exit_2_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # refused before Redis is even tried
    common = [
        "run", "--source", str(tmp_path), "--key", "id", "--group", "g", "--redis-url", url,
        "--sink-delta", str(tmp_path / "sink"), "--engine", "delta-spark",
    ]  # fmt: skip
    missing = tmp_path / "delta-jars"
    code, err = _run(capsys, *common, "--jars", str(missing))
    assert code == 2
    assert f"--jars: {missing} is neither a jar file nor a directory" in err
    missing.mkdir()
    code, err = _run(capsys, *common, "--jars", f"{missing},")
    assert code == 2
    assert f"--jars: directory {missing} holds no .jar file" in err


@pytest.mark.spark
def test_the_delta_spark_engine_on_a_session_without_deltas_jars_is_exit_2_naming_them(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Spark starts a session whose extension class is missing with a warning only: the
    run failed later, in its first batch, with a class Spark could not find."""
    source = tmp_path / "in"
    source.mkdir()
    (source / "a.json").write_text('{"order_id": "A"}\n', encoding="utf-8")
    command = [
        sys.executable, "-m", "idem.cli", "run", "--source", str(source), "--key", "order_id",
        "--group", "no-jars", "--redis-url", redis_server.url, "--data-dir", str(tmp_path),
        "--sink-delta", str(tmp_path / "sink"), "--available-now", "--engine", "delta-spark",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEM_", "PYSPARK_SUBMIT"))}
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        "idem: error: --engine: delta-spark cannot run on this Spark session: Delta's jars "
        "are not on the session's classpath"
    ) in done.stderr
    assert "pass them with --jars" in done.stderr
    assert not (tmp_path / "sink").exists()


@pytest.mark.spark
def test_a_fractional_timeout_runs_and_a_malformed_schema_is_exit_2_naming_the_flag(
    spark: SparkSession,
    redis_server: RedisServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = tmp_path / "in"
    source.mkdir()
    (source / "a.json").write_text('{"order_id": "A", "amount": 1}\n', encoding="utf-8")
    common = [
        "run", "--source", str(source), "--key", "order_id", "--redis-url", redis_server.url,
        "--data-dir", str(tmp_path / "data"),
    ]  # fmt: skip
    code, err = _run(
        capsys, *common, "--group", "half-second", "--sink-delta", str(tmp_path / "sink1"),
        "--timeout", "0.5",
    )  # fmt: skip
    assert code == 0
    assert "Traceback" not in err
    code, err = _run(
        capsys, *common, "--group", "bad-schema", "--sink-delta", str(tmp_path / "sink2"),
        "--schema", "order_id strin, amount double", "--available-now",
    )  # fmt: skip
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith("idem: error: --schema: 'order_id strin, amount double' is not a ")
    assert 'Unsupported data type "STRIN"' in line
    # valid DDL that JSON cannot hold: the query failed as it started, with a traceback
    code, err = _run(
        capsys, *common, "--group", "map-schema", "--sink-delta", str(tmp_path / "sink3"),
        "--schema", "order_id string, extra struct<tags: array<map<date, int>>>",
    )  # fmt: skip
    assert code == 2
    [line] = err.strip().splitlines()
    assert line == (
        "idem: error: --schema: column 'extra.tags': a map keyed by date cannot be read from "
        "JSON (JSON object keys are text); use map<string, ...>"
    )


def test_a_dlq_replay_that_cannot_store_its_messages_is_exit_1_saying_so(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = IdemConfig(group="unstored", redis_url=redis_server.url, data_dir=str(tmp_path))
    engine = RetryEngine(config, client=redis_server.client())
    dead = _message("M" * 32, "A", b'{"order_id":"A"}')
    assert engine.send_back([dead], delay_level=-1).acknowledged
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("", encoding="utf-8")  # the journal cannot live under a file
    code, err = _run(
        capsys, "dlq", "replay", "--all", "--group", config.group, "--redis-url",
        redis_server.url, "--data-dir", str(tmp_path), "--journal-path", str(blocked / "journal"),
    )  # fmt: skip
    assert code == 1
    assert "idem: error: replay: 1 message(s) could not be stored; run it again" in err


@pytest.mark.parametrize("action", ["discard", "replay"])
def test_dlq_all_with_a_key_is_refused_and_touches_nothing(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    """``discard --all --key K`` discarded every dead letter, not K's: --all won silently."""
    config = IdemConfig(group=f"pick-{action}", redis_url=redis_server.url, data_dir=str(tmp_path))
    engine = RetryEngine(config, client=redis_server.client())
    dead = [_message(f"M{k}", k) for k in ("A", "B", "C")]
    assert engine.send_back(dead, delay_level=-1).acknowledged
    code, err = _run(
        capsys, "dlq", action, "--all", "--key", "A", "--group", config.group,
        "--redis-url", redis_server.url, "--data-dir", str(tmp_path),
    )  # fmt: skip
    assert code == 2
    assert "--all: selects every dead letter, so it cannot be combined with --key" in err
    assert sorted((d.key, d.status.value) for d in engine.dlq.list()) == [
        ("A", "DEAD"),
        ("B", "DEAD"),
        ("C", "DEAD"),
    ]


@pytest.mark.parametrize("limit", ["-1", "-3", "many"])
def test_a_dlq_listing_limit_that_is_not_a_count_is_exit_2(
    capsys: pytest.CaptureFixture[str], limit: str
) -> None:
    """``--limit -1`` hid the last row (a Python slice), ``-3`` the last three."""
    assert main(["dlq", "ls", "--group", "g", "--limit", limit]) == 2
    assert f"--limit: {limit!r} is not a whole number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("action", ["show", "discard", "replay"])
def test_a_dlq_key_that_matches_no_dead_letter_is_exit_1_naming_it_and_the_rest_is_done(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str
) -> None:
    """``replay``/``discard --key TYPO`` said "nothing to replay" / "marked 0" and exited 0:
    a script could not tell a typo from done (``show`` already exited 1)."""
    config = IdemConfig(group=f"typo-{action}", redis_url=redis_server.url, data_dir=str(tmp_path))
    engine = RetryEngine(config, client=redis_server.client())
    assert engine.dead_letter([_message("MA", "A"), _message("MB", "B")], reason="bad").acknowledged
    code, err = _run(
        capsys, "dlq", action, "--key", "A", "--key", "NOPE", "--msg-id", "M404", "--group",
        config.group, "--redis-url", redis_server.url, "--data-dir", str(tmp_path),
    )  # fmt: skip
    assert code == 1
    assert err.strip() == "idem: error: no dead letter with key/msg id M404, NOPE"
    done = {"show": "DEAD", "discard": "DISCARDED", "replay": "REPLAYED"}[action]
    assert sorted((d.key, d.status.value) for d in engine.dlq.list()) == [
        ("A", done),
        ("B", "DEAD"),
    ]


def test_dlq_ls_where_no_table_is_says_where_it_looked(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo in --group or --data-dir printed an empty listing, as if nothing had died."""
    config = IdemConfig(group="ledgered", redis_url=redis_server.url, data_dir=str(tmp_path))
    engine = RetryEngine(config, client=redis_server.client())
    assert engine.dead_letter([_message("M1", "A")], reason="bad").acknowledged
    common = ["--redis-url", redis_server.url, "--data-dir", str(tmp_path)]

    assert main(["dlq", "ls", "--group", "ledgerd", *common]) == 0
    out = capsys.readouterr().out
    assert f"%DLQ%ledgerd: no table at {tmp_path / 'ledgerd' / 'dlq'}" in out
    assert "check --data-dir and --group" in out
    assert main(["dlq", "ls", "--group", "ledgerd", "--json", *common]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == []  # stdout holds only the (empty) listing
    assert "no table at" in captured.err

    assert main(["dlq", "ls", "--group", "ledgered", *common]) == 0
    out = capsys.readouterr().out
    assert f"%DLQ%ledgered at {tmp_path / 'ledgered' / 'dlq'}: 1 row(s) shown" in out
    assert "bad" in out


def test_files_with_no_rows_or_no_key_field_leave_no_schema_behind(
    spark: SparkSession,
    redis_server: RedisServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A first run on empty files, or on rows that lack --key, is exit 2 saying so, and
    keeps no schema in the checkpoint: the run after rows arrive infers it from them
    (a kept empty schema refused every later run, however the files changed)."""
    source = tmp_path / "in"
    source.mkdir()
    (source / "a.json").write_text("\n", encoding="utf-8")
    common = [
        "run", "--source", str(source), "--key", "order_id", "--redis-url", redis_server.url,
        "--data-dir", str(tmp_path / "data"), "--group", "late-rows",
        "--sink-delta", str(tmp_path / "sink"), "--available-now",
    ]  # fmt: skip
    code, err = _run(capsys, *common)
    assert code == 2
    assert "--source: the files in" in err
    assert "hold no JSON object" in err
    (source / "b.json").write_text('{"id": "X"}\n', encoding="utf-8")
    code, err = _run(capsys, *common)
    assert code == 2
    assert "--key: no field 'order_id' in the rows of the files in" in err
    (source / "b.json").unlink()
    (source / "c.json").write_text('{"order_id": "A", "amount": 1}\n', encoding="utf-8")
    code, err = _run(capsys, *common)
    assert code == 0, err
    assert [row["order_id"] for row in sink_rows(tmp_path / "sink")] == ["A"]
