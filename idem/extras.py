"""The optional parts of idem and the command that installs each.

The core (``@idempotent``, :class:`~idem.dedup.Dedup`, :mod:`idem.retry`, the push
consumer, the ledger and index commands) needs no PySpark. The Spark glue
(:mod:`idem.spark`; ``idem run``, ``idem demo``, ``idem dlq``) needs the ``spark``
extra or the PySpark a Spark cluster provides; ``idem demo`` also needs a Redis it
can start (``redis-server``, or the in-process server of the ``demo`` extra).
"""

from __future__ import annotations

DISTRIBUTION = "idem-exactly-once"
"""The name idem is installed by (``pip install idem-exactly-once``); it imports as ``idem``."""


def install_hint(extra: str) -> str:
    """The pip command that adds ``extra`` (``spark``, ``spark-delta``, ``demo``, ...)."""
    return f"pip install '{DISTRIBUTION}[{extra}]'"
