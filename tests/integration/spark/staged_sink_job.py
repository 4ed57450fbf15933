"""A Delta sink batch far larger than ``spark.driver.maxResultSize``, on the delta-rs engine.

Run by ``test_delta_sink_staging.py`` as ``python staged_sink_job.py REDIS_URL DATA_DIR``:
starts ``local[2]`` with ``spark.driver.maxResultSize`` at 8 MiB, writes one batch of
rows carrying 4 KiB of payload each (far more than 8 MiB in all; their keys and
message ids far less) through ``delta_sink``, and prints one JSON line: the batch's
outcome and what the table holds.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from deltalake import DeltaTable
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention

from idem.config import IdemConfig
from idem.ledger import read_table
from idem.spark.delta_sink import delta_sink
from idem.spark.session import local_session

ROWS = 12_000
PAYLOAD = 4096
MAX_RESULT = "8m"


def main(url: str, data_dir: str) -> None:
    spark = local_session(
        "idem-staged-sink", fast_start=True, conf={"spark.driver.maxResultSize": MAX_RESULT}
    )
    config = IdemConfig(group="staged", redis_url=url, data_dir=data_dir, buckets=4,
                        engine="delta-rs")  # fmt: skip
    table = f"{data_dir}/orders"
    # Made on the executors: the driver never holds the payload unless idem gathers it.
    batch = spark.range(ROWS, numPartitions=4).select(
        F.concat(F.lit("ORDER-"), F.col("id").cast("string")).alias("order_id"),
        F.col("id").alias("n"),
        F.repeat(F.substring(F.sha2(F.col("id").cast("string"), 256), 1, 8), PAYLOAD // 8).alias(
            "blob"
        ),
    )
    sink = delta_sink(table, key="order_id", config=config)
    sink.query_id = "q"
    outcome = sink.process(batch, 0)
    rows = read_table(DeltaTable(table), ["key", "n", "blob"])
    keys = Counter(rows.column("key").to_pylist())
    blobs = rows.column("blob").to_pylist()
    print(
        json.dumps(
            {
                "applied": outcome.applied,
                "keys": len(keys),
                "rows_per_key": sorted(set(keys.values())),
                "payload_bytes": sum(len(b) for b in blobs),
                "numbers": sorted(rows.column("n").to_pylist()) == list(range(ROWS)),
                "staging_left": [str(p) for p in Path(table).glob("_idem_staging*")],
            }
        ),
        flush=True,
    )
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:3])
