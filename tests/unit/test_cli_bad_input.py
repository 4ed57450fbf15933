"""Bad input to any ``idem`` command: one line naming the flag and the limit, never a traceback.

Every case here is refused before Redis, Delta or Spark is touched: a Redis URL
that points nowhere (a free port) stands in for the infrastructure, so a check
that came too late would show as ``cannot reach Redis`` (exit 3) instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from idem.cli import main
from idem.config import IdemConfig, parse_duration_ms
from idem.errors import ConfigError
from idem.redis_client import connect, redacted
from idem.redis_server import free_port

pytestmark = pytest.mark.unit

BAD_URLS = [
    ("redis://127.0.0.1:99999", "port 99999 is out of range 1-65535"),
    ("redis://127.0.0.1:0/0", "port 0 is out of range 1-65535"),
    ("redis://127.0.0.1:-1", "port -1 is out of range 1-65535"),
    ("redis://host:abc", "port 'abc' is not a number"),
    ("redis+cluster://node-1:70000", "port 70000 is out of range 1-65535"),
    ("redis://[::1", "'redis://[::1' is not a valid URL (Invalid IPv6 URL)"),
    ("redis://127.0.0.1:6379/abc", "database 'abc' (the URL's path) is not a whole number"),
    ("redis://127.0.0.1:6379/1/2", "database '1/2' (the URL's path) is not a whole number"),
    ("redis://127.0.0.1:6379?db=x", "Invalid value for 'db' in connection URL"),
    ("redis+cluster://node-1:7000?db=2", "a Redis Cluster has only database 0, the URL names 2"),
    # redis-py passed these on: a TypeError / ValueError at the first command
    ("redis://127.0.0.1:6379/0?foo=bar", "query argument 'foo' is not a Redis connection option"),
    ("redis://127.0.0.1:6379/0?socket_timeout=-1", "query argument 'socket_timeout': -1 must be"),
    ("unix://", "a unix:// URL needs the socket's path"),
    ("http://x", "'http://x' must start with redis://"),
    ("", "'' must start with redis://"),
]

COMMANDS_WITH_REDIS = [
    ["index", "status", "--group", "g"],
    ["index", "rebuild", "--group", "g"],
    ["schedule", "--group", "g"],
    ["retry", "stats", "--group", "g"],
    ["retry", "rebuild", "--group", "g"],
    ["retry", "compact", "--group", "g"],
    ["dlq", "ls", "--group", "g"],
    ["dlq", "show", "--group", "g", "--key", "K"],
    ["dlq", "replay", "--group", "g", "--all"],
    ["dlq", "discard", "--group", "g", "--all"],
    ["run", "--source", ".", "--key", "id", "--group", "g", "--sink-delta", "x", "--available-now"],
]


@pytest.fixture(autouse=True)
def _no_idem_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("IDEM_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def nowhere() -> str:
    """A Redis URL nothing listens on: reaching for it means a check came too late."""
    return f"redis://127.0.0.1:{free_port()}/0"


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory\n", encoding="utf-8")
    return path


def _exit(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    """The exit code and stderr of ``idem argv``, the command line's own refusals included."""
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def _one_error_line(err: str) -> str:
    [line] = [line for line in err.splitlines() if "error:" in line]
    return line


# -- exit codes: the same failure, the same code, whatever the subcommand ----------------------

EVERY_GROUP_COMMAND = [
    ["ledger", "version"],
    ["ledger", "audit"],
    ["index", "status"],
    ["retry", "stats"],
    ["dlq", "ls"],
]


@pytest.mark.parametrize("argv", EVERY_GROUP_COMMAND, ids=" ".join)
def test_a_bad_setting_is_exit_2_from_every_subcommand(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, nowhere: str, argv: list[str]
) -> None:
    """``ledger``, ``index`` and ``retry`` answered a bad setting with 1, ``run``/``dlq`` with 2;
    the message names the flag (it said ``group:``, the Python setting)."""
    flags = ["--group", "no spaces", "--data-dir", str(tmp_path), "--redis-url", nowhere]
    if argv[0] == "ledger":
        flags = flags[:4]
    code, err = _exit(capsys, [*argv, *flags])
    assert (code, _one_error_line(err)[:32]) == (2, "idem: error: --group: 'no spaces")


@pytest.mark.parametrize("argv", EVERY_GROUP_COMMAND, ids=" ".join)
def test_a_missing_group_is_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str]
) -> None:
    """It said ``pass group=...``: Python's spelling, to someone at a shell; and every
    command requires it the same way (the flag, else ``IDEM_GROUP``)."""
    code, err = _exit(capsys, [*argv, "--data-dir", str(tmp_path)])
    assert code == 2
    assert _one_error_line(err).startswith("idem: error: group: not set (--group G on the ")


@pytest.mark.parametrize("argv", [a for a in EVERY_GROUP_COMMAND if a[0] != "ledger"], ids=" ".join)
def test_an_unreachable_redis_is_exit_3_from_every_subcommand(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, nowhere: str, argv: list[str]
) -> None:
    """``index`` and ``retry`` answered 1, ``run`` and ``dlq`` 3."""
    code, err = _exit(
        capsys, [*argv, "--group", "g", "--data-dir", str(tmp_path), "--redis-url", nowhere]
    )
    assert code == 3, err
    assert "Connection refused" in _one_error_line(err)


# -- --redis-url and IDEM_REDIS_URL -------------------------------------------------------------


@pytest.mark.parametrize(("url", "says"), BAD_URLS)
def test_a_malformed_redis_url_is_refused_by_the_config_naming_the_part(
    url: str, says: str
) -> None:
    with pytest.raises(ConfigError) as info:
        IdemConfig(group="g", redis_url=url)
    assert str(info.value).startswith(f"redis_url: {says}")
    with pytest.raises(ConfigError) as info:
        connect(url)
    assert str(info.value).startswith(f"redis_url: {says}")


@pytest.mark.parametrize("command", COMMANDS_WITH_REDIS, ids=" ".join)
@pytest.mark.parametrize(
    ("url", "says"),
    [BAD_URLS[0], BAD_URLS[3], BAD_URLS[5], BAD_URLS[6], BAD_URLS[8]],
    ids=["port-range", "port-text", "ipv6", "database", "query"],
)
def test_a_malformed_redis_url_flag_is_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], command: list[str], url: str, says: str
) -> None:
    code, err = _exit(capsys, [*command, "--redis-url", url])
    assert code == 2
    assert f"idem: error: --redis-url: {says}" in _one_error_line(err)


@pytest.mark.parametrize(
    "command",
    [["retry", "stats", "--group", "g"], ["dlq", "ls", "--group", "g"]],
    ids=["retry-stats", "dlq-ls"],
)
def test_a_malformed_idem_redis_url_is_an_error_naming_the_setting(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    command: list[str],
) -> None:
    """A bad setting is exit 2, whichever command family reads it, naming the variable."""
    monkeypatch.setenv("IDEM_REDIS_URL", "redis://127.0.0.1:99999/0")
    got, err = _exit(capsys, [*command, "--data-dir", str(tmp_path)])
    assert got == 2
    assert err.strip() == "idem: error: IDEM_REDIS_URL: port 99999 is out of range 1-65535"


def test_a_url_urllib_cannot_split_still_has_its_password_masked() -> None:
    assert redacted("redis://idem:s3cret@[::1:6379") == "redis://***@[::1:6379"


# -- idem schedule -----------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--batch-size", "--max-idle-ms"])
@pytest.mark.parametrize("value", ["0", "-5", "many"])
def test_schedule_counts_below_one_are_exit_2_before_anything_starts(
    capsys: pytest.CaptureFixture[str], nowhere: str, flag: str, value: str
) -> None:
    """``--max-idle-ms 0`` made the service spin on Redis; ``--batch-size 0`` a traceback."""
    code, err = _exit(capsys, ["schedule", "--group", "g", "--redis-url", nowhere, flag, value])
    assert code == 2
    assert _one_error_line(err) == f"idem: error: {flag}: {value!r} is not a whole number >= 1"


def test_schedule_logs_an_unreachable_redis_in_one_line_without_a_traceback(
    tmp_path: Path, nowhere: str
) -> None:
    """The service outlives Redis's errors; each is one log line (``-v`` adds tracebacks)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEM_")}
    argv = ["schedule", "--group", "g", "--redis-url", nowhere, "--data-dir", str(tmp_path)]
    service = subprocess.Popen(
        [sys.executable, "-m", "idem.cli", *argv],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    assert service.stderr is not None
    seen: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            line = service.stderr.readline()
            if not line:
                break
            seen.append(line)
            if "journal sync failed" in line:
                break
    finally:
        service.send_signal(signal.SIGTERM)
        _, rest = service.communicate(timeout=30)
    err = "".join(seen) + rest
    assert "journal sync failed; retrying later (StoreUnavailable: " in err
    assert "Traceback" not in err


# -- idem ledger -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "flag"), [("audit", "--since"), ("expire", "--older-than")], ids=["since", "older"]
)
def test_a_duration_past_a_century_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, action: str, flag: str
) -> None:
    """It overflowed Python's dates: ``OverflowError: Python int too large ...``."""
    argv = ["ledger", action, "--group", "g", "--data-dir", str(tmp_path), flag, "99999999999d"]
    code, err = _exit(capsys, argv)
    assert code == 2
    assert err.strip() == (
        f"idem: error: {flag}: '99999999999d' is longer than the longest duration idem "
        "takes, 36500d"
    )


def test_a_negative_vacuum_retention_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It was a ``ValueError`` traceback from delta-rs, after the old days were deleted."""
    argv = ["ledger", "expire", "--group", "g", "--data-dir", str(tmp_path), "--older-than"]
    code, err = _exit(capsys, [*argv, "30d", "--vacuum-retention-hours", "-1"])
    assert code == 2
    assert "idem: error: --vacuum-retention-hours: '-1' is not a whole number >= 0" in err
    assert "Traceback" not in err


def test_a_century_is_the_longest_duration() -> None:
    assert parse_duration_ms("36500d", setting="x") == 36_500 * 86_400_000
    with pytest.raises(ConfigError, match=r"^x: '36501d' is longer .* 36500d$"):
        parse_duration_ms("36501d", setting="x")


# -- idem run: source, sink function, paths ----------------------------------------------------


@pytest.fixture
def run_argv(tmp_path: Path, nowhere: str) -> list[str]:
    source = tmp_path / "in"
    source.mkdir()
    return [
        "run", "--source", str(source), "--key", "id", "--group", "g", "--redis-url", nowhere,
        "--data-dir", str(tmp_path / "data"), "--available-now",
    ]  # fmt: skip


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        argv = list(argv)
        argv[argv.index(flag) + 1] = value
        return argv
    return [*argv, flag, value]


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("", "--source: the path is empty; name the directory of JSON-lines files"),
        ("{file}", "--source: {file} is a file, not a directory of JSON-lines files"),
    ],
    ids=["empty", "a-file"],
)
def test_a_source_that_is_no_directory_is_exit_2(
    capsys: pytest.CaptureFixture[str], run_argv: list[str], a_file: Path, source: str, says: str
) -> None:
    """An empty --source was the working directory, and Spark's traceback followed."""
    argv = _with(_with(run_argv, "--source", source.format(file=a_file)), "--sink-delta", "s")
    code, err = _exit(capsys, argv)
    assert code == 2
    assert err.strip() == f"idem: error: {says.format(file=a_file)}"


SINK_MODULES = {
    "syntax": ("def sink(df, batch_id:\n", "cannot load '{path}': '(' was never closed"),
    "raises": ('raise RuntimeError("boom")\n', "importing '{path}' failed: RuntimeError: boom"),
    "not-callable": ("sink = 3\n", "'sink' in '{path}' is not callable (its type is int)"),
}


@pytest.mark.parametrize("kind", sorted(SINK_MODULES))
def test_a_sink_function_that_does_not_load_is_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], run_argv: list[str], tmp_path: Path, kind: str
) -> None:
    """Checked before Redis and the JVM; a syntax error or an import-time exception
    of the user's module was a traceback."""
    text, says = SINK_MODULES[kind]
    module = tmp_path / f"sink_{kind.replace('-', '_')}.py"
    module.write_text(text, encoding="utf-8")
    code, err = _exit(capsys, [*run_argv, "--sink-fn", f"{module}:sink"])
    assert code == 2
    assert _one_error_line(err).startswith(f"idem: error: --sink-fn: {says.format(path=module)}")


@pytest.mark.parametrize(
    "case",
    [
        ("--sink-delta", "{file}", "--sink-delta: {file} is a file, not a directory"),
        ("--checkpoint", "{file}", "--checkpoint: {file} is a file, not a directory"),
        ("--dlq-path", "{file}", "--dlq-path: {file} is a file, not a directory"),
        (
            "--journal-path",
            "{file}/journal",
            "--journal-path: cannot create {file}/journal: {file} is a file, not a directory",
        ),
        (
            "--data-dir",
            "{file}",
            "--data-dir: cannot create {file}/g/checkpoint: {file} is a file, not a directory",
        ),
        ("--report-json", "{dir}", "--report-json: {dir} is a directory, not a file"),
        (
            "--report-json",
            "{dir}/missing/report.json",
            "--report-json: cannot write {dir}/missing/report.json: "
            "directory {dir}/missing does not exist",
        ),
    ],
    ids=["sink", "checkpoint", "dlq", "journal", "data-dir", "report-dir", "report-parent"],
)
def test_a_path_idem_run_cannot_write_is_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], run_argv: list[str], a_file: Path, case: tuple[str, ...]
) -> None:
    """These failed inside a streaming batch (Spark logging the Python traceback) or, for
    the report, with a traceback after the whole run."""
    flag, value, says = case
    tmp_path = a_file.parent
    names = {"file": a_file, "dir": tmp_path}
    argv = _with(run_argv, flag, value.format(**names))
    if flag != "--sink-delta":
        argv = [*argv, "--sink-delta", str(tmp_path / "sink")]
    code, err = _exit(capsys, argv)
    assert code == 2
    assert err.strip() == f"idem: error: {says.format(**names)}"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_a_sink_table_under_proc_is_exit_2_saying_it_cannot_be_created(
    capsys: pytest.CaptureFixture[str], run_argv: list[str]
) -> None:
    code, err = _exit(capsys, [*run_argv, "--sink-delta", "/proc/self/sink"])
    assert code == 2
    assert _one_error_line(err).startswith(
        "idem: error: --sink-delta: cannot create /proc/self/sink in /proc/self ("
    )


def test_a_demo_workdir_that_is_a_file_is_exit_2(
    capsys: pytest.CaptureFixture[str], a_file: Path
) -> None:
    code, err = _exit(capsys, ["demo", "--workdir", str(a_file)])
    assert code == 2
    assert err.strip() == f"idem: error: --workdir: {a_file} is a file, not a directory"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--delay-levels", "1s x"], "--delay-levels: level 2 is 'x'"),
        (["--max-reconsume-times", "5000"], "--max-reconsume-times: 5000 is outside"),
    ],
)
def test_bad_demo_settings_are_exit_2_before_anything_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flags: list[str], says: str
) -> None:
    """It started Redis and wrote the order files, then failed on the setting."""
    workdir = tmp_path / "demo"
    code, err = _exit(capsys, ["demo", "--workdir", str(workdir), *flags])
    assert code == 2
    assert _one_error_line(err).startswith(f"idem: error: {says}")
    assert not workdir.exists()


# -- idem dlq / idem retry: a file where a Delta table belongs ---------------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["dlq", "ls"],
        ["dlq", "show", "--key", "K"],
        ["dlq", "replay", "--all"],
        ["dlq", "discard", "--all"],
        ["retry", "stats"],
        ["retry", "rebuild"],
        ["retry", "compact"],
    ],
    ids=" ".join,
)
@pytest.mark.parametrize("flag", ["--dlq-path", "--journal-path"])
def test_a_table_path_that_is_a_file_is_an_error_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
    a_file: Path,
    nowhere: str,
    command: list[str],
    flag: str,
) -> None:
    """delta-rs raised a bare ``OSError: Generic LocalFileSystem error`` (a traceback); it is
    a bad setting, exit 2, from every command family."""
    argv = [*command, "--group", "g", "--redis-url", nowhere, "--data-dir", str(a_file.parent)]
    got, err = _exit(capsys, [*argv, flag, str(a_file)])
    assert got == 2
    assert err.strip() == f"idem: error: {flag}: {a_file} is a file, not a directory"


def test_an_audit_where_there_is_no_ledger_says_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A mistyped ``--data-dir`` answered "0 key(s) held more than once", like a clean audit."""
    code = main(["ledger", "audit", "--group", "g", "--data-dir", str(tmp_path / "typo")])
    out = capsys.readouterr().out
    assert (code, out.strip()) == (
        0,
        f"idem ledger audit: no ledger at {tmp_path}/typo/g/ledger yet (nothing completed there)",
    )
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize(
    "argv",
    [["ledger", "audit"], ["ledger", "version"], ["index", "status"]],
    ids=["audit", "version", "index"],
)
def test_a_ledger_under_a_file_is_refused_not_read_as_empty(
    capsys: pytest.CaptureFixture[str], a_file: Path, nowhere: str, argv: list[str]
) -> None:
    """``ledger audit`` answered "0 key(s) held more than once", exit 0."""
    extra = ["--redis-url", nowhere] if argv[0] == "index" else []
    code, err = _exit(capsys, [*argv, "--group", "g", "--data-dir", str(a_file), *extra])
    assert code == 2
    assert err.strip() == (
        f"idem: error: --data-dir: {a_file}/g/ledger cannot be a table: {a_file} is a file"
    )
