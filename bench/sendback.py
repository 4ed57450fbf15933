"""Send-backs of one failed message per call, with and without the journal's file compaction.

A push consumer with the default consume batch of one message sends each failure back
alone: one retry-journal append (a Delta commit of a small file) and one Redis apply
per call. A Delta commit costs time in proportion to the files the table holds, so
without compaction a busy group's send-backs slow down as it runs; the group's
schedule service compacts the journal's small files as they gather
(:meth:`idem.retry.RetryEngine.maybe_compact_journal_files`). This sends
``--messages`` messages back one per call, once beside a schedule service that
compacts and once beside one that does not, on the same redis-server with the journal
on local disk, and prints messages/second overall, the time per call over the first
and the last tenth of the calls, and the ratio of the two rates.

    python bench/sendback.py [--messages 2000]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry import MessageExt, RetryEngine
from idem.retry.engine import DEFAULT_COMPACT_INTERVAL_MS


class Run(NamedTuple):
    """One run's figures."""

    rate: float
    """Messages per second over the whole run."""
    first_ms: float
    """Mean milliseconds per call over the first tenth of the calls."""
    last_ms: float
    """Mean milliseconds per call over the last tenth."""


def run(server: RedisServer, workdir: Path, *, messages: int, compact: bool) -> Run:
    """Send ``messages`` messages back one per call beside a schedule service."""
    group = f"bench_sendback_{'compacted' if compact else 'plain'}"
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
    started = time.perf_counter()
    for message in batch[1:]:
        began = time.perf_counter()
        engine.send_back([message], delay_level=1)
        calls.append(time.perf_counter() - began)
    elapsed = time.perf_counter() - started
    service.stop()
    engine.close()
    tenth = max(1, len(calls) // 10)
    return Run(
        len(calls) / elapsed,
        1000 * sum(calls[:tenth]) / tenth,
        1000 * sum(calls[-tenth:]) / tenth,
    )


def main() -> None:
    """Both runs, then the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="idem-bench-sendback-"))
    try:
        with RedisServer() as server:
            plain = run(server, workdir, messages=args.messages, compact=False)
            compacted = run(server, workdir, messages=args.messages, compact=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"send-back, one message per call, {args.messages - 1} calls, journal on local disk")
    for name, r in (("no file compaction", plain), ("files compacted", compacted)):
        print(
            f"  {name:<19} {r.rate:6.1f} msg/s   per call: first tenth {r.first_ms:6.1f} ms,"
            f" last tenth {r.last_ms:6.1f} ms"
        )
    print(f"  ratio compacted / not: {compacted.rate / plain.rate:.2f}")


if __name__ == "__main__":
    main()
