"""Dead-letter tooling: list, show, replay and discard rows of ``%DLQ%<group>``.

A replay sends the dead message back through the group's retry path (a new
delivery at delay level 1, ``reconsume_times`` reset, ``ORIGIN_MESSAGE_ID``
kept), so it reaches the sink through the dedup layer like any delivery: a
message whose key was completed within the dedup window (``dedup_window_ms``,
7 days by default; the whole ledger only in ``strict`` mode) is suppressed, not
applied twice. A key completed longer ago than that is applied again.
The DLQ row is then marked ``REPLAYED`` with when and by whom (``replayed_at``,
``replayed_by``: ``user@host`` unless ``--by`` names someone); the message
carries the same in ``IDEM_REPLAYED_BY``/``IDEM_REPLAYED_AT``. A discard
records who and when the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from pyspark.sql import Row

from idem import metrics
from idem.errors import ConfigError, LedgerError
from idem.ledger.schema import datetime_of_ms
from idem.retry.dlq import DeadLetter, DeadLetterStatus, current_user
from idem.retry.engine import RetryEngine
from idem.retry.message import MessageConst, MessageExt, new_msg_id
from idem.spark.messages import SCHEMA_PROPERTY
from idem.spark.rows import RowCodec
from idem.spark.stats import StatsStore

REPLAYED_BY_PROPERTY = MessageConst.PROPERTY_REPLAYED_BY
"""Message property: ``user@host`` that replayed the dead letter."""

REPLAYED_AT_PROPERTY = MessageConst.PROPERTY_REPLAYED_AT
"""Message property: when (epoch ms) the dead letter was replayed."""

REPLAY_LEVEL = 1
"""Replayed messages wait the first delay level before the job sees them."""

REPLAY_CHUNK = 500
"""Dead letters sent back per step of a long replay (one journal commit each)."""


@dataclass(frozen=True, slots=True)
class Selection:
    """Which dead letters a command acts on."""

    keys: tuple[str, ...] = ()
    msg_ids: tuple[str, ...] = ()
    everything: bool = False
    include_replayed: bool = False

    def __post_init__(self) -> None:
        if self.everything and (self.keys or self.msg_ids):
            raise ConfigError(
                "--all: selects every dead letter, so it cannot be combined with --key or "
                "--msg-id; name the rows, or pass --all alone"
            )

    def matches(self, letter: DeadLetter) -> bool:
        """Whether ``letter`` is selected."""
        if letter.status is DeadLetterStatus.DISCARDED:
            return False
        if letter.status is DeadLetterStatus.REPLAYED and not self.include_replayed:
            return False
        if self.everything:
            return True
        return (letter.key in self.keys) or bool(
            {letter.msg_id, letter.origin_msg_id} & set(self.msg_ids)
        )

    @property
    def empty(self) -> bool:
        """Nothing named and not ``everything``."""
        return not (self.keys or self.msg_ids or self.everything)

    def unknown(self, letters: Iterable[DeadLetter]) -> tuple[str, ...]:
        """The named keys and msg ids that no row of ``letters`` has, whatever its status
        (a typo must not read as "nothing to do")."""
        keys, ids = set(self.keys), set(self.msg_ids)
        for d in letters:
            if d.key is not None:  # as matches(): a null key is not the key "" (--msg-id finds it)
                keys.discard(d.key)
            ids.difference_update((d.msg_id, d.origin_msg_id))
        return tuple(k for k in self.keys if k in keys) + tuple(m for m in self.msg_ids if m in ids)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What a replay did."""

    selected: int
    sent: int
    dead_again: int
    marked: int
    skipped_replayed: int
    unknown: tuple[str, ...] = ()
    """Named keys / msg ids with no dead letter at all."""


@dataclass(frozen=True, slots=True)
class DiscardResult:
    """What a discard did."""

    marked: int
    unknown: tuple[str, ...] = ()
    """Named keys / msg ids with no dead letter at all."""


class Picked(NamedTuple):
    """The dead letters a selection picked."""

    letters: list[DeadLetter]
    """Oldest first."""
    left_out: int
    """Matching rows replayed before, left out (without ``include_replayed``)."""
    unknown: tuple[str, ...]
    """Named keys / msg ids with no dead letter at all."""


def who() -> str:
    """``user@host`` of this process."""
    return current_user()


def select(engine: RetryEngine, selection: Selection) -> Picked:
    """The selected dead letters, how many replayed ones were left out, and the names
    that match none."""
    letters = engine.dlq.list()
    chosen = [d for d in letters if selection.matches(d)]
    left_out = 0
    if not selection.include_replayed:
        named = Selection(
            keys=selection.keys,
            msg_ids=selection.msg_ids,
            everything=selection.everything,
            include_replayed=True,
        )
        left_out = sum(
            1 for d in letters if d.status is DeadLetterStatus.REPLAYED and named.matches(d)
        )
    chosen.sort(key=lambda d: (d.dead_at_ms, d.origin_msg_id))
    return Picked(chosen, left_out, selection.unknown(letters))


def replay_message(letter: DeadLetter, *, by: str, at_ms: int) -> MessageExt:
    """The message a replay sends: the dead one, ``reconsume_times`` reset, who/when stamped.

    A letter replayed before (and chosen again) is sent as a copy with an id of its own
    for that replay, so its resend is a message the first replay's chain never placed.
    """
    message = letter.to_message().evolve(reconsume_times=0)
    if letter.replayed_at_ms is not None:
        message = message.evolve(
            msg_id=new_msg_id(letter.group, f"{letter.msg_id}@{letter.replayed_at_ms}")
        )
    return message.with_properties(**{REPLAYED_BY_PROPERTY: by, REPLAYED_AT_PROPERTY: str(at_ms)})


def replay(
    engine: RetryEngine,
    selection: Selection,
    *,
    by: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Send the selected dead letters back through the retry path and mark them ``REPLAYED``."""
    letters, left_out, unknown = select(engine, selection)
    by = by or who()
    sent = dead = marked = 0
    total = len(letters)
    for start in range(0, total, REPLAY_CHUNK):
        chunk = letters[start : start + REPLAY_CHUNK]
        now = engine.clock.now_ms()
        messages = [replay_message(d, by=by, at_ms=now) for d in chunk]
        result = engine.send_back(
            messages,
            delay_level=REPLAY_LEVEL,
            errors={m.msg_id: f"replayed from the DLQ by {by}" for m in messages},
        )
        sent += len(result.scheduled) + len(result.fallback)
        dead += len(result.dead)
        if not result.acknowledged:
            raise LedgerError(
                f"replay: {len(result.resubmit)} message(s) could not be stored; run it again"
            )
        # A letter the policy dead-letters again at once stays DEAD: it was not replayed.
        again = {(o.origin_msg_id, o.msg_id) for o in result.dead}
        left = [
            d
            for d, m in zip(chunk, messages, strict=True)
            if (m.origin_msg_id, m.msg_id) not in again
        ]
        marked += engine.dlq.mark_replayed(left, at_ms=now, by=by)
        StatsStore(engine.client, engine.group, marker_ttl_ms=engine.config.dedup_window_ms).add(
            "dlq_replayed", len(left)
        )
        metrics.count("replays", engine.group, len(left), kind="dlq")
        if progress is not None:
            progress(min(start + len(chunk), total), total)
    return ReplayResult(
        selected=total,
        sent=sent,
        dead_again=dead,
        marked=marked,
        skipped_replayed=left_out,
        unknown=unknown,
    )


def discard(engine: RetryEngine, selection: Selection, *, by: str | None = None) -> DiscardResult:
    """Mark the selected dead letters ``DISCARDED`` (by ``by``, default ``user@host``)."""
    letters, _, unknown = select(engine, selection)
    return DiscardResult(engine.dlq.mark_discarded(letters, by=by or who()), unknown)


def decoded_body(letter: DeadLetter) -> dict[str, Any] | None:
    """The row in the body, decoded with the schema it carries (``None`` if it has none)."""
    schema = letter.properties.get(SCHEMA_PROPERTY)
    if not schema:
        return None
    try:
        return RowCodec.from_schema_json(schema).decode_dict(letter.body)
    except Exception:  # a foreign or damaged body: show the raw bytes instead
        return None


def table_rows(letters: Sequence[DeadLetter]) -> list[tuple[str, str, int, str, str, str]]:
    """``idem dlq ls`` rows: dead at (UTC), status, times, key, origin msg id, last error."""
    return [
        (
            datetime_of_ms(d.dead_at_ms).strftime("%Y-%m-%d %H:%M:%S"),
            d.status.value,
            d.reconsume_times,
            d.key or "∅",
            d.origin_msg_id,
            (d.last_error or d.reason or "")[:80],
        )
        for d in letters
    ]


def describe(letter: DeadLetter) -> dict[str, Any]:
    """``idem dlq show``: everything about one dead letter, body decoded when possible."""
    body = decoded_body(letter)
    return {
        "group": letter.group,
        "topic": letter.topic,
        "key": letter.key,
        "msg_id": letter.msg_id,
        "origin_msg_id": letter.origin_msg_id,
        "status": letter.status.value,
        "reason": letter.reason,
        "reconsume_times": letter.reconsume_times,
        "first_failed_at_ms": letter.first_failed_at_ms,
        "dead_at_ms": letter.dead_at_ms,
        "replayed_at_ms": letter.replayed_at_ms,
        "replayed_by": letter.replayed_by,
        "last_error": letter.last_error,
        "errors": [{"at_ms": e.at_ms, "type": e.type, "message": e.message} for e in letter.errors],
        "row": None if body is None else _json_safe(body),
        "body": None if body is not None else letter.body.decode("utf-8", "replace"),
        "properties": {k: v for k, v in letter.properties.items() if k != SCHEMA_PROPERTY},
    }


def _json_safe(value: Any) -> Any:
    """``value`` as JSON takes it: a struct (``Row``) with its field names, map keys as
    text (a map keyed by binary or dates made ``dlq show`` fail), bytes as text."""
    if isinstance(value, Row):
        return {k: _json_safe(v) for k, v in value.asDict().items()}
    if isinstance(value, dict):
        return {
            k if isinstance(k, str) else str(_json_safe(k)): _json_safe(v) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "backslashreplace")
    return value
