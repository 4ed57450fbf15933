"""``idem run`` and ``idem dlq`` say clearly what is wrong, with documented exit codes."""

from __future__ import annotations

from pathlib import Path

import pytest

from idem.cli import main
from idem.redis_server import free_port

pytestmark = pytest.mark.integration


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


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
    assert "delay_levels: level 2 is 'fast'" in err


def test_a_missing_argument_is_argparse_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--key", "id", "--group", "g"])
    assert exit_info.value.code == 2
    assert "--source" in capsys.readouterr().err


def test_dlq_replay_without_a_selection_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _run(capsys, "dlq", "replay", "--group", "g")
    assert code == 2
    assert "name --key K, --msg-id ID or --all" in err
