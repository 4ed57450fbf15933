"""``delta_sink``: a ready ``foreachBatch`` sink into a Delta table that is its own ledger.

::

    stream.writeStream.foreachBatch(delta_sink("/data/orders", key="order_id", config=config))

The fresh rows of each micro-batch are written to the table together with
the ledger columns that record their keys as done (``group, bucket, key,
msg_id, ..., completed_at``), in one Delta commit carrying
``txnAppId``/``txnVersion`` (by the ledger engine ``config.engine`` names:
delta-rs in this process, or delta-spark through the Spark session): there is
no moment between the write and its done-record for a crash to fall into.
The table is read by anything that reads Delta; the user's columns sit next
to the ledger's (a user column may not share a ledger column's name, except
the key column ``key``).
"""

from __future__ import annotations

from idem.clock import SYSTEM_CLOCK, Clock
from idem.config import IdemConfig
from idem.redis_cluster import RedisClient
from idem.spark.decorator import ExactlyOnce, resolve_config
from idem.spark.messages import DEFAULT_TOPIC
from idem.spark.sink_result import SinkFunction


def delta_sink(
    path: str,
    *,
    key: str,
    group: str | None = None,
    config: IdemConfig | None = None,
    client: RedisClient | None = None,
    validate: SinkFunction | None = None,
    topic: str = DEFAULT_TOPIC,
    fingerprint: bool = True,
    msg_id: str | None = None,
    clock: Clock = SYSTEM_CLOCK,
    leases: bool | None = None,
) -> ExactlyOnce:
    """A ``foreachBatch`` function writing each key's row once into the Delta table at ``path``.

    ``validate`` (optional) gets the fresh rows first, like an ``@exactly_once``
    function, and may return the keys that failed: those are retried on the
    delay ladder instead of written. ``msg_id`` names the column with the
    source's message id (see :func:`~idem.spark.decorator.exactly_once`).

    Without ``validate`` the claims take no leases in Redis: the table's commit is
    checked against every ledger version since the claim, which alone keeps a key from
    being written twice. Pass ``leases=True`` if a function sink or a consumer shares
    the group, so they see the keys this sink is writing as busy.
    """
    return ExactlyOnce(
        validate,
        config=resolve_config(group, config),
        key=key,
        client=client,
        sink_table=path,
        topic=topic,
        fingerprint=fingerprint,
        msg_id=msg_id,
        clock=clock,
        leases=leases,
    )
