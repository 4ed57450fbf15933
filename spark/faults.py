"""Crash points inside a micro-batch, for the driver-crash tests (C10) and the executors.

``IDEM_SPARK_KILL_AT="after_sink@3,after_commit@5"`` makes the driver kill
itself with SIGKILL when batch 3 reaches the point after the sink ran, or batch
5 the point after the commit; ``after_sink`` without ``@`` fires on the first
batch that gets there. Nothing happens unless the variable is set; the
restarted job runs without it. A SIGKILL leaves no chance to clean up, which
is the point: a driver that dies between two steps of a batch, at a chosen moment.

:class:`TaskFault` stages the same on an executor: a claim task that fails, whose
Python worker is killed mid-claim, or that straggles, in its first attempt only.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

KILL_AT_ENV = "IDEM_SPARK_KILL_AT"


class CrashPoint(StrEnum):
    """The moments of a batch at which a driver crash leaves a different state behind."""

    BEFORE_CLAIM = "before_claim"
    AFTER_CLAIM = "after_claim"
    AFTER_SINK = "after_sink"
    AFTER_COMMIT = "after_commit"
    AFTER_SEND_BACK = "after_send_back"
    AFTER_RECORD = "after_record"
    """After the batch's counters are recorded, before its retry rows are acknowledged."""
    AFTER_ACK = "after_ack"
    """After the batch's retry rows are acknowledged (removed from the retry topic)."""
    AFTER_BATCH = "after_batch"
    """After everything of the batch, before Spark writes its commit log entry."""


class BatchObserver(Protocol):
    """Something told when a micro-batch reaches each :class:`CrashPoint`.

    Called on the driver, between two steps of a batch, with nothing of the batch
    held open; it may raise (the batch fails and Spark replays it) or end the
    process, and must not touch the batch's rows or Redis.
    """

    def reached(self, point: CrashPoint, batch_id: int) -> None:
        """Batch ``batch_id`` got to ``point``."""


class SimulatedCrash(RuntimeError):
    """A driver failure staged by a :class:`CrashPlan` (the query stops; a restart replays)."""


@dataclass
class CrashPlan:
    """Fail the batch ``batch_id`` once at ``point``, in-process (the demo shows a replay)."""

    point: CrashPoint
    batch_id: int
    fired: bool = False

    def reached(self, point: CrashPoint, batch_id: int) -> None:
        """Raise :class:`SimulatedCrash` the first time ``point`` is reached in ``batch_id``."""
        if not self.fired and point is self.point and batch_id == self.batch_id:
            self.fired = True
            raise SimulatedCrash(f"simulated driver crash at {point.value} of batch {batch_id}")


@dataclass(frozen=True)
class KillAt:
    """SIGKILL this process when a batch reaches one of ``points`` (see the module)."""

    points: tuple[tuple[str, int | None], ...]

    @classmethod
    def from_env(cls) -> KillAt | None:
        """The plan ``IDEM_SPARK_KILL_AT`` asks for (``None``: the variable is not set)."""
        spec = os.environ.get(KILL_AT_ENV, "").strip()
        points: list[tuple[str, int | None]] = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            point, _, batch = part.partition("@")
            points.append((point, int(batch) if batch else None))
        return cls(tuple(points)) if points else None

    def reached(self, point: CrashPoint, batch_id: int) -> None:
        """SIGKILL this process if ``point`` of ``batch_id`` is one of the plan's."""
        for wanted, batch in self.points:
            if wanted == point.value and (batch is None or batch == batch_id):
                print(
                    f"idem: crash point {point.value} at batch {batch_id}: SIGKILL", file=sys.stderr
                )
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)


class TaskFaultPoint(StrEnum):
    """Moments of an executor's claim task at which a staged fault fires."""

    CLAIMS_SENT = "claims_sent"
    """The task's first claims are sent to Redis, their replies not read yet (mid-claim)."""
    CLAIMED = "claimed"
    """Every row's verdict is known and claimed; the last rows are not handed back to
    Spark yet."""


class TaskFaultAction(StrEnum):
    """What a staged fault does to the task."""

    RAISE = "raise"
    """The task fails with :class:`SimulatedTaskFailure`; Spark retries it."""
    KILL = "kill"
    """The Python worker running the task kills itself with SIGKILL."""
    STALL = "stall"
    """The task sleeps for ``stall_s`` (a straggler: Spark may start a speculative copy)."""


class SimulatedTaskFailure(RuntimeError):
    """An executor task failure staged by a :class:`TaskFault`."""


@dataclass(frozen=True)
class TaskFault:
    """A fault staged in the first attempt of claim tasks.

    Shipped to the executors with the task; it fires only in attempt 0 of the
    task for ``partition`` (``None``: of every task that has rows), so Spark's
    retry (or speculative copy) runs clean.
    """

    point: TaskFaultPoint
    action: TaskFaultAction
    partition: int | None = None
    stall_s: float = 0.0

    def fire(self, point: TaskFaultPoint) -> None:
        """Act if this is the staged point of the staged task's first attempt."""
        from pyspark import TaskContext  # noqa: PLC0415 -- runs on an executor

        context = TaskContext.get()
        if point is not self.point or context is None:
            return
        if context.attemptNumber() != 0:
            return
        if self.partition is not None and context.partitionId() != self.partition:
            return
        if self.action is TaskFaultAction.RAISE:
            raise SimulatedTaskFailure(f"simulated task failure at {point.value}")
        if self.action is TaskFaultAction.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.stall_s)
