"""The Spark driver's peak memory with a big micro-batch through idem, against a plain sink.

    python bench/spark_driver_memory.py            # 2M-row batch against a 100k-row batch
    python bench/spark_driver_memory.py --quick    # tiny sizes: a smoke run

One micro-batch of ``--rows`` rows of about ``--row-bytes`` bytes each (a
parquet file read as one batch), and the same with ``--small`` rows, go
through each configuration, every one in a driver process of its own so each
peak is its own:

  exactly_once/delta-spark  ``@idem.spark.exactly_once`` around a function that
                            appends the fresh rows as parquet; ledger on delta-spark
  delta_sink/delta-spark    ``idem.spark.delta_sink`` on delta-spark
  exactly_once/delta-rs     as above, ledger on delta-rs
  delta_sink/delta-rs       ``idem.spark.delta_sink`` on delta-rs
  parquet                   a plain ``foreachBatch`` parquet append (no idem)

The delta-spark configurations and ``parquet`` run with
``spark.driver.memory=1g`` and ``spark.driver.maxResultSize=64m``, the limits
a driver that never holds a batch lives with; the delta-rs ones with Spark's
default driver settings (the delta-rs engine writes from the driver process).

The driver's peak memory is sampled by this process, polling the RSS of the
driver's Python and of its JVM (``psutil`` if installed, else ``/proc``),
and the JVM's heap peak is read inside the driver (``MemoryPoolMXBean``).
Reported: the peak at ``--rows`` against ``--small`` (target for delta-spark:
<= 1.3x), and the driver's growth in bytes per row between the two. A
configuration that fails (a driver out of memory, a result over
``maxResultSize``) is reported with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _spark import MIB, JvmHeap, delta_session, jvm_child, rss_bytes  # noqa: E402

from idem.config import IdemConfig, LedgerEngine  # noqa: E402

KEY = "order_id"
NOTE_CHARS = 200
"""The free-text column's length; with the others a row is about 250 bytes."""
LIMITED = {"spark.driver.memory": "1g", "spark.driver.maxResultSize": "64m"}
CONFIGS: Mapping[str, Mapping[str, str]] = {
    "exactly_once/delta-spark": LIMITED,
    "delta_sink/delta-spark": LIMITED,
    "exactly_once/delta-rs": {},
    "delta_sink/delta-rs": {},
    "parquet": LIMITED,
}
DEFAULT_MASTER = "local-cluster[2,1,2048]"
"""Executors in JVMs of their own (2 GiB each): the driver's figures are the driver's alone.
With ``local[N]`` the executors' work runs inside the driver's JVM and counts as its."""
HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def write_batch(directory: Path, rows: int, *, chunk: int = 100_000) -> None:
    """One parquet file of ``rows`` distinct orders with a ``NOTE_CHARS``-character note."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(rows)
    schema = pa.schema(
        [
            (KEY, pa.string()),
            ("amount", pa.float64()),
            ("customer", pa.string()),
            ("ts", pa.timestamp("us", tz="UTC")),
            ("note", pa.string()),
        ]
    )
    with pq.ParquetWriter(directory / "batch.parquet", schema) as writer:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            numbers = np.arange(start, start + n)
            notes = HEX[rng.integers(0, 16, size=n * NOTE_CHARS)].tobytes()
            offsets = pa.array(np.arange(0, (n + 1) * NOTE_CHARS, NOTE_CHARS, dtype=np.int32))
            note = pa.StringArray.from_buffers(n, offsets.buffers()[1], pa.py_buffer(notes))
            times = np.datetime64("2024-05-01T10:00:00", "us") + numbers.astype("timedelta64[ms]")
            writer.write_table(
                pa.table(
                    {
                        KEY: pc.binary_join_element_wise(
                            "ORDER_", pa.array(numbers + 10**12).cast(pa.string()), ""
                        ),
                        "amount": pa.array(rng.uniform(1, 500, size=n)),
                        "customer": pc.binary_join_element_wise(
                            "C", pa.array(numbers % 997).cast(pa.string()), ""
                        ),
                        "ts": pa.array(times, pa.timestamp("us", tz="UTC")),
                        "note": note,
                    },
                    schema=schema,
                )
            )


# -- one driver --------------------------------------------------------------------------------


TELLING = ("maxResultSize", "OutOfMemoryError", "Java heap space", "Killed", "Caused by")
"""What the line of a driver's error or log that says what went wrong contains."""


def telling_line(text: str) -> str | None:
    """The first line of ``text`` that says what went wrong (see :data:`TELLING`)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for needle in TELLING:
        for line in lines:
            if needle in line:
                return line[:400]
    return None


def short_error(exc: BaseException) -> str:
    """The line of a (Spark) error that says what went wrong."""
    text = f"{type(exc).__name__}: {exc}"
    return telling_line(text) or text.strip().splitlines()[0][:400]


def make_sink(config: str, root: Path, server: Any) -> Any:
    """The ``foreachBatch`` function of ``config``."""
    out = root / "out"
    if config == "parquet":

        def plain(df: Any, batch_id: int) -> None:
            df.write.mode("append").parquet(str(out))

        return plain
    from idem.spark import delta_sink, exactly_once

    kind, engine = config.split("/")
    idem_config = IdemConfig(
        group="bench",
        redis_url=server.url,
        data_dir=str(root / "idem"),
        engine=LedgerEngine(engine),
    )
    if kind == "delta_sink":
        return delta_sink(str(out), key=KEY, config=idem_config, client=server.client())

    @exactly_once(key=KEY, config=idem_config, client=server.client())
    def write(fresh: Any, batch_id: int) -> None:
        fresh.write.mode("append").parquet(str(out))

    return write


def child(config: str, source: Path, root: Path, out: Path, master: str) -> int:
    """Run one micro-batch through ``config`` in this (driver) process; results to ``out``."""
    from idem.redis_server import RedisServer

    result: dict[str, Any] = {"config": config}
    spark = delta_session(master, CONFIGS[config])
    server = RedisServer()
    server.start()
    heap = JvmHeap(spark)
    result["heap_max"] = heap.max()
    try:
        sink = make_sink(config, root, server)
        schema = spark.read.parquet(str(source)).schema
        heap.reset_peak()
        started = time.perf_counter()
        query = (
            spark.readStream.schema(schema)
            .parquet(str(source))
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(root / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        result["seconds"] = time.perf_counter() - started
        result["heap_peak"] = heap.peak()
        reader = spark.read.format("delta") if config.startswith("delta_sink") else spark.read
        result["rows_written"] = reader.load(str(root / "out")).count()
        result["status"] = "ok"
    except Exception as exc:  # reported by the parent, with the configuration
        result["status"] = "failed"
        result["error"] = short_error(exc)
    finally:
        out.write_text(json.dumps(result))
        server.stop()
        with contextlib.suppress(Exception):  # a JVM that died of its error cannot stop
            spark.stop()
    return 0 if result["status"] == "ok" else 1


# -- the run -----------------------------------------------------------------------------------


def measure(config: str, source: Path, root: Path, timeout: float, master: str) -> dict[str, Any]:
    """Start one driver on ``source``; sample its Python's and its JVM's RSS until it ends."""
    root.mkdir(parents=True)
    out, log = root / "result.json", root / "driver.log"
    command = [sys.executable, __file__, "--child", config, "--source", str(source)]
    command += ["--root", str(root), "--out", str(out), "--master", master]
    peaks = {"python": 0, "jvm": 0, "driver": 0}
    started = time.monotonic()
    with log.open("wb") as stderr:
        proc = subprocess.Popen(command, stdout=stderr, stderr=subprocess.STDOUT)
        jvm: int | None = None
        while proc.poll() is None:
            if time.monotonic() - started > timeout:
                proc.kill()
                break
            jvm = jvm or jvm_child(proc.pid)
            python = rss_bytes(proc.pid)
            java = rss_bytes(jvm) if jvm else 0
            peaks["python"] = max(peaks["python"], python)
            peaks["jvm"] = max(peaks["jvm"], java)
            peaks["driver"] = max(peaks["driver"], python + java)
            time.sleep(0.05)
        proc.wait()
    result: dict[str, Any] = (
        json.loads(out.read_text()) if out.exists() else {"config": config, "status": "failed"}
    )
    result["peaks"] = peaks
    result["returncode"] = proc.returncode
    if result["status"] != "ok":
        # A JVM that died leaves Python only a refused py4j connection: its log says why.
        text = log.read_text(errors="replace")
        tail = [line for line in text.splitlines() if line.strip()]
        if "error" not in result:
            why = "timed out" if time.monotonic() - started > timeout else "died"
            result["error"] = f"driver {why} (exit {proc.returncode})" + (
                f": {tail[-1]}" if tail else ""
            )
        cause = telling_line(text)
        if cause and cause not in result["error"]:
            result["error"] += f"; the driver's log: {cause}"
    return result


def describe(config: str, rows: int, result: Mapping[str, Any]) -> str:
    """One configuration's line."""
    peaks = result["peaks"]
    head = f"  {config:<25} {rows:>9,} rows: "
    if result["status"] != "ok":
        return head + (
            f"FAILED (driver peak before it failed {peaks['driver'] / MIB:.0f} MiB, JVM RSS "
            f"{peaks['jvm'] / MIB:.0f}): {result.get('error', '')}"
        )
    return head + (
        f"peak {peaks['driver'] / MIB:6.0f} MiB (Python {peaks['python'] / MIB:.0f} + JVM RSS "
        f"{peaks['jvm'] / MIB:.0f}; JVM heap peak {result['heap_peak'] / MIB:.0f} of "
        f"{result['heap_max'] / MIB:.0f}); {result['seconds']:.1f} s; "
        f"{result['rows_written']:,} rows written"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the big batch")
    parser.add_argument("--small", type=int, default=100_000, help="rows of the reference batch")
    parser.add_argument(
        "--middle", type=int, help="rows of a batch between them, for the growth at the margin "
        "(default: half of --rows; 0: none)",
    )  # fmt: skip
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per driver")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument(
        "--keep", action="store_true", help="keep the temporary directory (and the drivers' logs)"
    )
    parser.add_argument(
        "--master",
        default=DEFAULT_MASTER,
        help="Spark master of each driver (default: two executor JVMs of their own)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--source", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.source, args.root, args.out, args.master)
    if args.quick:
        args.rows, args.small = 20_000, 2_000
    if args.middle is None:
        args.middle = args.rows // 2
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    if not 0 < args.small < args.rows:
        parser.error("--small: must be above 0 and below --rows")
    if args.middle and not args.small < args.middle < args.rows:
        parser.error("--middle: must be between --small and --rows (or 0)")

    root = Path(tempfile.mkdtemp(prefix="idem-bench-driver-"))
    try:
        sizes = (args.small, *([args.middle] if args.middle else []), args.rows)
        for rows in sizes:
            write_batch(root / f"in-{rows}", rows)
        size = (root / f"in-{args.rows}" / "batch.parquet").stat().st_size
        print(
            f"one micro-batch of {args.rows:,} rows ({size / MIB:.0f} MiB as parquet) "
            f"against one of {args.small:,}; each in its own driver process on {args.master}",
            flush=True,
        )
        results: dict[tuple[str, int], dict[str, Any]] = {}
        for config in configs:
            limits = CONFIGS[config] or {"(Spark's defaults)": ""}
            print(f"{config}: {', '.join(f'{k}={v}' if v else k for k, v in limits.items())}")
            for rows in sizes:
                run_root = root / "run" / f"{config.replace('/', '-')}-{rows}"
                result = measure(config, root / f"in-{rows}", run_root, args.timeout, args.master)
                results[config, rows] = result
                print(describe(config, rows, result), flush=True)
                if not args.keep:
                    shutil.rmtree(run_root, ignore_errors=True)
        print_summary(results, configs, sizes)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def print_summary(
    results: Mapping[tuple[str, int], Mapping[str, Any]],
    configs: list[str],
    sizes: tuple[int, ...],
) -> None:
    """Peak at the big batch against the small one, and growth per row, per configuration:
    from the small batch, and at the margin (from the middle one, when there is one).

    The growth from the small batch also holds the buffers a small batch never fills
    (a Parquet row group, a writer's buffer); the growth at the margin is what each
    further row costs."""
    small, big = sizes[0], sizes[-1]
    print(f"\ndriver peak (Python RSS + JVM RSS), {big:,} rows against {small:,}:")
    for config in configs:
        a, b = results[config, small], results[config, big]
        if a["status"] != "ok" or b["status"] != "ok":
            failed = b if b["status"] != "ok" else a
            rows = big if failed is b else small
            print(f"  {config:<25} n/a: the {rows:,}-row batch failed")
            continue
        ratio = b["peaks"]["driver"] / a["peaks"]["driver"]
        growth = (b["peaks"]["driver"] - a["peaks"]["driver"]) / (big - small)
        target = ""
        if config.endswith("delta-spark"):
            target = f" [target <= 1.3x:{' met' if ratio <= 1.3 else ' NOT met'}]"
        margin = ""
        if len(sizes) == 3 and results[config, sizes[1]]["status"] == "ok":
            m = results[config, sizes[1]]
            per_row = (b["peaks"]["driver"] - m["peaks"]["driver"]) / (big - sizes[1])
            margin = f", {per_row:7.1f} per row from {sizes[1]:,} rows"
        print(
            f"  {config:<25} {ratio:5.2f}x, {growth:7.1f} bytes of driver per row{margin}{target}"
        )


if __name__ == "__main__":
    sys.exit(main())
