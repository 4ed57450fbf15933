"""The retry journal's commit history, each commit info under its true version.

delta-rs' ``DeltaTable.history()`` lists the commit infos in the table's log as it
stands when called, but numbers them down from the version of the table object's
snapshot. A commit that lands after the snapshot was taken shifts every label by
one: the newest commit's info comes back under the version before it. The journal
finds its bases and a batch's commits by their commit info and then reads those
versions' rows, so a shifted label reads another commit's rows — a base read that
way restates nothing, and a rebuild from it would skip every message the base
holds. :func:`settled_history` refreshes the snapshot after listing and lists
again until no commit landed in between, so the labels are the log's.
"""

from __future__ import annotations

from typing import Any

from deltalake import DeltaTable

from idem.retry.errors import JournalError

SETTLE_ATTEMPTS = 20
"""Listings tried before giving up on a log that gains a commit during every one."""


def settled_history(table: DeltaTable, limit: int | None) -> list[dict[str, Any]]:
    """The newest ``limit`` commit infos (newest first, ``None``: all), each ``version``
    the one it was committed at; ``table`` is left at the newest version listed.

    Raises :class:`~idem.retry.errors.JournalError` when other writers commit during
    each of :data:`SETTLE_ATTEMPTS` listings in a row.
    """
    table.update_incremental()
    for _ in range(SETTLE_ATTEMPTS):
        version = table.version()
        history = table.history(limit)
        table.update_incremental()
        if table.version() == version:
            return history
    raise JournalError(
        f"retry journal {table.table_uri}: a commit landed during each of "
        f"{SETTLE_ATTEMPTS} reads of its history; try again"
    )
