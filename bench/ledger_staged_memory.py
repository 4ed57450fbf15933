"""The committing process's memory when the delta-rs ledger commits a big staged batch.

    python bench/ledger_staged_memory.py                       # 2M rows against 200k
    python bench/ledger_staged_memory.py --rows 200000 --small 20000 --paths append

A Delta sink on the delta-rs engine stages a micro-batch's rows as Parquet files
and commits them from one process holding only their ledger columns
(:class:`idem.ledger.staged.StagedRows`). This writes ``--rows`` rows of about
``--row-bytes`` bytes (the ledger's columns and a free-text note) as ``--files``
staged files, then commits them in a process of its own per commit path:

  create   the first commit, which creates the table
  append   the checked append (index mode), into a table of one small batch
  merge    the insert-only MERGE (strict mode), into the same
  driver   what a Spark driver does for a Delta sink on delta-rs: read the ledger
           columns back from the files (key, fingerprint, bucket, message ids),
           then ``Dedup.complete_rows``: the ledger rows, the checked append and
           the Redis index update, against a private redis-server

and reports the process's resident memory before the commit (the ledger
columns in memory; for ``driver``, before they are read) and its peak during
it, then per path the growth in bytes per row between ``--small`` and
``--rows`` rows (what a row adds, beyond the fixed cost of a commit). For
``driver`` it also prints the ledger columns' own size per row in Arrow, the
least a driver that holds them can grow by. No Spark: only the ledger, the
files and, for ``driver``, Redis.

``--target-file-size``, ``--max-row-group-size`` and ``--write-batch-size``
set delta-rs' writer knobs, for comparison.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from idem.keys import bucket_of
from idem.ledger import LEDGER_SCHEMA, DeltaLedger, conform
from idem.ledger.staged import StagedRows, parquet_opener

MIB = 1024 * 1024
BUCKETS = 16
STAMP_MS = 1_700_049_600_000
HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
PATHS = ("create", "append", "merge", "driver")
DRIVER_COLUMNS = ["key", "fingerprint", "bucket", "msg_id", "origin_msg_id", "topic"]
"""What a Spark driver reads back of the staged rows (``idem.spark.micro_batch``)."""


def rss() -> int:
    """This process's resident memory in bytes (from ``/proc``)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


class Peak:
    """Samples this process's RSS every few milliseconds until stopped; keeps the peak."""

    def __init__(self) -> None:
        self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss())


def stage(directory: Path, rows: int, files: int, note_chars: int, *, first_key: int = 0) -> None:
    """``files`` Parquet files of ``rows`` rows in all, each the ledger's columns and a note."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(rows)
    per_file = -(-rows // files)
    chunk = 100_000
    for n in range(files):
        first, last = n * per_file, min(rows, (n + 1) * per_file)
        writer: pq.ParquetWriter | None = None
        for start in range(first, last, chunk):
            count = min(chunk, last - start)
            keys = [f"ORDER_{10**12 + first_key + i}" for i in range(start, start + count)]
            notes = HEX[rng.integers(0, 16, size=count * note_chars)].tobytes()
            offsets = np.arange(0, (count + 1) * note_chars, note_chars, dtype=np.int32)
            note = pa.StringArray.from_buffers(
                count, pa.py_buffer(offsets.tobytes()), pa.py_buffer(notes)
            )
            table = conform(
                pa.table(
                    {
                        "group": pa.repeat(pa.scalar("bench"), count),
                        "bucket": pa.array([bucket_of(k, BUCKETS) for k in keys], pa.int32()),
                        "key": pa.array(keys),
                        "msg_id": pc.binary_join_element_wise("M", pa.array(keys), ""),
                        "fingerprint": pc.binary_join_element_wise("F", pa.array(keys), ""),
                        "amount": pa.array(rng.uniform(1, 500, size=count)),
                        "note": note,
                    }
                ),
                now_ms=STAMP_MS,
            )
            if writer is None:
                writer = pq.ParquetWriter(directory / f"part-{n}.parquet", table.schema)
            writer.write_table(table)
        if writer is not None:
            writer.close()


def staged_rows(directory: Path) -> StagedRows:
    """The staged files as :class:`StagedRows`: their ledger columns read into memory."""
    files = sorted(str(p) for p in directory.glob("*.parquet"))
    schema = pq.read_schema(files[0])
    ledger_columns = ["group", "bucket", "key", "msg_id", "fingerprint"]
    keys = pa.concat_tables(pq.read_table(f, columns=ledger_columns) for f in files)
    keys = conform(keys, now_ms=STAMP_MS).select(LEDGER_SCHEMA.names)
    return StagedRows(keys=keys, schema=schema, open=parquet_opener(files, schema))


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One commit of the staged rows along ``args.path``; what it cost."""
    from deltalake import WriterProperties, write_deltalake

    from idem.ledger import deltars

    knobs: dict[str, Any] = {}
    if args.target_file_size:
        knobs["target_file_size"] = args.target_file_size
    props: dict[str, Any] = {}
    if args.max_row_group_size:
        props["max_row_group_size"] = args.max_row_group_size
    if args.write_batch_size:
        props["write_batch_size"] = args.write_batch_size
    if props:
        props["column_properties"] = {
            c: deltars.ColumnProperties(dictionary_enabled=False) for c in deltars._UNIQUE_COLUMNS
        }
        deltars.WRITER_PROPERTIES = WriterProperties(**props)  # type: ignore[misc]
    if knobs:

        def knobbed(*a: Any, **kw: Any) -> None:
            write_deltalake(*a, **kw, **knobs)

        deltars.write_deltalake = knobbed  # type: ignore[assignment]

    table = Path(args.table)
    if args.path == "driver":
        return driver_child(args, table)
    ledger = DeltaLedger(str(table))
    if args.path != "create":
        first = staged_rows(Path(args.seed))
        ledger.commit(first, app_id="seed", txn_version=0, match_since_ms=None)
    rows = staged_rows(Path(args.staged))
    before = rss()
    peak = Peak()
    started = time.perf_counter()
    after = 0 if args.path == "append" else None
    result = ledger.commit(
        rows,
        app_id="bench",
        txn_version=0,
        match_since_ms=STAMP_MS - 3_600_000,
        match_after_version=after,
    )
    seconds = time.perf_counter() - started
    top = peak.stop()
    files = len(list(table.glob("bucket=*/*/*.parquet")))
    return {
        "path": args.path,
        "rows": rows.num_rows,
        "inserted": result.inserted,
        "version": result.version,
        "seconds": round(seconds, 1),
        "rss_before_mib": round(before / MIB),
        "rss_peak_mib": round(top / MIB),
        "bytes_per_row": round((top - before) / max(1, rows.num_rows)),
        "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "data_files": files,
    }


def driver_child(args: argparse.Namespace, table: Path) -> dict[str, Any]:
    """The driver's completion of the staged rows: columns read back, then
    ``Dedup.complete_rows`` with the Redis update done before it returns."""
    from idem.config import IdemConfig, LedgerEngine
    from idem.dedup import Dedup
    from idem.outcome import ClaimedRows
    from idem.redis_server import RedisServer

    def staged(directory: str) -> tuple[pa.Table, StagedRows]:
        files = sorted(str(p) for p in Path(directory).glob("*.parquet"))
        schema = pq.read_schema(files[0])
        columns = pa.concat_tables(pq.read_table(f, columns=DRIVER_COLUMNS) for f in files)
        return columns, StagedRows(keys=columns, schema=schema, open=parquet_opener(files, schema))

    with RedisServer() as server:
        config = IdemConfig(
            group="bench",
            redis_url=server.url,
            ledger_path=str(table),
            engine=LedgerEngine.DELTA_RS,
            buckets=BUCKETS,
        )
        dedup = Dedup(config)
        try:
            # The sink table exists (one small batch), as a running stream's does.
            seed_columns, seed = staged(args.seed)
            first = ClaimedRows(owner="bench-seed", columns=seed_columns, held=False)
            dedup.complete_rows(first, batch_id=0, app_id="bench-seed", payload=seed)
            del seed_columns, seed
            before = rss()
            peak = Peak()
            started = time.perf_counter()
            columns, rows_staged = staged(args.staged)
            read = rss()
            claim = ClaimedRows(owner="bench-owner", columns=columns, ledger_version=0, held=False)
            outcome = dedup.complete_rows(claim, batch_id=0, app_id="bench", payload=rows_staged)
            seconds = time.perf_counter() - started
            top = peak.stop()
        finally:
            dedup.close()
    rows = columns.num_rows
    return {
        "path": args.path,
        "rows": rows,
        "inserted": outcome.committed,
        "version": outcome.version,
        "seconds": round(seconds, 1),
        "rss_before_mib": round(before / MIB),
        "rss_columns_read_mib": round(read / MIB),
        "rss_peak_mib": round(top / MIB),
        "columns_bytes_per_row": round(columns.nbytes / max(1, rows)),
        "bytes_per_row": round((top - before) / max(1, rows)),
    }


def run_child(args: argparse.Namespace, root: Path, path: str, size: int) -> dict[str, Any]:
    """One commit along ``path`` of the ``size`` staged rows, in a process of its own."""
    table = root / f"table-{path}-{size}"
    command = [
        sys.executable,
        __file__,
        "--child",
        f"--path={path}",
        f"--staged={root / f'staged-{size}'}",
        f"--seed={root / 'seed'}",
        f"--table={table}",
        f"--target-file-size={args.target_file_size}",
        f"--max-row-group-size={args.max_row_group_size}",
        f"--write-batch-size={args.write_batch_size}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    shutil.rmtree(table, ignore_errors=True)
    if done.returncode:
        return {"path": path, "rows": size, "error": done.stderr.strip()[-600:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--small", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--row-bytes", type=int, default=250)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--target-file-size", type=int, default=0)
    parser.add_argument("--max-row-group-size", type=int, default=0)
    parser.add_argument("--write-batch-size", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--staged", help=argparse.SUPPRESS)
    parser.add_argument("--seed", help=argparse.SUPPRESS)
    parser.add_argument("--table", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    note_chars = max(1, args.row_bytes - 50)  # the ledger's columns are about 50 bytes
    root = Path(tempfile.mkdtemp(prefix="idem-staged-"))
    try:
        sizes = sorted({args.small, args.rows})
        for size in sizes:
            stage(root / f"staged-{size}", size, args.files, note_chars)
        stage(root / "seed", 1000, 1, note_chars, first_key=10**9)
        for path in args.paths.split(","):
            grown: dict[int, int] = {}
            for size in sizes:
                result = run_child(args, root, path, size)
                print(json.dumps(result), flush=True)
                if "error" not in result:
                    grown[size] = (result["rss_peak_mib"] - result["rss_before_mib"]) * MIB
            if len(grown) == 2:
                (small, a), (big, b) = sorted(grown.items())
                print(
                    f"{path}: growth {(b - a) / (big - small):.0f} bytes per row "
                    f"between {small:,} and {big:,} rows",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
