"""What the Spark benchmarks share: a session with Delta, the driver's memory and CPU.

The driver of a PySpark job is two processes: this Python and the JVM it
started (Spark's Python workers are children of the JVM and count as
executors here). Its memory is the Python process's RSS plus what the JVM's
heap holds (``MemoryMXBean`` through py4j); its CPU is both processes' and
their children's (``/proc``; ``psutil`` is used when installed).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from _cpu import cpu_seconds, stat_fields  # noqa: E402
from jvm_jars import delta_spark_conf, spark_jars  # noqa: E402

MIB = 1 << 20


def _psutil() -> Any:
    try:
        return importlib.import_module("psutil")
    except ImportError:
        return None


PSUTIL = _psutil()


def delta_session(master: str, conf: Mapping[str, str] | None = None) -> Any:
    """A local Spark session on ``master`` with Delta's jars, extension and catalog (as the
    tests' session), its Python workers on this interpreter, and ``conf`` on top."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    jars = spark_jars()
    if jars is None:
        raise SystemExit("no Delta jars in the cache: run bash tests/jvm/fetch.sh")
    from idem.spark import local_session

    settings = {**delta_spark_conf(jars), **(conf or {})}
    return local_session("idem-bench", master=master, conf=settings)


def rss_bytes(pid: int) -> int:
    """Resident memory of one process (0 once it is gone)."""
    if PSUTIL is not None:
        try:
            return int(PSUTIL.Process(pid).memory_info().rss)
        except PSUTIL.Error:
            return 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def children(pid: int) -> list[int]:
    """The direct children of ``pid``."""
    if PSUTIL is not None:
        try:
            return [int(c.pid) for c in PSUTIL.Process(pid).children()]
        except PSUTIL.Error:
            return []
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if stat_fields(int(entry.name))[1] == str(pid):
                    found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``."""
    found: list[int] = []
    todo = children(pid)
    while todo:
        child = todo.pop()
        found.append(child)
        todo += children(child)
    return found


def jvm_child(pid: int) -> int | None:
    """The Java process ``pid`` started (the Spark driver's JVM), if any."""
    for child in children(pid):
        with contextlib.suppress(OSError):
            if b"java" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]:
                return child
    return None


class PeakSampler:
    """Polls a value in a background thread and keeps its peak."""

    def __init__(self, read: Any, interval: float = 0.05) -> None:
        self._read = read
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, int(self._read()))
            self._stop.wait(self._interval)

    def __enter__(self) -> PeakSampler:
        self.peak = int(self._read())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, int(self._read()))


class JvmHeap:
    """The driver JVM's heap, through the JVM's own MXBeans (py4j)."""

    def __init__(self, spark: Any) -> None:
        jvm = spark.sparkContext._jvm
        factory = jvm.java.lang.management.ManagementFactory
        self._memory = factory.getMemoryMXBean()
        self._pools = [
            pool for pool in factory.getMemoryPoolMXBeans() if str(pool.getType()) == "Heap memory"
        ]

    def used(self) -> int:
        """Heap bytes in use now."""
        return int(self._memory.getHeapMemoryUsage().getUsed())

    def max(self) -> int:
        """The heap's limit (``spark.driver.memory``)."""
        return int(self._memory.getHeapMemoryUsage().getMax())

    def reset_peak(self) -> None:
        """Collect garbage and start the pools' peaks from here."""
        self._memory.gc()
        for pool in self._pools:
            pool.resetPeakUsage()

    def peak(self) -> int:
        """The heap's peak use since :meth:`reset_peak` (the sum of its pools' peaks: an
        upper bound, as the pools need not peak at once)."""
        return sum(int(pool.getPeakUsage().getUsed()) for pool in self._pools)


@contextlib.contextmanager
def driver_peak(spark: Any) -> Iterator[dict[str, int]]:
    """Measure the driver's peak memory over the block: ``python`` (RSS), ``jvm_heap``
    (used), and their sum ``driver``; filled in when the block ends."""
    heap = JvmHeap(spark)
    heap.reset_peak()
    peaks: dict[str, int] = {}
    me = os.getpid()
    with PeakSampler(lambda: rss_bytes(me)) as python:
        yield peaks
    peaks["python"] = python.peak
    peaks["jvm_heap"] = heap.peak()
    peaks["driver"] = peaks["python"] + peaks["jvm_heap"]


class CpuMeter:
    """CPU seconds of the driver (this process and its children: the JVM and Spark's Python
    workers) and of redis-server, between :meth:`start` and :meth:`stop`."""

    def __init__(self, redis_pid: int | None = None) -> None:
        self.redis_pid = redis_pid
        self._began: dict[int, float] = {}
        self.seconds: dict[str, float] = {}

    def _now(self) -> dict[int, float]:
        pids = [os.getpid(), *descendants(os.getpid())]
        if self.redis_pid is not None:
            pids.append(self.redis_pid)
        used = {pid: cpu_seconds([pid]) for pid in pids}
        return {pid: s for pid, s in used.items() if s is not None}

    def start(self) -> None:
        """Count from now."""
        self._began = self._now()

    def stop(self) -> None:
        """Stop counting: ``seconds`` holds ``driver`` and ``redis`` CPU seconds."""
        now = self._now()
        driver = redis = 0.0
        for pid, seconds in now.items():
            spent = seconds - self._began.get(pid, 0.0)
            if pid == self.redis_pid:
                redis += spent
            else:
                driver += spent
        self.seconds = {"driver": driver}
        if self.redis_pid is not None:
            self.seconds["redis"] = redis
