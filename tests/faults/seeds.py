"""Seeds of the fault tier: one number decides every random choice of a run."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

SEED_VARIABLE = "IDEM_FAULT_SEED"
"""Set it to a seed a failure printed to replay that run's fault schedule."""


@dataclass
class Seed:
    """A run's seed and the one random source drawn from it."""

    value: int
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.value)

    def tag(self, message: str) -> str:
        """``message`` with the seed that reproduces it."""
        return f"[seed={self.value}, replay with {SEED_VARIABLE}={self.value}] {message}"


def seed_from_env() -> Seed:
    """``IDEM_FAULT_SEED`` when set, otherwise a fresh seed."""
    raw = os.environ.get(SEED_VARIABLE)
    return Seed(int(raw) if raw else random.SystemRandom().randrange(2**32))
