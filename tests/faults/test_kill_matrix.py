"""The kill matrix in its short mode: one SIGKILL at each consumer and send-back crash point
(see :mod:`kill_matrix`).

``python -m tests.faults.kill_matrix --repeats 20`` runs it at scale. The Spark batch
points (``--points spark``, each kill an ``idem run`` start) stay out of this short mode:
the C10 scenarios kill ``idem run`` at four of them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kill_matrix import DEFAULT_POINTS, Matrix, figures, table
from seeds import Seed

from idem.redis_server import RedisServer

pytestmark = pytest.mark.faults


def test_a_kill_at_every_consumer_and_send_back_point_loses_nothing_and_duplicates_nothing(
    seed: Seed, redis_server: RedisServer, tmp_path: Path
) -> None:
    runs = Matrix(seed.value, redis_server, tmp_path).run(DEFAULT_POINTS, repeats=1, parallel=3)
    print(table(seed.value, figures(runs)))
    problems = [f"{r.point} at {r.chosen}: {p}" for r in runs for p in r.problems]
    assert not problems, seed.tag("; ".join(problems))
    assert [r.point for r in runs] == list(DEFAULT_POINTS)
    assert all(r.recovery_s is not None for r in runs), seed.tag("a run did not recover")
    assert sum(r.duplicates + r.lost for r in runs) == 0, seed.tag("duplicates or lost keys")
