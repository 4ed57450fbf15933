"""The process queue: a queue's in-flight messages, ordered by offset (``ProcessQueue``).

The committed offset of a queue is the smallest offset still in flight, or the
largest offset ever put plus one when nothing is (``removeMessage``): a slow
message holds the offset back, and a crash redelivers everything after it —
RocketMQ's design, and a redelivery case the dedup layer absorbs.

Flow control reads three numbers here: cached message count, cached size and
the offset span between the first and the last cached message. An orderly
consumer also keeps the messages it is consuming apart until they commit
(``consumingMsgOrderlyTreeMap``).

A consumed message whose acknowledgement waits for something durable (idem's
group-committed ledger) is *awaiting*: no longer cached (it neither counts for
flow control nor is consumed or expired again), but its offset still holds the
committed offset back until it is settled.
"""

from __future__ import annotations

import bisect
import contextlib
import heapq
import threading
from collections.abc import Iterable, Iterator, Sequence

from idem.retry.consumer.topics import MessageQueue
from idem.retry.message import MessageExt

REBALANCE_LOCK_MAX_LIVE_TIME_MS = 30_000
"""How long a client trusts an orderly queue lock it has not renewed."""


def message_size(message: MessageExt) -> int:
    """The bytes a message counts for in flow control (its body)."""
    return len(message.body)


class ProcessQueue:
    """In-flight messages of one :class:`MessageQueue` (thread-safe)."""

    def __init__(self, mq: MessageQueue, next_offset: int = 0) -> None:
        self.mq = mq
        self.next_offset = next_offset
        """Where the next pull of this queue starts (``PullRequest.nextOffset``)."""
        self.last_pulled: tuple[int, str] | None = None
        """Offset and msg id of the newest message pulled: a queue that no longer holds
        that message there was rebuilt under this consumer (Redis lost data)."""
        self._lock = threading.RLock()
        self._offsets: list[int] = []
        self._messages: dict[int, MessageExt] = {}
        self._started: dict[int, int] = {}
        self._consuming: dict[int, MessageExt] = {}
        self._awaiting: dict[int, str] = {}
        self._awaiting_heap: list[int] = []
        """Offsets of awaiting messages, a min-heap; settled ones are dropped lazily when
        they reach the top (settling thousands one by one must not shift a list each)."""
        self._sending: set[int] = set()
        """Offsets of cached messages one path is sending back now (a consume result, the
        consume timeout): the other path leaves them alone (:meth:`take_for_send_back`)."""
        self._size = 0
        self.queue_offset_max = -1
        self._dropped = False
        self.locked = False
        """Orderly: this client holds the queue's lock."""
        self.last_lock_ms = 0
        self.previously_locked = False
        self.consume_lock = threading.Lock()
        """Orderly: one consume request of this queue at a time, and not while it is removed."""
        self.consuming = False
        """Orderly: a consume request of this queue is scheduled or running."""
        self.take_over_deliveries = False
        """``%RETRY%<group>``: first take over what a previous owner read and did not ack."""

    @property
    def dropped(self) -> bool:
        """Set when the queue was taken away (rebalance, reset): results are not committed."""
        return self._dropped

    @dropped.setter
    def dropped(self, value: bool) -> None:
        with self._lock:  # waits for an offset commit in progress (:meth:`unless_dropped`)
            self._dropped = value

    @contextlib.contextmanager
    def unless_dropped(self) -> Iterator[bool]:
        """Hold the queue while committing an offset for it; yields whether it is still
        assigned. A drop waits for the block to end, so no offset of the old queue
        lands after a reset moved the queue's offset."""
        with self._lock:
            yield not self._dropped

    # -- counts --------------------------------------------------------------------------

    @property
    def msg_count(self) -> int:
        """Cached messages (in flight, including those an orderly consumer is consuming)."""
        with self._lock:
            return len(self._messages) + len(self._consuming)

    @property
    def msg_size(self) -> int:
        """Cached bytes."""
        with self._lock:
            return self._size

    def max_span(self) -> int:
        """Offset span between the first and the last cached message (0 when empty)."""
        with self._lock:
            return self._offsets[-1] - self._offsets[0] if self._offsets else 0

    @property
    def awaiting_count(self) -> int:
        """Consumed messages whose acknowledgement is not final yet."""
        with self._lock:
            return len(self._awaiting)

    def first_offset(self) -> int | None:
        """The smallest offset in flight — cached, being consumed by an orderly consumer,
        or awaiting — (``None``: none)."""
        with self._lock:
            heap, awaiting = self._awaiting_heap, self._awaiting
            while heap and heap[0] not in awaiting:
                heapq.heappop(heap)
            firsts = [o[0] for o in (self._offsets, heap) if o]
            if self._consuming:
                firsts.append(min(self._consuming))
            return min(firsts) if firsts else None

    def _commit_offset(self) -> int:
        first = self.first_offset()
        return first if first is not None else self.queue_offset_max + 1

    def snapshot(self) -> list[MessageExt]:
        """The cached messages in offset order (a copy)."""
        with self._lock:
            return [self._messages[o] for o in self._offsets]

    # -- concurrently --------------------------------------------------------------------

    def put_messages(self, messages: Iterable[MessageExt]) -> list[MessageExt]:
        """Cache pulled messages; returns those that were new (an offset already cached is not)."""
        added: list[MessageExt] = []
        with self._lock:
            for message in messages:
                offset = message.queue_offset
                if (
                    offset in self._messages
                    or offset in self._consuming
                    or offset in self._awaiting
                ):
                    continue
                bisect.insort(self._offsets, offset)
                self._messages[offset] = message
                self._size += message_size(message)
                self.queue_offset_max = max(self.queue_offset_max, offset)
                added.append(message)
        return added

    def remove_messages(self, messages: Iterable[MessageExt]) -> int:
        """Remove consumed messages; returns the offset to commit (``-1``: nothing was cached)."""
        with self._lock:
            if not self._messages:
                return -1
            self._uncache(messages)
            return self._commit_offset()

    def _uncache(self, messages: Iterable[MessageExt]) -> list[MessageExt]:
        removed: list[MessageExt] = []
        for message in messages:
            offset = message.queue_offset
            cached = self._messages.get(offset)
            if cached is None or cached.msg_id != message.msg_id:
                continue
            del self._messages[offset]
            self._started.pop(offset, None)
            self._sending.discard(offset)
            del self._offsets[bisect.bisect_left(self._offsets, offset)]
            self._size -= message_size(cached)
            removed.append(cached)
        return removed

    # -- acknowledgements that wait for something durable ------------------------------

    def defer(self, messages: Iterable[MessageExt]) -> int:
        """Move consumed ``messages`` from the cache to *awaiting*; returns how many moved.

        They stop counting for flow control and the consume timeout, but keep the
        committed offset from passing them until :meth:`settle`.
        """
        with self._lock:
            moved = self._uncache(messages)
            for message in moved:
                offset = message.queue_offset
                if offset not in self._awaiting:
                    heapq.heappush(self._awaiting_heap, offset)
                self._awaiting[offset] = message.msg_id
            return len(moved)

    def settle(self, messages: Iterable[MessageExt]) -> int:
        """Forget awaiting ``messages``; returns the offset to commit (``-1``: none of them
        was awaiting here, e.g. the queue was cleared)."""
        with self._lock:
            settled = False
            for message in messages:
                settled = self._take_awaiting(message) or settled
            return self._commit_offset() if settled else -1

    def _take_awaiting(self, message: MessageExt) -> bool:
        """Remove ``message`` from the awaiting set (lock held); whether it was there."""
        offset = message.queue_offset
        if self._awaiting.get(offset) != message.msg_id:
            return False
        del self._awaiting[offset]  # its heap entry goes when it reaches the top
        return True

    def restore(self, messages: Iterable[MessageExt]) -> list[MessageExt]:
        """Put awaiting ``messages`` back in the cache (their acknowledgement failed); returns
        those that were awaiting."""
        back: list[MessageExt] = []
        with self._lock:
            for message in messages:
                if not self._take_awaiting(message):
                    continue
                offset = message.queue_offset
                bisect.insort(self._offsets, offset)
                self._messages[offset] = message
                self._size += message_size(message)
                back.append(message)
        return back

    def contains(self, message: MessageExt) -> bool:
        """Whether ``message`` is still cached (not consumed, expired or dropped)."""
        with self._lock:
            cached = self._messages.get(message.queue_offset)
            return cached is not None and cached.msg_id == message.msg_id

    def take_for_send_back(self, messages: Iterable[MessageExt]) -> list[MessageExt]:
        """Of ``messages``, those still cached and not being sent back already; they are
        this caller's to send back until removed or given back (:meth:`release_send_back`).

        A stuck message's consume timeout and its listener's late failure would each send
        it back: two copies on the retry ladder, and the listener runs for both.
        """
        with self._lock:
            taken: list[MessageExt] = []
            for message in messages:
                offset = message.queue_offset
                cached = self._messages.get(offset)
                if cached is None or cached.msg_id != message.msg_id or offset in self._sending:
                    continue
                self._sending.add(offset)
                taken.append(message)
            return taken

    def stand_in(self, pairs: Iterable[tuple[MessageExt, MessageExt]]) -> list[MessageExt]:
        """Put each ``(cached, replacement)``'s replacement in place of the cached message at
        the same offset (the journaled resend consumed locally in its place); returns the
        replacements put in. A pair whose message left the cache meanwhile is skipped."""
        put: list[MessageExt] = []
        with self._lock:
            for cached, replacement in pairs:
                offset = cached.queue_offset
                current = self._messages.get(offset)
                if (
                    current is None
                    or current.msg_id != cached.msg_id
                    or replacement.queue_offset != offset
                ):
                    continue
                self._messages[offset] = replacement
                self._size += message_size(replacement) - message_size(current)
                put.append(replacement)
        return put

    def release_send_back(self, messages: Iterable[MessageExt]) -> None:
        """Give back messages taken with :meth:`take_for_send_back` that stay cached (their
        send-back could not place them)."""
        with self._lock:
            for message in messages:
                self._sending.discard(message.queue_offset)

    # -- consume timeout -----------------------------------------------------------------

    def mark_consume_start(self, messages: Sequence[MessageExt], now_ms: int) -> None:
        """Record when consumption of ``messages`` began (``CONSUME_START_TIME``)."""
        with self._lock:
            for message in messages:
                if self.contains(message):
                    self._started[message.queue_offset] = now_ms

    def consume_started_ms(self, message: MessageExt) -> int | None:
        """When consumption of ``message`` began (``None``: not started or not cached)."""
        with self._lock:
            if not self.contains(message):
                return None
            return self._started.get(message.queue_offset)

    def earliest_start(self) -> int | None:
        """The earliest consume start among cached messages (``None``: none started)."""
        with self._lock:
            return min(self._started.values()) if self._started else None

    def expired(self, now_ms: int, timeout_ms: int) -> list[MessageExt]:
        """Cached messages consumed for at least ``timeout_ms``, in offset order."""
        with self._lock:
            limit = now_ms - timeout_ms
            return [
                self._messages[o]
                for o in sorted(o for o, at in self._started.items() if at <= limit)
                if o in self._messages
            ]

    def take_expired(self, now_ms: int, timeout_ms: int) -> list[tuple[MessageExt, int]]:
        """Like :meth:`expired`, with each consume start, and forget those starts.

        A message taken is not returned again while it is being sent back; give
        it back with :meth:`mark_consume_start` if the send-back fails.
        """
        with self._lock:
            limit = now_ms - timeout_ms
            out = []
            for offset in sorted(o for o, at in self._started.items() if at <= limit):
                started = self._started.pop(offset)
                if offset in self._messages:
                    out.append((self._messages[offset], started))
            return out

    # -- orderly -------------------------------------------------------------------------

    def dispatch_to_consume(self) -> bool:
        """Orderly: whether a consume request must be started (none is, and messages wait)."""
        with self._lock:
            if self._offsets and not self.consuming:
                self.consuming = True
                return True
            return False

    def take_messages(self, batch_size: int) -> list[MessageExt]:
        """Move up to ``batch_size`` first messages into the consuming set (``takeMessages``).

        Taking nothing ends the running consume request (``consuming`` is cleared).
        """
        with self._lock:
            if not self._offsets:
                self.consuming = False
                return []
            taken = self._offsets[:batch_size]
            del self._offsets[:batch_size]
            out = []
            for offset in taken:
                message = self._messages.pop(offset)
                self._consuming[offset] = message
                out.append(message)
            return out

    def commit(self) -> int:
        """Forget the consuming set; returns the offset after it (``-1``: it was empty)."""
        with self._lock:
            if not self._consuming:
                return -1
            offset = max(self._consuming) + 1
            self._size -= sum(message_size(m) for m in self._consuming.values())
            self._consuming.clear()
            return offset

    def make_message_to_consume_again(self, messages: Sequence[MessageExt]) -> None:
        """Put consuming messages back in front, as given (e.g. ``reconsume_times`` + 1)."""
        with self._lock:
            for message in messages:
                offset = message.queue_offset
                if self._consuming.pop(offset, None) is None:
                    continue
                bisect.insort(self._offsets, offset)
                self._messages[offset] = message

    def is_lock_expired(
        self, now_ms: int, max_live_ms: int = REBALANCE_LOCK_MAX_LIVE_TIME_MS
    ) -> bool:
        """Whether this client's lock was last confirmed more than ``max_live_ms`` ago."""
        return now_ms - self.last_lock_ms > max_live_ms

    def clear(self) -> None:
        """Forget everything cached (the queue was dropped)."""
        with self._lock:
            self._offsets.clear()
            self._messages.clear()
            self._started.clear()
            self._consuming.clear()
            self._awaiting.clear()
            self._awaiting_heap.clear()
            self._sending.clear()
            self._size = 0

    def __repr__(self) -> str:
        return (
            f"ProcessQueue({self.mq}, cached={self.msg_count}, "
            f"awaiting={self.awaiting_count}, next={self.next_offset}, "
            f"dropped={self.dropped})"
        )
