"""Metrics scraped over HTTP after runs with known counts, on a real redis-server.

``idem schedule --metrics-port`` (a real process: moves, lateness, the group's state
gauges, its probes), the push consumer with idem's dedup layer, and ``idem stats``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry
from retry_helpers import RecordingListener
from scrape import probe, scrape, value
from waiting import FAST, eventually

from idem import metrics
from idem.cli import main
from idem.config import IdemConfig
from idem.dedup import Dedup
from idem.errors import StoreUnavailable
from idem.redis_server import RedisServer
from idem.retry.cli import schedule_metrics
from idem.retry.consumer import DedupMiddleware, Producer, PushConsumer, TopicStore, new_message
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageExt
from idem.retry.status import ConsumeConcurrentlyContext, ConsumeConcurrentlyStatus

pytestmark = pytest.mark.integration


def _config(tmp_path: Path, url: str, **extra: object) -> IdemConfig:
    settings: dict[str, object] = {"delay_levels": "1s 2s 3s", **extra}
    return IdemConfig(
        group=f"m-{uuid.uuid4().hex[:8]}",
        redis_url=url,
        data_dir=str(tmp_path / "data"),
        **settings,  # type: ignore[arg-type]
    )


def _messages(prefix: str, n: int, topic: str = "orders") -> list[MessageExt]:
    return [
        MessageExt(topic=topic, msg_id=f"{prefix}{i}", body=b"{}", keys=f"{prefix}{i}")
        for i in range(n)
    ]


@pytest.fixture
def schedule_process(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """``idem schedule`` processes a test starts; each is stopped with SIGTERM after it."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)


def _start_schedule(
    started: list[subprocess.Popen[str]], config: IdemConfig, extra: Sequence[str] = ()
) -> str:
    """Start ``idem schedule --metrics-port 0`` and return the URL it says it serves on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IDEM_")}
    argv = ["--group", config.group, "--redis-url", config.redis_url]
    argv += ["--data-dir", str(config.data_dir), "--delay-levels", "1s 2s 3s"]
    process = subprocess.Popen(
        [sys.executable, "-m", "idem.cli", "schedule", *argv, "--metrics-port", "0", *extra],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    started.append(process)
    assert process.stderr is not None
    for line in process.stderr:
        found = re.search(r"metrics on (http://\S+)/metrics", line)
        if found:
            # keep reading stderr, so the process never blocks on a full pipe
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return found.group(1)
    raise AssertionError(f"idem schedule exited {process.wait()} without serving metrics")


def test_idem_schedule_serves_moves_lateness_state_and_probes(
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
    schedule_process: list[subprocess.Popen[str]],
) -> None:
    config = _config(tmp_path, redis_server.url)
    engine = RetryEngine(config, client=redis_server.client())
    try:
        engine.send_back(_messages("late", 3), delay_level=1)  # due in 1 s
        engine.send_back(_messages("later", 2), delay_level=3)  # due in 3 s
        engine.send_back(_messages("dead", 2, topic="payments"), delay_level=-1)
    finally:
        engine.close()
    url = _start_schedule(schedule_process, config)
    group = config.group

    assert probe(url, "/healthz") == (200, "ok\n")
    assert probe(url, "/readyz") == (200, "ok\n")
    moved = eventually(
        lambda: (
            (s := scrape(url)) and value(s, "idem_schedule_moved_total", group=group) == 5 and s
        ),
        timeout=30,
        what="5 moves",
    )
    # each move of a queue's head is one lateness observation: at least one per queue
    # (two), at most one per message (messages sent back by one call are due within a
    # few milliseconds of each other, and a move takes only what is due)
    observed = value(moved, "idem_schedule_lateness_seconds_count", group=group)
    assert observed is not None
    assert 2 <= observed <= 5
    late = value(moved, "idem_schedule_lateness_seconds_sum", group=group)
    assert late is not None
    assert 0 <= late < 10
    # the state gauges are the group's, read from Redis and the DLQ table
    state = eventually(
        lambda: (
            (s := scrape(url))
            and value(s, "idem_retry_topic_messages", group=group, state="undelivered") == 5
            and s
        ),
        timeout=30,
        what="the retry topic's gauge",
    )
    assert value(state, "idem_dlq_messages", group=group, topic="payments", status="DEAD") == 2
    assert value(state, "idem_group_state_up", group=group) == 1
    assert value(state, "idem_ledger_version", group=group) == -1  # no ledger yet
    assert value(state, "idem_index_lag_versions", group=group) == 0
    assert "/metrics" in probe(url, "/nothing")[1]


def test_readiness_fails_while_redis_is_away_and_health_holds(tmp_path: Path) -> None:
    """A probe tells Kubernetes to stop routing to, not to restart, a service whose Redis
    is away: the service outlives the outage and moves again once Redis is back."""
    with RedisServer(appendonly=False) as server:
        config = _config(tmp_path, server.url)
        engine = RetryEngine(config, client=server.client())
        service = engine.schedule_service(max_idle_ms=100)
        service.start()
        http = schedule_metrics(engine, service, host="127.0.0.1", port=0)
        try:
            assert probe(http.url, "/readyz") == (200, "ok\n")
            server.kill()
            _code, body = eventually(
                lambda: (answer := probe(http.url, "/readyz"))[0] == 503 and answer,
                what="readyz to fail",
            )
            assert "moving due messages fails" in body
            assert probe(http.url, "/healthz") == (200, "ok\n")
            errors = value(
                scrape(http.url), "idem_redis_errors_total", group=config.group,
                component="schedule",
            )  # fmt: skip
            assert errors is not None
            assert errors >= 1
            server.start()
            eventually(lambda: probe(http.url, "/readyz")[0] == 200, what="readyz to pass")
        finally:
            http.close()
            service.stop()
            engine.close()


def test_the_push_consumer_counts_what_its_dedup_layer_and_the_resend_path_did(
    tmp_path: Path, redis_server: RedisServer, real_redis: redis.Redis
) -> None:
    """5 orders consumed, 2 of them delivered again (completed duplicates), one message
    that always fails: retried once at level 3, then dead (max_reconsume_times 1), and
    one whose key another owner holds for a while: busy, not failed."""
    config = _config(tmp_path, redis_server.url, max_reconsume_times=1)
    TopicStore(real_redis).create_topic("orders", 1)
    sink = RecordingListener()

    def listener(
        messages: Sequence[MessageExt], context: ConsumeConcurrentlyContext
    ) -> ConsumeConcurrentlyStatus:
        if any(m.keys == "BAD" for m in messages):
            return ConsumeConcurrentlyStatus.RECONSUME_LATER
        return sink(messages, context)

    consumer = PushConsumer(config, settings=FAST, client=redis_server.client())
    consumer.subscribe("orders")
    hook = DedupMiddleware(Dedup(config, client=redis_server.client()), commit_interval_ms=50)
    consumer.use(hook)
    consumer.register_message_listener_concurrently(listener)
    other = Dedup(config, client=redis_server.client())
    held = other.begin(["HELD"], owner="another-consumer")
    http = metrics.serve(0, target=CollectorRegistry())
    consumer.start()
    try:
        producer = Producer("p", client=real_redis)
        producer.send_batch([new_message("orders", b"{}", keys=f"O{i}") for i in range(5)])
        producer.send(new_message("orders", b"{}", keys="BAD"))
        producer.send(new_message("orders", b"{}", keys="HELD"))
        eventually(lambda: hook.stats.busy >= 1, what="HELD busy")
        other.release(held)
        eventually(lambda: hook.stats.completed == 6, what="6 keys committed")
        producer.send_batch([new_message("orders", b"{}", keys=k) for k in ("O0", "O1")])
        engine = consumer.engine
        assert engine is not None
        eventually(lambda: engine.dlq.count() == 1, what="BAD dead-lettered", timeout=30)
        eventually(lambda: hook.stats.duplicates["completed"] == 2, what="2 duplicates")
        group = config.group
        # Counted once the send-back is journaled, a moment after the DLQ row lands.
        dead = ("idem_dead_letters_total", "max_reconsume_times")
        eventually(
            lambda: value(scrape(http.url), dead[0], group=group, reason=dead[1]) == 1,
            what="the dead letter counted",
        )
        samples = scrape(http.url)
        busy = hook.stats.busy
        # 5 orders, BAD twice, HELD once per busy delivery and once more, 2 copies
        assert value(samples, "idem_messages_total", group=group) == 5 + 2 + busy + 1 + 2
        assert value(samples, "idem_busy_total", group=group) == busy
        assert value(samples, "idem_applied_total", group=group) == 6
        assert value(samples, "idem_duplicates_total", group=group, cause="completed") == 2
        assert value(samples, "idem_failed_total", group=group) == 2
        assert value(samples, "idem_retries_scheduled_total", group=group, level=3) == 1
        assert (
            value(samples, "idem_dead_letters_total", group=group, reason="max_reconsume_times")
            == 1
        )
        # BAD's retry and each busy send-back of HELD (on delay level 1)
        assert value(samples, "idem_retries_scheduled_total", group=group, level=1) == busy
        assert value(samples, "idem_schedule_moved_total", group=group) == 1 + busy
        assert sorted(sink.keys) == sorted(["HELD", *(f"O{i}" for i in range(5))])
    finally:
        consumer.shutdown()
        http.close()


def test_idem_stats_prints_one_snapshot_of_the_group(
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    redis_server: RedisServer,
    real_redis: redis.Redis,
) -> None:
    config = _config(tmp_path, redis_server.url)
    engine = RetryEngine(config, client=redis_server.client())
    try:
        engine.send_back(_messages("a", 3), delay_level=2)
        engine.send_back(_messages("b", 1), delay_level=3)
        engine.send_back(_messages("c", 2, topic="payments"), delay_level=-1)
        engine.dlq.mark_discarded(engine.dlq.list(limit=1), by="test")
    finally:
        engine.close()
    argv = ["stats", "--group", config.group, "--redis-url", redis_server.url]
    argv += ["--data-dir", str(config.data_dir)]
    assert main([*argv, "--json"]) == 0
    snapshot = json.loads(capsys.readouterr().out)
    assert snapshot["group"] == config.group
    assert snapshot["retry"]["scheduled_by_level"] == {"2": 3, "3": 1}
    assert snapshot["retry"]["scheduled"] == 4
    assert snapshot["dlq"]["by_status"] == {"DEAD": 1, "DISCARDED": 1}
    assert snapshot["dlq"]["by_topic"] == {"payments": {"DEAD": 1, "DISCARDED": 1}}
    assert snapshot["index"]["ledger_version"] == -1
    assert snapshot["spark"]["batches"] == 0  # no Spark batch recorded for the group
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "4 scheduled (L2: 3, L3: 1)" in text
    assert "DEAD 1, DISCARDED 1" in text


def test_a_claim_while_redis_is_away_counts_a_redis_error_of_the_dedup_layer(
    tmp_path: Path,
) -> None:
    with RedisServer(appendonly=False) as server:
        config = _config(tmp_path, server.url)
        dedup = Dedup(config, client=server.client(socket_timeout=2))
        dedup.release(dedup.begin(["K1"], owner="o"))
        server.kill()
        for key in ("K2", "K3"):
            with pytest.raises(StoreUnavailable):
                dedup.begin([key], owner="o")
        with metrics.serve(0, target=CollectorRegistry()) as http:
            samples = scrape(http.url)
    errors = value(samples, "idem_redis_errors_total", group=config.group, component="dedup")
    assert errors == 2
