"""One consumer process of the kill matrix (see :mod:`kill_matrix`):
``python kill_consumer.py '<spec>'``.

A push consumer with the dedup hook on one redis-server, writing the scenarios' file
sink (``by`` = this instance's dedup owner). The listener fails the first attempt of
the keys in the spec's fail list, so those go through the send-back and come back
from the retry topic. With ``kill`` in the spec (``{"point": ..., "key": ...}``) it
installs an observer that SIGKILLs this process the first time a message of that key
reaches that crash point, a :class:`~idem.retry.crash_points.SendBackStage` or a
:class:`~idem.retry.crash_points.ConsumePoint`. It runs until killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / d) for d in ("scenarios", "")]

from harness import FAST, FileSink  # noqa: E402

from idem.config import IdemConfig, LedgerEngine  # noqa: E402
from idem.dedup import Dedup  # noqa: E402
from idem.delay_levels import DelayLevels  # noqa: E402
from idem.redis_client import connect  # noqa: E402
from idem.retry import RetryEngine  # noqa: E402
from idem.retry.consumer import (  # noqa: E402
    DedupMiddleware,
    DefaultMessageListenerConcurrently,
    PushConsumer,
)
from idem.retry.message import MessageExt  # noqa: E402

PERSIST_MS = 100
"""The consume offsets' persist interval (the group commit's is 200 ms)."""


class KillAt:
    """SIGKILL this process when a message of ``key`` reaches ``point`` (either kind)."""

    def __init__(self, point: str, key: str) -> None:
        self.point = point
        self.key = key

    def __call__(self, point: str, messages: Sequence[MessageExt]) -> None:
        if point == self.point and any(m.keys == self.key for m in messages):
            print(f"kill point {point} reached by {self.key}: SIGKILL", file=sys.stderr)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    spec = json.loads(sys.argv[1])
    config = IdemConfig(
        group=spec["group"],
        redis_url=spec["redis_url"],
        data_dir=spec["data_dir"],
        delay_levels=DelayLevels.parse("1s 1s 1s"),
        lease_ms=spec["lease_ms"],
        consume_timeout_ms=60_000,
        engine=LedgerEngine.DELTA_RS,
    )
    fail_first = set(spec["fail_first"])
    sink = FileSink(Path(spec["sink"]))
    owner = spec["name"]
    kill = KillAt(spec["kill"]["point"], spec["kill"]["key"]) if spec.get("kill") else None

    def handle(message: MessageExt) -> None:
        if message.keys in fail_first and message.reconsume_times == 0:
            raise RuntimeError(f"{message.keys}: the sink refuses its first attempt")
        sink.write(message, owner)

    url = spec["redis_url"]
    engine = RetryEngine(config, client=connect(url), on_stage=kill)
    # offsets persisted twice per group-commit interval: an acknowledgement that ran ahead of
    # its commit would reach Redis before a kill, and the restart would skip its key
    settings = FAST.with_changes(persist_consumer_offset_interval_ms=PERSIST_MS)
    consumer = PushConsumer(
        config, settings=settings, client=connect(url), engine=engine, instance_name=owner
    )
    consumer.subscribe(spec["topic"])
    dedup = Dedup(config, client=connect(url))
    consumer.use(DedupMiddleware(dedup, owner=owner, on_point=kill))
    consumer.register_message_listener_concurrently(DefaultMessageListenerConcurrently(handle))
    consumer.start()
    Path(spec["ready"]).touch()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
