"""Send-backs of one failed message per call: the journal's file compaction, and calls combined.

A push consumer with the default consume batch of one message sends each failure back
alone: one retry-journal append (a Delta commit of a small file) and one Redis apply
per call. A Delta commit costs time in proportion to the files the table holds, so
the group's schedule service compacts the journal's small files as they gather
(:meth:`idem.retry.RetryEngine.maybe_compact_journal_files`), and the send-backs that
consume threads make while another is under way share the next commit
(:class:`idem.retry.combiner.CallCombiner`). This sends ``--messages`` messages back
one per call, on the same redis-server with the journal on local disk, each run beside
its group's schedule service:

  1 thread, no compaction     the service does no maintenance
  1 thread                    the service compacts the journal's files
  N threads                   ``--threads`` consume threads, the files compacted

and prints messages/second, journal commits per call, the time per call over the
first and the last tenth of the calls (1 thread), and the ratios of the rates.

    python bench/sendback.py [--messages 2000] [--threads 8]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

from deltalake import DeltaTable

from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry import MessageExt, RetryEngine
from idem.retry.engine import DEFAULT_COMPACT_INTERVAL_MS


class Run(NamedTuple):
    """One run's figures."""

    rate: float
    """Messages per second over the whole run."""
    commits: int
    """Journal commits made for the calls (the compactions' not counted)."""
    first_ms: float
    """Mean milliseconds per call over the first tenth of the calls."""
    last_ms: float
    """Mean milliseconds per call over the last tenth."""


def run(server: RedisServer, workdir: Path, *, messages: int, threads: int, compact: bool) -> Run:
    """Send ``messages`` messages back one per call from ``threads`` threads."""
    group = f"bench_sendback_{threads}_{'compacted' if compact else 'plain'}"
    config = IdemConfig(group=group, redis_url=server.url, data_dir=str(workdir / group))
    engine = RetryEngine(config)
    batch = [
        MessageExt(
            topic="TopicTest",
            msg_id=f"M{i}",
            keys=f"ORDER_{i}",
            body=b'{"order": 1, "amount": 10}',
        )
        for i in range(messages)
    ]
    engine.send_back(batch[:1], delay_level=1)  # the journal exists before the clock starts
    service = engine.schedule_service(
        name=f"{group}-schedule",
        # None: no maintenance at all (the journal's base, hours apart, plays no part here)
        compact_interval_ms=DEFAULT_COMPACT_INTERVAL_MS if compact else None,
    ).start()
    calls: list[float] = []
    failures: list[BaseException] = []

    def consume_thread(mine: list[MessageExt]) -> None:
        try:
            for message in mine:
                began = time.perf_counter()
                engine.send_back([message], delay_level=1)
                calls.append(time.perf_counter() - began)
        except BaseException as exc:  # reported after the run
            failures.append(exc)

    rest = batch[1:]
    workers = [
        threading.Thread(target=consume_thread, args=(rest[i::threads],)) for i in range(threads)
    ]
    before = engine.journal.latest_version() or 0
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - started
    service.stop()
    if failures:
        raise failures[0]
    versions = (engine.journal.latest_version() or 0) - before
    history = DeltaTable(engine.journal.path).history(versions + 1)
    compactions = sum(1 for entry in history if entry.get("operation") == "OPTIMIZE")
    engine.close()
    tenth = max(1, len(calls) // 10)
    return Run(
        len(rest) / elapsed,
        versions - compactions,
        1000 * sum(calls[:tenth]) / tenth,
        1000 * sum(calls[-tenth:]) / tenth,
    )


def main() -> None:
    """The three runs, then the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    n = args.messages
    workdir = Path(tempfile.mkdtemp(prefix="idem-bench-sendback-"))
    try:
        with RedisServer() as server:
            plain = run(server, workdir, messages=n, threads=1, compact=False)
            compacted = run(server, workdir, messages=n, threads=1, compact=True)
            many = run(server, workdir, messages=n, threads=args.threads, compact=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"send-back, one message per call, {n - 1} calls, journal on local disk")
    rows = (
        ("1 thread, no compaction", plain),
        ("1 thread", compacted),
        (f"{args.threads} threads", many),
    )
    for name, r in rows:
        print(
            f"  {name:<24} {r.rate:6.1f} msg/s  {r.commits / (n - 1):.2f} commits per call"
            f"  per call: first tenth {r.first_ms:6.1f} ms, last tenth {r.last_ms:6.1f} ms"
        )
    print(f"  ratio compacted / not (1 thread): {compacted.rate / plain.rate:.2f}")
    ratio = many.rate / compacted.rate
    print(f"  ratio {args.threads} threads / 1 thread (compacted): {ratio:.2f}")


if __name__ == "__main__":
    main()
