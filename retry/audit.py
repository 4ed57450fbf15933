"""The resend path's invariant: every message is in exactly one of done / retrying / dead.

*done* is what the consumer completed (the caller knows: its sink or the dedup
ledger); *retrying* is what Redis holds scheduled or in ``%RETRY%<group>`` — and
the journal must agree; *dead* is what ``%DLQ%<group>`` holds. A message in none
is lost; in two, doubled.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from idem.retry.engine import RetryEngine


@dataclass(frozen=True, slots=True)
class StateAudit:
    """Origin msg ids by state, and what breaks the invariant."""

    expected: frozenset[str]
    done: frozenset[str]
    retrying: frozenset[str]
    journal_retrying: frozenset[str]
    dead: frozenset[str]

    @property
    def lost(self) -> frozenset[str]:
        """Expected messages in no state at all."""
        return self.expected - self.done - self.retrying - self.dead

    @property
    def doubled(self) -> dict[str, tuple[str, ...]]:
        """Messages in more than one state, with the states."""
        out: dict[str, tuple[str, ...]] = {}
        for origin in self.done | self.retrying | self.dead:
            states = tuple(
                name
                for name, members in (
                    ("done", self.done),
                    ("retrying", self.retrying),
                    ("dead", self.dead),
                )
                if origin in members
            )
            if len(states) > 1:
                out[origin] = states
        return out

    @property
    def unexpected(self) -> frozenset[str]:
        """Messages in some state that nobody sent."""
        return (self.done | self.retrying | self.dead) - self.expected

    @property
    def redis_journal_mismatch(self) -> frozenset[str]:
        """Messages Redis and the journal disagree about (retrying in one only)."""
        return self.retrying ^ self.journal_retrying

    @property
    def ok(self) -> bool:
        """Whether every message is in exactly one state and Redis matches the journal."""
        return not (self.lost or self.doubled or self.unexpected or self.redis_journal_mismatch)

    def describe(self) -> str:
        """A short report for an assertion message."""
        return (
            f"expected={len(self.expected)} done={len(self.done)} "
            f"retrying={len(self.retrying)} dead={len(self.dead)} "
            f"lost={sorted(self.lost)[:5]} doubled={dict(list(self.doubled.items())[:5])} "
            f"unexpected={sorted(self.unexpected)[:5]} "
            f"redis_vs_journal={sorted(self.redis_journal_mismatch)[:5]}"
        )


def audit_states(engine: RetryEngine, expected: Iterable[str], done: Iterable[str]) -> StateAudit:
    """Audit ``engine``'s group: ``expected`` origin ids, of which ``done`` were completed."""
    retrying = frozenset(e.origin_msg_id for e in engine.store.live_entries())
    journal_retrying = frozenset(e.origin_msg_id for e in engine.journal.live().values())
    dead = frozenset(letter.origin_msg_id for letter in engine.dlq.list())
    return StateAudit(
        expected=frozenset(expected),
        done=frozenset(done),
        retrying=retrying,
        journal_retrying=journal_retrying,
        dead=dead,
    )


def audit_group(engine: RetryEngine) -> StateAudit:
    """Audit what the resend path alone can tell (``idem retry audit``): no message both
    retrying and dead, and Redis holding what the journal holds live. What the consumer
    completed is its sink's to say, so ``done`` is empty and every message seen is
    expected."""
    audit = audit_states(engine, (), ())
    seen = audit.retrying | audit.journal_retrying | audit.dead
    return StateAudit(
        expected=seen,
        done=frozenset(),
        retrying=audit.retrying,
        journal_retrying=audit.journal_retrying,
        dead=audit.dead,
    )
