"""The exceptions idem raises: one root, one class per meaning.

The user's own exceptions pass through idem untouched; failures of the
infrastructure (Redis, Delta) are wrapped with ``raise ... from exc`` so the
cause stays visible.
"""

from __future__ import annotations


class IdemError(Exception):
    """Root of every error idem raises."""


class ConfigError(IdemError, ValueError):
    """A setting is missing or out of range; the message names it and the limit."""


class InvalidKey(IdemError, ValueError):
    """A business key is null, empty, not text, or longer than the limit.

    ``field`` names where the key came from, ``reason`` is a short machine
    readable cause (``null``, ``empty``, ``not_text``, ``too_long``,
    ``undecodable``) that also ends up in the DLQ row.
    """

    def __init__(self, message: str, *, field: str, reason: str) -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason


class PayloadMismatch(IdemError):
    """A key was seen again with a different payload fingerprint."""

    def __init__(self, key: str, *, stored: str, seen: str) -> None:
        super().__init__(
            f"key {key!r} was completed with payload fingerprint {stored[:12]}… "
            f"but arrived again with {seen[:12]}…"
        )
        self.key = key
        self.stored = stored
        self.seen = seen


class KeyBusy(IdemError):
    """Another owner holds an unexpired claim on the key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r} is being processed by another owner")
        self.key = key


class StoreUnavailable(IdemError):
    """Redis could not be reached or answered with an error (outcome unknown)."""


class IndexUnsettled(StoreUnavailable):
    """A claim found its buckets' Redis index behind the ledger again after every catch-up
    (Redis restarting or failing over in a loop); what the claim took was given back."""


class UnsafeRedisConfig(IdemError):
    """Redis is configured so that it may drop keys silently (eviction)."""


class LedgerError(IdemError):
    """The Delta ledger could not be read or written."""


class LedgerConflict(LedgerError):
    """A ledger commit kept conflicting with concurrent writers after bounded retries."""


class SerializationError(IdemError):
    """A value could not be encoded as JSON (idem never pickles)."""
