"""One of many concurrent ledger writers: ``python ledger_writer.py '<spec>'``.

Says it is ready (its ``ready`` file), waits for the ``go`` file (so every writer starts
at once), then claims and commits its batches of keys under its own owner, one Delta
commit per batch (``txnVersion`` = the batch's number). A key busy under another writer's lease is
tried again in a later round; a commit that raised is tried again with the same
``txnVersion`` (a replay adds nothing the first attempt wrote). Writes a JSON
report: the keys each commit inserted, found already there (slipped), or found
completed at the claim (duplicates), and the commit errors seen.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from idem.config import IdemConfig, LedgerEngine
from idem.dedup import Dedup


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
    owner: str = spec["owner"]
    hold: bool = spec["hold"]
    go = Path(spec["go"])
    Path(spec["ready"]).touch()
    while not go.exists():
        time.sleep(0.01)
    inserted: list[str] = []
    slipped: list[str] = []
    duplicates: list[str] = []
    errors: list[str] = []
    batch_id = 0
    for batch in spec["batches"]:
        waiting: list[str] = list(batch)
        while waiting:
            claim = dedup.begin(waiting, owner=owner, hold=hold)
            duplicates += [claim.keys[i] or "" for i in claim.duplicates]
            if claim.fresh:
                batch_id += 1
                for _attempt in range(10):
                    try:
                        outcome = dedup.complete(claim, batch_id=batch_id)
                    except Exception as exc:  # a conflict past the ledger's retries
                        errors.append(f"{type(exc).__name__}: {exc}"[:300])
                        continue
                    slipped += outcome.slipped
                    inserted += [
                        claim.keys[i] or "" for i in claim.fresh
                        if claim.keys[i] not in set(outcome.slipped)
                    ]  # fmt: skip
                    break
                else:
                    raise SystemExit(f"{owner}: batch {batch_id} never committed: {errors[-1]}")
            waiting = [claim.keys[i] or "" for i in claim.busy]
            if waiting:
                time.sleep(0.25)  # the holder needs the CPU more than we need an answer
    Path(spec["report"]).write_text(
        json.dumps(
            {
                "owner": owner,
                "inserted": inserted,
                "slipped": slipped,
                "duplicates": duplicates,
                "errors": errors,
                "commits": batch_id,
            }
        ),
        encoding="utf-8",
    )
    dedup.close()


if __name__ == "__main__":
    main()
