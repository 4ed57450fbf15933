"""``idem console`` end to end, in a real headless Chromium (the system's, never downloaded).

A run with poison rows fills the group's ``%DLQ%``; the console lists them; a replay
from the page, once the sink's bug is fixed, lands the row in the sink table exactly
once; a discard is recorded with who and when; an action without the token is
refused. ``IDEM_DOCS_SCREENSHOT=1`` saves the overview to the docs.
"""

from __future__ import annotations

import os
import shutil
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from jvm_jars import IN_CI
from pyspark.sql import DataFrame, SparkSession
from spark_helpers import config_for, dead_letters, delta_run, order, sink_key_counts, write_files

from idem.cli import main
from idem.config import IdemConfig
from idem.console.data import GroupView
from idem.console.server import TOKEN_HEADER, Console, ConsoleServer, serve
from idem.redis_server import RedisServer
from idem.retry.dlq import DeadLetter, DeadLetterStatus, DeadLetterTable
from idem.retry.engine import RetryEngine
from idem.spark.run import Pipeline

pytestmark = [pytest.mark.integration, pytest.mark.spark]

CHROMIUM = "/usr/bin/chromium"
TOKEN = "console-test-token-0123456789"
REPLAYED = "ORDERID_2"
DISCARDED = "ORDERID_4"
SCREENSHOT = Path(__file__).resolve().parents[3] / "docs" / "pages" / "img" / "console.png"


class PricingSink:
    """Rejects the poison orders until the bug is fixed."""

    def __init__(self) -> None:
        self.fixed = False
        self.seen: Counter[str] = Counter()

    def __call__(self, fresh: DataFrame, batch_id: int) -> dict[str, str]:
        keys = [r["order_id"] for r in fresh.select("order_id").toArrow().to_pylist()]
        self.seen.update(keys)
        if self.fixed:
            return {}
        return {
            k: f"KeyError: no price for product 'P-{k[-1]}7'"
            for k in keys
            if k in (REPLAYED, DISCARDED)
        }


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium from the system (``/usr/bin/chromium``), driven by Playwright."""
    if IN_CI:  # it must be there: a failed import fails the run
        from playwright import sync_api
    else:
        sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    if shutil.which(CHROMIUM) is None:
        message = f"{CHROMIUM} is not installed (apt-get install chromium)"
        if IN_CI:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def _start(config: IdemConfig, client: redis.Redis) -> ConsoleServer:
    view = GroupView(config, engine=RetryEngine(config, client=client))
    server = serve(Console(view=view, token=TOKEN, default_by="ops@console"), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _screenshot(page: Any) -> None:
    """The overview for the docs; the ledger's path is the test's temporary directory,
    which means nothing to a reader, so it is shown as a user's would be."""
    page.locator("section", has_text="index lag").locator("code").first.evaluate(
        "node => { node.textContent = '/data/orders' }"
    )
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)


def _post(url: str, data: bytes, headers: dict[str, str] | None = None) -> int:
    request = urllib.request.Request(  # noqa: S310 -- the console's own http URL
        url, data=data, headers=headers or {}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 -- the console's own http URL
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_console_lists_dead_letters_replays_one_once_and_records_a_discard(
    spark: SparkSession,
    real_redis: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    browser: Any,
) -> None:
    # the second file redelivers order 1: the dedup layer suppresses it
    write_files(tmp_path / "in", [[order(1), order(2), order(3), order(4)], [order(1)]])
    config = config_for(
        tmp_path,
        redis_server.url,
        "orders",
        max_reconsume_times=1,
        ledger_path=str(tmp_path / "sink"),  # a Delta sink's table is its own ledger
    )
    sink = PricingSink()
    spec = delta_run(tmp_path)
    Pipeline(spark, config, spec, sink_fn=sink, client=real_redis).run()
    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_1": 1, "ORDERID_3": 1}
    assert {d.key for d in dead_letters(config)} == {REPLAYED, DISCARDED}

    server = _start(config, real_redis)
    page = browser.new_page(viewport={"width": 1200, "height": 640})
    try:
        page.goto(server.url)
        dead = page.locator("section", has_text="recent dead letters")
        assert dead.locator("tbody tr").count() == 2
        for key in (REPLAYED, DISCARDED):
            assert "no price for product" in dead.locator("tr", has_text=key).inner_text()
        assert "index lag" in page.content()

        # an action without the token, or with a wrong one, is refused and changes nothing
        replayed = next(d for d in dead_letters(config) if d.key == REPLAYED)
        form = f"id={replayed.msg_id}&confirm=yes".encode()
        assert _post(server.url + "replay", form) == 403
        assert _post(server.url + "discard", form, {TOKEN_HEADER: "wrong"}) == 403
        page.click(f"text={REPLAYED}")
        page.click("button:has-text('replay…')")
        page.fill("input[name=token]", "not-the-token")
        page.click("button[name=confirm]")
        assert "refused" in page.inner_text("main")
        assert {d.status for d in dead_letters(config)} == {DeadLetterStatus.DEAD}

        # the bug is fixed; replay the dead letter from the page
        sink.fixed = True
        page.go_back()
        page.fill("input[name=token]", TOKEN)
        page.fill("input[name=by]", "alice@ops")
        page.click("button[name=confirm]")
        assert "marked 1 REPLAYED by alice@ops" in page.inner_text("main")
        page.goto(server.url)  # the replayed message waits at level 1 until the job runs
        waiting = page.locator("section", has_text="retries waiting").locator("tbody tr")
        assert waiting.count() == 1
        assert waiting.first.locator("td").nth(1).inner_text() == "1"
        if os.environ.get("IDEM_DOCS_SCREENSHOT") == "1":
            _screenshot(page)
        page.goto(server.url + f"search?q={REPLAYED}")
        assert "retrying: msg" in page.inner_text("main")
        assert "scheduled at level 1" in page.inner_text("main")
        Pipeline(spark, config, spec, sink_fn=sink, client=real_redis).run()
        assert sink_key_counts(tmp_path / "sink") == {
            "ORDERID_1": 1,
            "ORDERID_2": 1,
            "ORDERID_3": 1,
        }
        page.goto(server.url + f"search?q={REPLAYED}")
        assert "done: the ledger holds this key" in page.inner_text("main")

        # discard the other one from the page
        page.goto(server.url)
        page.click(f"text={DISCARDED}")
        page.click("button:has-text('discard…')")
        page.fill("input[name=token]", TOKEN)
        page.fill("input[name=by]", "bob@ops")
        page.click("button[name=confirm]")
        assert "marked 1 dead letter(s) DISCARDED by bob@ops" in page.inner_text("main")
        page.goto(server.url + "dlq?status=discarded")
        assert DISCARDED in page.inner_text("main")
    finally:
        page.close()
        server.shutdown()
        server.server_close()

    by_key = {d.key: d for d in dead_letters(config)}
    assert (by_key[REPLAYED].status, by_key[REPLAYED].replayed_by) == (
        DeadLetterStatus.REPLAYED,
        "alice@ops",
    )
    assert (by_key[DISCARDED].status, by_key[DISCARDED].replayed_by) == (
        DeadLetterStatus.DISCARDED,
        "bob@ops",
    )
    assert by_key[DISCARDED].replayed_at_ms is not None
    assert sink_key_counts(tmp_path / "sink") == {"ORDERID_1": 1, "ORDERID_2": 1, "ORDERID_3": 1}


def test_console_refuses_actions_without_the_token_and_requests_for_another_host(
    real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "console-guard")
    server = _start(config, real_redis)
    try:
        assert _post(server.url + "replay", b"id=M1&confirm=yes") == 403
        assert (
            _post(server.url + "replay", b"id=M1&confirm=yes&token=" + TOKEN[:-1].encode()) == 403
        )
        # with the token the action is taken, and says the dead letter does not exist
        assert _post(server.url + "replay", b"id=M1&confirm=yes", {TOKEN_HEADER: TOKEN}) == 404
        other = urllib.request.Request(  # noqa: S310 -- the console's own http URL
            server.url, headers={"Host": "attacker.example:80"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(other, timeout=30)  # noqa: S310 -- the console's own http URL
        assert refused.value.code == 403
        with urllib.request.urlopen(server.url, timeout=30) as ok:  # noqa: S310
            assert "idem console" in ok.read().decode()
    finally:
        server.shutdown()
        server.server_close()


def test_console_shows_a_dead_letter_s_fields_as_text_never_as_markup(
    real_redis: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = config_for(tmp_path, redis_server.url, "console-escape")
    hostile = "<script>alert(1)</script>"
    letter = DeadLetter(
        group=config.group,
        topic="orders",
        key=hostile,
        msg_id="M<1>",
        origin_msg_id="O1",
        body=b"<img src=x onerror=alert(2)>",
        properties={},
        reconsume_times=1,
        first_failed_at_ms=1_700_000_000_000,
        dead_at_ms=1_700_000_060_000,
        last_error="ValueError: <b>bad</b>",
    )
    assert DeadLetterTable(config.resolved_dlq_path, config.group).write([letter]) == 1
    server = _start(config, real_redis)
    try:
        for path in ("", "dlq?status=all", "letter?id=M%3C1%3E", "search?q=O1"):
            with urllib.request.urlopen(server.url + path, timeout=30) as response:  # noqa: S310
                html = response.read().decode()
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html, path
            for markup in ("<script>", "<b>bad", "<img"):
                assert markup not in html, path
    finally:
        server.shutdown()
        server.server_close()


def test_idem_console_refuses_a_short_token_naming_the_flag_and_the_limit(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["console", "--group", "g", "--redis-url", redis_server.url]
    args += ["--data-dir", str(tmp_path), "--port", "0", "--token", "short"]
    assert main(args) == 2
    assert "--token: the console token must be at least 16 characters, got 5" in (
        capsys.readouterr().err
    )
