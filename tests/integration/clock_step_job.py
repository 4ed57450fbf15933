"""One dedup step of a process whose clock is stepped, for ``test_clock_steps.py``.

Run under ``faketime`` as ``python clock_step_job.py SETTINGS_JSON ACTION OWNER KEY...``
(SETTINGS_JSON: the :class:`~idem.config.IdemConfig` fields). ACTION is ``claim``
(claim the keys), ``hold`` (claim them and exit holding the leases, as a process that
dies mid-batch) or ``complete`` (claim them and commit every fresh one). Prints one
JSON line: the process's clock, the keys claimed fresh, busy and duplicate.
"""

from __future__ import annotations

import json
import sys
import time

from idem.config import IdemConfig
from idem.dedup import Dedup


def main(settings: str, action: str, owner: str, keys: list[str]) -> None:
    dedup = Dedup(IdemConfig(**json.loads(settings)))  # the system clock, as in production
    claim = dedup.begin(keys, owner=owner)
    if action == "complete" and claim.fresh:
        dedup.complete(claim, batch_id=0, app_id=owner)
    elif action == "claim":
        dedup.release(claim)
    print(
        json.dumps(
            {
                "clock_ms": time.time_ns() // 1_000_000,
                "fresh": [keys[i] for i in claim.fresh],
                "busy": [keys[i] for i in claim.busy],
                "duplicates": sorted(keys[i] for i in claim.duplicates),
            }
        )
    )
    dedup.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])
