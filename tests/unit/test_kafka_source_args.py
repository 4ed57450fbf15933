"""``idem run --source kafka://...`` and ``--kafka-option``: a malformed source, a setting
``--source`` makes, or one that belongs to another source is exit 2 naming the flag, before
Redis or Spark is touched (the Redis URL points nowhere; a late check would say so)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from idem.cli import main
from idem.redis_server import free_port

pytestmark = pytest.mark.unit


def _run(capsys: pytest.CaptureFixture[str], tmp_path: Path, *extra: str) -> tuple[int, str]:
    argv = [
        "run", "--key", "order_id", "--group", "g", "--schema", "order_id string",
        "--redis-url", f"redis://127.0.0.1:{free_port()}/0", "--data-dir", str(tmp_path),
        "--sink-delta", str(tmp_path / "sink"), "--available-now", *extra,
    ]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.fixture
def listening() -> Iterator[str]:
    """``host:port`` of a loopback socket that takes connections (the start-up check passes)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("kafka://127.0.0.1:9092", "names no topic"),
        ("kafka://127.0.0.1:9092/", "names no topic"),
        ("kafka://127.0.0.1/orders", "'127.0.0.1' is not HOST:PORT"),
        ("kafka://127.0.0.1:0/orders", "'127.0.0.1:0' is not HOST:PORT"),
        ("kafka://127.0.0.1:9092,:9093/orders", "':9093' is not HOST:PORT"),
        ("kafka://127.0.0.1:9092/a/b", "'a/b' is not a Kafka topic name"),
    ],
)
def test_a_malformed_kafka_source_is_exit_2_naming_the_part(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, source: str, says: str
) -> None:
    code, err = _run(capsys, tmp_path, "--source", source)
    assert code == 2
    assert "idem: error: --source: " in err
    assert says in err


@pytest.mark.parametrize(
    ("option", "says"),
    [
        ("subscribe=other", "--kafka-option: subscribe cannot be set here"),
        ("kafka.bootstrap.servers=h:1", "--kafka-option: kafka.bootstrap.servers cannot be set"),
        ("startingOffsets", "--kafka-option: 'startingOffsets' must look like KEY=VALUE"),
    ],
)
def test_a_kafka_option_that_source_makes_or_without_a_value_is_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, listening: str, option: str, says: str
) -> None:
    source = f"kafka://{listening}/orders"
    code, err = _run(capsys, tmp_path, "--source", source, "--kafka-option", option)
    assert code == 2
    assert says in err


def test_kafka_options_with_a_directory_source_are_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "in").mkdir()
    code, err = _run(capsys, tmp_path, "--source", str(tmp_path / "in"), "--kafka-option", "a=b")
    assert code == 2
    assert "--kafka-option: only with a kafka:// --source" in err


def test_max_files_per_trigger_with_a_kafka_source_points_to_max_offsets(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, listening: str
) -> None:
    source = f"kafka://{listening}/orders"
    code, err = _run(capsys, tmp_path, "--source", source, "--max-files-per-trigger", "2")
    assert code == 2
    assert "maxOffsetsPerTrigger" in err


def test_no_reachable_bootstrap_server_is_exit_2_naming_each(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    first, second = free_port(), free_port()
    source = f"kafka://127.0.0.1:{first},127.0.0.1:{second}/orders"
    code, err = _run(capsys, tmp_path, "--source", source)
    assert code == 2
    assert f"cannot reach the Kafka brokers 127.0.0.1:{first} (" in err
    assert f", 127.0.0.1:{second} (" in err


def test_one_reachable_bootstrap_server_is_enough_to_start(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, listening: str
) -> None:
    """The client learns the cluster from one server; the run goes on to Redis (exit 3)."""
    source = f"kafka://127.0.0.1:{free_port()},{listening}/orders"
    code, err = _run(capsys, tmp_path, "--source", source)
    assert code == 3
    assert "cannot reach the Kafka" not in err
    assert "cannot reach Redis" in err
