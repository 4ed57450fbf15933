"""Matchers of idem's Redis operations, for :meth:`proxy.FaultProxy.arm`.

Each Lua script is recognised by the SHA1 its ``EVALSHA`` carries, computed from
the very script objects idem registers (no server is contacted to build them).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

import redis
from proxy import Matcher

from idem.hotstore import _load_script as idem_script
from idem.retry.consumer.offset_store import offsets_script
from idem.retry.consumer.rebalance import load_script as consumer_script
from idem.retry.store import load_script as retry_script


class Op(StrEnum):
    """The operations of a consumer with the dedup hook that a fault is aimed at."""

    CLAIM = "claim"
    """The dedup hook claims a call's keys (``claim.lua``)."""
    COMPLETE = "complete"
    """A group commit marks its keys COMPLETED in Redis after the ledger commit
    (``complete.lua``)."""
    SEND_BACK = "send-back"
    """A failed or busy message is scheduled for redelivery (``apply.lua``)."""
    OFFSET_PERSIST = "offset-persist"
    """The consumer writes its queues' offsets (``persist_offsets.lua``)."""
    COMMIT_LOCK = "commit-lock"
    """A group commit takes the group's ledger-commit lock (``SET NX``)."""
    COMMIT_UNLOCK = "commit-unlock"
    """A group commit gives the lock back (``unlock.lua``)."""


def _sha(script: object) -> bytes:
    sha: str = script.sha  # type: ignore[attr-defined]
    return sha.encode()


def _shas() -> dict[Op, set[bytes]]:
    client = redis.Redis()  # never connects: register_script only hashes the source
    try:
        return {
            Op.CLAIM: {_sha(idem_script(client, "claim.lua"))},
            Op.COMPLETE: {_sha(idem_script(client, "complete.lua"))},
            Op.SEND_BACK: {_sha(retry_script(client, "apply.lua"))},
            Op.OFFSET_PERSIST: {_sha(offsets_script(client, "persist_offsets.lua"))},
            Op.COMMIT_LOCK: set(),
            Op.COMMIT_UNLOCK: {_sha(consumer_script(client, "unlock.lua"))},
        }
    finally:
        client.close()


_SHAS = _shas()


def matcher(op: Op) -> Matcher:
    """Whether a request is ``op``."""
    shas = _SHAS[op]

    def match(args: Sequence[bytes]) -> bool:
        if not args:
            return False
        name = args[0].upper()
        if name in (b"EVALSHA", b"EVALSHA_RO") and len(args) > 1:
            return args[1].lower() in shas
        if op is Op.COMMIT_LOCK and name == b"SET" and len(args) > 1:
            return args[1].startswith(b"rmq:lock:") and args[1].endswith(b":ledger-commit")
        return False

    match.__name__ = f"match_{op.name.lower()}"
    return match
