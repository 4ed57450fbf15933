"""idem: exactly-once sinks on at-least-once delivery.

Business-key claims in Redis (hot), a Delta Lake ledger (durable), RocketMQ's
resend path in :mod:`idem.retry`, PySpark glue in :mod:`idem.spark` (which needs
PySpark; nothing else here does).

For plain Python: :func:`idempotent` (a decorator) and :class:`Dedup` (the claims and
the ledger under it), configured by :class:`IdemConfig`. A clock for tests
(:class:`idem.clock.ManualClock`) lives in its module.
"""

from idem.clock import Clock, SystemClock
from idem.config import DedupMode, IdemConfig, MismatchPolicy
from idem.dedup import Dedup
from idem.delay_levels import DEFAULT_DELAY_LEVELS, DelayLevels
from idem.errors import (
    ConfigError,
    IdemError,
    IndexUnsettled,
    InvalidKey,
    KeyBusy,
    LedgerConflict,
    LedgerError,
    PayloadMismatch,
    SerializationError,
    StoreUnavailable,
    UnsafeRedisConfig,
)
from idem.idempotent import idempotent
from idem.indexer import IndexStats
from idem.outcome import BatchClaim, BatchCounts, CommitOutcome, DuplicateCause, Invalid

__all__ = [
    "DEFAULT_DELAY_LEVELS",
    "BatchClaim",
    "BatchCounts",
    "Clock",
    "CommitOutcome",
    "ConfigError",
    "Dedup",
    "DedupMode",
    "DelayLevels",
    "DuplicateCause",
    "IdemConfig",
    "IdemError",
    "IndexUnsettled",
    "IndexStats",
    "Invalid",
    "InvalidKey",
    "KeyBusy",
    "LedgerConflict",
    "LedgerError",
    "MismatchPolicy",
    "PayloadMismatch",
    "SerializationError",
    "StoreUnavailable",
    "SystemClock",
    "UnsafeRedisConfig",
    "idempotent",
]

__version__ = "0.1.0"
"""The release; the one place it is set (the package metadata reads it from here)."""
