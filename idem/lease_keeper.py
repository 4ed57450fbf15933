"""Keeping a claim's leases alive while the work it guards runs.

A claim holds its keys for ``lease_ms``; once the lease runs out another owner may
take a key and apply it a second time. Work slower than the lease (a sink writing a
large batch, a slow call) therefore renews its leases every ``lease_ms / 3`` until it
ends. A process that dies stops renewing, so its keys are free a lease later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from types import TracebackType

from idem.dedup import Dedup
from idem.keys import group_by_bucket

log = logging.getLogger(__name__)


class LeaseKeeper:
    """A context manager renewing ``owner``'s leases of ``keys`` while its block runs.

    ``keys=None``: every key ``owner`` claimed with ``track`` (see
    :meth:`~idem.hotstore.RedisHotStore.renew_tracked`), for a holder that does not
    know its keys (a Spark driver whose executors claimed them); leaving the block
    then also forgets that record. The renewal runs in a daemon thread; a failed
    renewal is logged and tried again at the next interval (the lease may still be
    live). Leaving the block stops it; the keys stay claimed until the caller
    completes or releases them.
    """

    def __init__(self, dedup: Dedup, keys: Sequence[str] | None, owner: str) -> None:
        hot = dedup.hot
        self._renew: Callable[[], object]
        self._untrack: Callable[[], None] | None = None
        if keys is None:
            self._renew = lambda: hot.renew_tracked(owner)
            self._untrack = lambda: hot.untrack(owner)
        else:
            by_bucket = group_by_bucket(keys, dedup.config.buckets)
            self._renew = lambda: hot.renew(by_bucket, owner)
        self._any = keys is None or bool(keys)
        self._owner = owner
        self._interval_s = dedup.config.lease_ms / 3000
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> LeaseKeeper:
        if self._any:
            self._thread = threading.Thread(
                target=self._run, daemon=True, name=f"idem-lease-{self._owner[-8:]}"
            )
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._untrack is not None:
            try:
                self._untrack()
            except Exception:  # the record runs out a lease later on its own
                log.warning("forgetting the keys of %s failed", self._owner, exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._renew()
            except Exception:
                log.warning("renewing the leases of %s failed", self._owner, exc_info=True)
