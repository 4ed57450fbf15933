"""``idem console``: a small web console over one consumer group.

It reads what the command line reads — the ``%DLQ%<group>`` table, the retry
engine's Redis side, the batch counters, the Redis index against the ledger — and
keeps no store of its own. Pages are rendered on the server; actions (replay,
discard) are POSTs that need the console's token. See :mod:`idem.console.server`.
"""
