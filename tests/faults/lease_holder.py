"""A lease holder process: ``python lease_holder.py '<spec>'`` (see test_stopped_lease_holder).

Claims the spec's keys for its own owner, says so (the ``claimed`` file), works on
them for ``work_s`` while a :class:`~idem.lease_keeper.LeaseKeeper` renews its
leases, then completes them and writes what the commit reported (``outcome`` file,
JSON: committed, slipped, fenced).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from idem.config import IdemConfig, LedgerEngine
from idem.dedup import Dedup
from idem.lease_keeper import LeaseKeeper


def _publish(path: str, value: object) -> None:
    """Write ``value`` as JSON to ``path`` at once: the test reads it as soon as it exists."""
    part = Path(f"{path}.part")
    part.write_text(json.dumps(value), encoding="utf-8")
    part.replace(path)


def main() -> None:
    spec = json.loads(sys.argv[1])
    config = IdemConfig(
        group=spec["group"],
        redis_url=spec["redis_url"],
        data_dir=spec["data_dir"],
        lease_ms=spec["lease_ms"],
        engine=LedgerEngine.DELTA_RS,
    )
    dedup = Dedup(config)
    keys: list[str] = spec["keys"]
    claim = dedup.begin(keys, owner=spec["owner"])
    fresh = [keys[i] for i in claim.fresh]
    with LeaseKeeper(dedup, fresh, spec["owner"]):
        _publish(spec["claimed"], fresh)
        time.sleep(spec["work_s"])  # the sink's work; SIGSTOP lands here
    outcome = dedup.complete(claim, batch_id=1)
    _publish(
        spec["outcome"],
        {
            "committed": outcome.committed,
            "slipped": list(outcome.slipped),
            "fenced": list(outcome.fenced),
        },
    )
    dedup.close()


if __name__ == "__main__":
    main()
