"""The schedule service against a real redis-server, with the real clock.

Part 1 — steady state: 100k messages are sent back at delay level 1 (1 s) through
``RetryEngine.send_back`` (Delta journal + Redis, batches of ``--batch``) while
``idem schedule`` runs in its own process. Each message's *lateness* is the time
it landed in ``%RETRY%<group>`` (the stream entry's server timestamp) minus its
due time. Target: p99 <= 100 ms (RocketMQ's scheduler ticks every 100 ms).

Part 2 — capacity: the service is stopped, 100k more messages are scheduled and
left to come due, then the service is started on the backlog; moves/second is
the backlog over the time from the first move to the last. Target: >= 20k/s.
Baseline in the same run: redis-py pipelining the same 100k ``XADD``s from
Python (no scheduling logic at all).

    python bench/schedule.py [--messages 100000] [--batch 1000]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import redis

from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry import MessageExt, RetryEngine

GROUP = "bench_schedule"


def start_service(server: RedisServer, data_dir: str) -> subprocess.Popen[str]:
    """``idem schedule`` in its own process, as it would run beside producers."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "idem.cli",
            "schedule",
            "--group",
            GROUP,
            "--redis-url",
            server.url,
            "--data-dir",
            data_dir,
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stderr is not None
    process.stderr.readline()  # "idem schedule: group ..." once it is up
    return process


def stop_service(process: subprocess.Popen[str]) -> str:
    """SIGTERM and the service's last words."""
    process.send_signal(signal.SIGTERM)
    _out, err = process.communicate(timeout=30)
    return err.strip().splitlines()[-1] if err.strip() else ""


def send_back(engine: RetryEngine, n: int, batch: int, prefix: str) -> float:
    """Send ``n`` failed messages back at level 1; returns messages/second of send-back."""
    started = time.perf_counter()
    for start in range(0, n, batch):
        messages = [
            MessageExt(
                topic="TopicTest",
                msg_id=f"{prefix}{i}",
                keys=f"ORDER_{prefix}{i}",
                body=b'{"order": 1, "amount": 10}',
            )
            for i in range(start, min(start + batch, n))
        ]
        result = engine.send_back(messages, delay_level=1)
        assert len(result.scheduled) == len(messages), result.outcomes[:3]
    return n / (time.perf_counter() - started)


def wait_moved(client: redis.Redis, stream: str, total: int, timeout_s: float = 120) -> None:
    """Until the retry topic holds ``total`` entries."""
    deadline = time.monotonic() + timeout_s
    while client.xlen(stream) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {client.xlen(stream)} of {total} moved")
        time.sleep(0.05)


def landed(client: redis.Redis, stream: str) -> list[tuple[int, int]]:
    """``(landed_ms, due_ms)`` of every entry of the retry topic."""
    out: list[tuple[int, int]] = []
    last = "-"
    while True:
        entries = client.xrange(stream, min=last, max="+", count=10_000)
        if last != "-":
            entries = entries[1:]
        if not entries:
            return out
        for entry_id, fields in entries:
            out.append((int(entry_id.split(b"-")[0]), int(float(fields[b"d"]))))
        last = entries[-1][0].decode()


def percentile(values: list[int], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``."""
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def baseline_xadd(client: redis.Redis, n: int) -> float:
    """redis-py pipelining ``n`` XADDs of the same size: entries/second."""
    wire = "x" * 420
    started = time.perf_counter()
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd("bench:baseline", {"id": str(i), "o": i, "d": 0, "m": wire})
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    rate = n / (time.perf_counter() - started)
    client.delete("bench:baseline")
    return rate


def main() -> int:
    """Run both parts and print the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    args = parser.parse_args()
    n = args.messages

    with RedisServer() as server, tempfile.TemporaryDirectory(prefix="idem-bench-") as data:
        client = server.client()
        config = IdemConfig(group=GROUP, redis_url=server.url, data_dir=data)
        engine = RetryEngine(config)
        stream = engine.store.keys.stream
        print(
            f"redis-server {server.url}, {n:,} messages at level 1 "
            f"({config.delay_levels.delay_ms(1)} ms), batches of {args.batch}; "
            f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}"
        )

        # Part 1: steady state, service running in its own process.
        service = start_service(server, data)
        rate = send_back(engine, n, args.batch, "steady-")
        wait_moved(client, stream, n)
        print(f"  service: {stop_service(service)}")
        rows = landed(client, stream)
        lateness = [landed_ms - due for landed_ms, due in rows]
        span_ms = max(r[0] for r in rows) - min(r[0] for r in rows)
        print("part 1 — steady state (send-back and schedule service concurrently)")
        print(f"  send-back (journal + Redis): {rate:,.0f} msg/s")
        print(
            f"  moves: {len(rows):,} in {span_ms / 1000:.2f} s = "
            f"{len(rows) / max(span_ms / 1000, 1e-3):,.0f} moves/s (paced by the producer)"
        )
        print(
            f"  lateness: p50 {percentile(lateness, 0.50):.0f} ms, "
            f"p99 {percentile(lateness, 0.99):.0f} ms, max {max(lateness)} ms, "
            f"mean {statistics.fmean(lateness):.1f} ms   (target p99 <= 100 ms)"
        )
        early = sum(1 for x in lateness if x < 0)
        print(f"  delivered early: {early}")
        client.delete(stream)

        # Part 2: capacity on a due backlog.
        send_back(engine, n, args.batch, "burst-")
        due_at = engine.next_due_ms()
        while due_at is not None and time.time() * 1000 < due_at + n / 50 + 1100:
            time.sleep(0.1)
        service = start_service(server, data)
        wait_moved(client, stream, n)
        print(f"  service: {stop_service(service)}")
        rows = landed(client, stream)
        span_ms = max(r[0] for r in rows) - min(r[0] for r in rows)
        capacity = len(rows) / max(span_ms / 1000, 1e-3)
        baseline = baseline_xadd(client, n)
        print("part 2 — capacity (a due backlog of 100k, one service)")
        print(
            f"  moves: {len(rows):,} in {span_ms / 1000:.2f} s = {capacity:,.0f} moves/s "
            f"(target >= 20,000)"
        )
        print(
            f"  baseline, redis-py pipelined XADD of {n:,} entries: {baseline:,.0f}/s; "
            f"ratio {capacity / baseline:.2f}x"
        )
        engine.close()
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
