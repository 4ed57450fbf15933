"""A consumer process that kills itself (SIGKILL) right after consuming a given key.

Run by the C3 scenario: ``python crash_consumer.py '<json settings>'``. The kill
comes after the listener wrote the sink and after the dedup hook (when on)
completed the key — its group commit is durable — so after consuming, before the
next offset persist.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from harness import FAST, Group

from idem.retry.consumer import BatchResult, ConsumeScope
from idem.retry.consumer.listener import CallNext
from idem.retry.message import MessageExt


class CrashAfter:
    """Outermost middleware: SIGKILL this process once ``key`` has been consumed."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(
        self, messages: Sequence[MessageExt], scope: ConsumeScope, call_next: CallNext
    ) -> BatchResult:
        result = call_next(messages)
        hit = [i for i, m in enumerate(messages) if m.keys == self.key]
        if hit:
            pending = result.pending.get(hit[0])
            if pending is not None:  # the dedup hook's group commit: wait until durable
                pending.wait(30)
            os.kill(os.getpid(), signal.SIGKILL)
        return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    group = Group(spec["redis_url"], Path(spec["base"]), spec["group"], spec["dedup"])
    settings = FAST.with_changes(persist_consumer_offset_interval_ms=spec["persist_ms"])
    group.consumer("child", middleware=[CrashAfter(spec["crash_key"])], settings=settings)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
