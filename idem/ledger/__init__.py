"""The durable Delta ledger of the dedup layer: one row per completed key."""

from idem.ledger._sql import read_table
from idem.ledger.base import (
    ChangedKeys,
    CommitResult,
    CompactResult,
    Ledger,
    LedgerWindow,
    open_ledger,
    spark_delta_session,
)
from idem.ledger.deltars import DeltaLedger
from idem.ledger.schema import INDEX_SCHEMA, LEDGER_SCHEMA, PARTITION_COLUMNS, conform, make_rows

__all__ = [
    "INDEX_SCHEMA",
    "LEDGER_SCHEMA",
    "PARTITION_COLUMNS",
    "ChangedKeys",
    "CommitResult",
    "CompactResult",
    "DeltaLedger",
    "Ledger",
    "LedgerWindow",
    "conform",
    "make_rows",
    "open_ledger",
    "read_table",
    "spark_delta_session",
]
