"""The sink function of the Spark soak (``idem run --sink-fn``, see :mod:`spark_soak`).

It stands for a downstream that validates each row before idem writes the accepted
ones to the Delta sink table: a row whose ``refuse`` field is ``first`` is refused on
its first delivery (so it comes back through the retry topic), one whose ``refuse``
is ``always`` on every delivery (so it is dead-lettered). The decision depends on
the row alone, so a replayed batch gets the same answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from idem.spark.messages import RECONSUME_TIMES_COLUMN

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

KEY = "order_id"
"""The business key field of the soak's rows."""


def refuse(fresh: DataFrame, batch_id: int) -> dict[str, str]:
    """``{key: reason}`` of the rows this delivery refuses (called once per batch, on
    the driver, with the rows idem admitted; it writes nothing itself)."""
    rows = fresh.select(KEY, "refuse", RECONSUME_TIMES_COLUMN).toArrow().to_pylist()
    failed: dict[str, str] = {}
    for row in rows:
        times = row[RECONSUME_TIMES_COLUMN] or 0
        if row["refuse"] == "always":
            failed[row[KEY]] = "ValueError: the downstream rejects this order"
        elif row["refuse"] == "first" and times == 0:
            failed[row[KEY]] = "TimeoutError: the downstream timed out (first delivery)"
    return failed
