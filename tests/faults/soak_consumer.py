"""One consumer process of the chaos soak (see :mod:`soak`): ``python soak_consumer.py '<spec>'``.

Topics on the broker's redis-server; the dedup claims, the retry engine and the
consume offsets on the store's redis-server, reached through the fault proxy. The
listener writes the scenarios' file sink (``by`` = this instance's dedup owner and
the wall time of the write) and fails the first attempt of the keys in the spec's
fail list, so those come back through the retry topic. It runs until killed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / d) for d in ("scenarios", "")]

from harness import FAST, TOPIC, FileSink  # noqa: E402

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


def main() -> None:
    spec = json.loads(sys.argv[1])
    config = IdemConfig(
        group=spec["group"],
        redis_url=spec["store_url"],
        data_dir=spec["data_dir"],
        delay_levels=DelayLevels.parse("1s 1s 1s"),
        lease_ms=spec["lease_ms"],
        consume_timeout_ms=60_000,
        engine=LedgerEngine.DELTA_RS,
    )
    fail_first = set(json.loads(Path(spec["fail_file"]).read_text(encoding="utf-8")))
    sink = FileSink(Path(spec["sink"]))
    owner = spec["name"]

    def handle(message: MessageExt) -> None:
        if message.keys in fail_first and message.reconsume_times == 0:
            raise RuntimeError(f"{message.keys}: the sink refuses its first attempt")
        sink.write(message, f"{owner} {time.time():.3f}")

    consumer = PushConsumer(
        config,
        settings=FAST,
        client=connect(spec["broker_url"]),
        engine=RetryEngine(config, client=connect(spec["store_url"])),
        offset_client=connect(spec["store_url"]),
        instance_name=owner,
    )
    consumer.subscribe(TOPIC)
    consumer.use(DedupMiddleware(Dedup(config, client=connect(spec["store_url"])), owner=owner))
    consumer.register_message_listener_concurrently(DefaultMessageListenerConcurrently(handle))
    consumer.start()
    Path(spec["ready"]).touch()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
