"""Send-backs of one failed message per call, as a push consumer's consume threads make them.

A push consumer with the default consume batch of one message sends each failure back
alone, from whichever consume thread ran it: one retry-journal append (a Delta commit)
and one Redis apply per call. Concurrent calls of one process share a journal commit
(:mod:`idem.retry.journal_group`), and the group's schedule service compacts the
journal's small files as they gather (a commit costs time in proportion to the files
the table holds). This sends ``--messages`` messages back one per call from 1 thread
and from ``--threads`` threads, each run beside its group's schedule service as in a
push consumer, on the same redis-server and a journal on local disk, and prints
messages/second, journal commits per send-back and the ratio of the two rates.

    python bench/sendback.py [--messages 2000] [--threads 8]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from pathlib import Path

from deltalake import DeltaTable

from idem.config import IdemConfig
from idem.redis_server import RedisServer
from idem.retry import MessageExt, RetryEngine


def run(server: RedisServer, workdir: Path, *, messages: int, threads: int) -> tuple[float, int]:
    """Messages/second and journal commits for ``messages`` send-backs from ``threads``."""
    group = f"bench_sendback_{threads}"
    config = IdemConfig(group=group, redis_url=server.url, data_dir=str(workdir / group))
    engine = RetryEngine(config)
    batch = [
        MessageExt(
            topic="TopicTest",
            msg_id=f"M{threads}-{i}",
            keys=f"ORDER_{i}",
            body=b'{"order": 1, "amount": 10}',
        )
        for i in range(messages)
    ]
    engine.send_back(batch[:1], delay_level=1)  # the journal exists before the clock starts
    service = engine.schedule_service(name=f"{group}-schedule").start()
    failures: list[BaseException] = []

    def consume_thread(mine: list[MessageExt]) -> None:
        try:
            for message in mine:
                engine.send_back([message], delay_level=1)
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
    if failures:
        raise failures[0]
    service.stop()
    versions = (engine.journal.latest_version() or 0) - before
    compactions = sum(
        1
        for entry in DeltaTable(engine.journal.path).history(versions + 1)
        if entry.get("operation") == "OPTIMIZE"
    )
    commits = versions - compactions
    engine.close()
    return len(rest) / elapsed, commits


def main() -> None:
    """Both runs, then the figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="idem-bench-sendback-"))
    try:
        with RedisServer() as server:
            one, one_commits = run(server, workdir, messages=args.messages, threads=1)
            many, many_commits = run(server, workdir, messages=args.messages, threads=args.threads)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    n = args.messages - 1
    print(f"send-back, one message per call, {n} calls, journal on local disk")
    print(f"  1 thread   {one:8,.0f} msg/s   {one_commits / n:.2f} journal commits per call")
    print(
        f"  {args.threads} threads  {many:8,.0f} msg/s   "
        f"{many_commits / n:.2f} journal commits per call"
    )
    print(f"  ratio {args.threads} threads / 1 thread: {many / one:.2f}")


if __name__ == "__main__":
    main()
