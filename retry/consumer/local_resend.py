"""Journaled resends a consumer consumes locally, and the retry-topic copies they make extra.

When a send-back could not reach Redis but the retry journal took the message, the
engine hands back the journaled resend (:attr:`SendBackOutcome.resend`) and the
consumer re-submits *that* locally after 5 s, in the failed message's place. The
journal will also deliver it from ``%RETRY%<group>`` once Redis is back: one retry
chain, two copies with one msg id. This registry lets the consumer keep one:

- the local copy, consumed, is acknowledged in the journal (which removes the
  retry topic's copy) and remembered as *done*;
- a retry-topic copy of a done one is acknowledged and not consumed;
- a retry-topic copy of one still being consumed locally is left pending (not
  consumed now): the local outcome acknowledges or replaces it, and if this
  process dies first, the retry topic hands it out again after the consume timeout.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from idem.retry.consumer.process_queue import ProcessQueue
from idem.retry.message import MessageExt

DONE_REMEMBERED = 100_000
"""How many consumed local resends are remembered (oldest forgotten first)."""


@dataclass(frozen=True, slots=True)
class _InFlight:
    pq: ProcessQueue
    message: MessageExt

    def is_at(self, pq: ProcessQueue, offset: int) -> bool:
        """Whether ``pq``'s message at ``offset`` is this local resend's place."""
        return pq is self.pq and offset == self.message.queue_offset

    def alive(self) -> bool:
        """Whether the local resend is still to be consumed (its queue kept, it cached)."""
        return not self.pq.dropped and self.pq.contains(self.message)


class LocalResends:
    """The journaled resends this consumer consumes locally, by msg id (thread-safe)."""

    def __init__(self, remembered: int = DONE_REMEMBERED) -> None:
        self._lock = threading.Lock()
        self._in_flight: dict[str, _InFlight] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self._remembered = remembered

    def add(self, pq: ProcessQueue, messages: Iterable[MessageExt]) -> None:
        """``messages`` (resends) are re-submitted locally on ``pq``."""
        with self._lock:
            for message in messages:
                self._in_flight[message.msg_id] = _InFlight(pq, message)

    def is_local(self, message: MessageExt) -> bool:
        """Whether ``message`` is a local resend in flight (to acknowledge when consumed)."""
        with self._lock:
            return message.msg_id in self._in_flight

    def consumed(self, messages: Iterable[MessageExt]) -> None:
        """Local resends consumed (and acknowledged): a later retry-topic copy is done."""
        with self._lock:
            for message in messages:
                if self._in_flight.pop(message.msg_id, None) is None:
                    continue
                self._done[message.msg_id] = None
                while len(self._done) > self._remembered:
                    self._done.popitem(last=False)

    def forget(self, messages: Iterable[MessageExt]) -> None:
        """Local resends sent back again: their journaled copy is replaced by the next one."""
        with self._lock:
            for message in messages:
                self._in_flight.pop(message.msg_id, None)

    def sort_retried(
        self, pq: ProcessQueue, messages: Iterable[MessageExt]
    ) -> tuple[list[MessageExt], list[MessageExt], list[MessageExt]]:
        """Split messages of the retry topic submitted on ``pq`` into (to consume, copies of
        consumed local resends: acknowledge, not consume; copies of ones being consumed
        locally: leave pending). A local resend itself (re-submitted on the retry topic's
        own process queue, at the offset of the message it replaced) is consumed."""
        consume: list[MessageExt] = []
        done: list[MessageExt] = []
        wait: list[MessageExt] = []
        with self._lock:
            for message in messages:
                local = self._in_flight.get(message.msg_id)
                if local is not None and local.is_at(pq, message.queue_offset):
                    consume.append(message)
                elif message.msg_id in self._done:
                    done.append(message)
                elif local is not None and local.alive():
                    wait.append(message)
                else:
                    consume.append(message)
        return consume, done, wait
