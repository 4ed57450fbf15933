"""Errors of the retry engine, under idem's one root (:class:`idem.errors.IdemError`)."""

from __future__ import annotations

from idem.errors import LedgerError


class JournalError(LedgerError):
    """The Delta retry journal could not be read or written (after bounded retries)."""


class DeadLetterError(LedgerError):
    """The ``%DLQ%<group>`` Delta table could not be read or written (after bounded retries)."""
