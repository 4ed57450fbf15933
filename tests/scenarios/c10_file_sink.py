"""The ``--sink-fn`` of the C10 scenario: appends every row it gets to a JSON-lines file.

A plain file is the textbook non-transactional sink: a driver crash between
the append and idem's commit makes Spark's replay append the rows again. Each
line carries the idempotency key idem passed, so a repeat is recognisable.
Keys in ``IDEM_C10_FLAKY`` (comma-separated) fail on their first delivery.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pyspark.sql import DataFrame


def append(fresh: DataFrame, batch_id: int) -> dict[str, str]:
    """Append the accepted rows to ``$IDEM_C10_SINK_FILE``; return the failed keys."""
    flaky = set(filter(None, os.environ.get("IDEM_C10_FLAKY", "").split(",")))
    rows = fresh.select("order_id", "idempotency_key", "reconsume_times").toArrow().to_pylist()
    failed = {
        r["order_id"]: "TimeoutError: downstream timed out"
        for r in rows
        if r["order_id"] in flaky and (r["reconsume_times"] or 0) < 1
    }
    with Path(os.environ["IDEM_C10_SINK_FILE"]).open("a", encoding="utf-8") as out:
        for r in rows:
            if r["order_id"] not in failed:
                line = {"key": r["order_id"], "idempotency_key": r["idempotency_key"]}
                out.write(json.dumps({**line, "batch_id": batch_id}) + "\n")
        out.flush()
        os.fsync(out.fileno())
    return failed
