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

    The rows go into the table in one commit with the record that their keys are
    done: the table is the group's ledger. Without ``validate`` the claims take no
    leases in Redis: the table's commit is checked against every ledger version
    since the claim, which alone keeps a key from being written twice. Pass
    ``leases=True`` if a function sink or a consumer shares the group, so they see
    the keys this sink is writing as busy.

    Args:
        path: The Delta table the rows are written to (created on the first batch).
        key: The column holding the business key.
        group: The consumer group; overrides ``config.group``. Without ``config``,
            the settings come from ``IDEM_*`` variables.
        config: The group's settings (Redis URL, Delta paths, dedup window, delay
            levels, mismatch policy, ...).
        client: A Redis client to use instead of one built from
            ``config.redis_url``.
        validate: Called on the driver once per micro-batch, before the write, as
            ``validate(fresh, batch_id)`` with the fresh rows, like an
            ``@exactly_once`` function; it returns the keys that failed (or
            ``None``), and those are retried on the delay ladder instead of
            written. It may see the same rows again (a Spark replay, an expired
            lease), so it must have no effect that cannot be repeated, and must
            not write to ``path`` itself.
        topic: The topic name recorded with these rows' messages (retry topic,
            journal, DLQ rows).
        fingerprint: Hash each row's payload: a repeat of a completed key with a
            different payload follows the config's ``mismatch_policy``, and
            without ``msg_id`` copies of one message are recognised by key and
            payload. ``False`` skips the hash and both checks.
        msg_id: The column with the source's message id (see
            :func:`~idem.spark.decorator.exactly_once`).
        clock: The time source of leases, delays and the dedup window.
        leases: Whether claims take leases in Redis; by default only with
            ``validate``.

    Returns:
        An :class:`~idem.spark.decorator.ExactlyOnce` to pass to ``foreachBatch``.
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
