"""Rows of a Spark batch as RocketMQ messages, and back.

A row that fails leaves the batch as a :class:`~idem.retry.message.MessageExt`
whose body is the row's JSON (:mod:`idem.spark.rows`) and whose ``KEYS`` is its
business key; the row's Spark schema rides along in the ``IDEM_SCHEMA``
property so a DLQ replay can decode it without the job. A row that comes back
through the retry stream carries its message in the ``_idem_message`` column
(the message's JSON envelope), so a second failure resends the *same* message
(same ``ORIGIN_MESSAGE_ID``, ``reconsume_times`` + 1), as RocketMQ does.
"""

from __future__ import annotations

import hashlib
from typing import Final

from idem.retry.message import MessageConst, MessageExt

RECONSUME_TIMES_COLUMN: Final = "reconsume_times"
"""Column the retry stream adds: how often the row was consumed before (RocketMQ's name)."""

MESSAGE_COLUMN: Final = "_idem_message"
"""Column the retry stream adds: the retried message's JSON envelope (null for main rows)."""

RETRY_COLUMNS: Final = (RECONSUME_TIMES_COLUMN, MESSAGE_COLUMN)
"""Columns that are retry bookkeeping, not the user's data."""

MALFORMED_COLUMN: Final = "_idem_malformed"
"""Column the retry stream (and ``idem run``'s file source) adds: why the row's values could
not be read, naming the column and the problem (null when they could). Such a row is
dead-lettered at once with this reason, its message body kept."""

RAW_BODY_COLUMN: Final = "_idem_raw_body"
"""Column ``idem run`` adds: a source line Spark could not parse (its corrupt record), which
becomes the dead letter's body."""

SOURCE_ID_COLUMN: Final = "_idem_source_id"
"""Column ``idem run``'s Kafka source adds: the record's message id (``<topic>-<partition>-
<offset>``). Bookkeeping, so a producer's resend (another offset) has the same payload."""

BOOKKEEPING_COLUMNS: Final = (*RETRY_COLUMNS, MALFORMED_COLUMN, RAW_BODY_COLUMN, SOURCE_ID_COLUMN)
"""Every column idem adds to the rows: never part of a payload, a fingerprint or a sink."""

SCHEMA_PROPERTY: Final = "IDEM_SCHEMA"
"""Message property holding the Spark schema (JSON) of the row in the body."""

KEY_FIELD_PROPERTY: Final = "IDEM_KEY_FIELD"
"""Message property naming the column the business key came from."""

SOURCE_LINE_PROPERTY: Final = "IDEM_SOURCE_LINE"
"""Message property (``"1"``) of a body that is a source line as read (one ``idem run``
could not parse), not a row's JSON: back on the retry stream it is read as the source
reads lines, fields outside the schema ignored."""

MSG_ID_COLUMN: Final = "_idem_msg_id"
"""Column the decorator adds: the message id of each main-stream row."""

DEFAULT_TOPIC: Final = "spark"
"""Topic of messages made from main-stream rows when the job names none."""


def msg_id_prefix(owner: str) -> str:
    """24 hex digits naming the batch ``owner``; a row's msg id adds its index (8 hex)."""
    return hashlib.blake2b(owner.encode(), digest_size=12).hexdigest().upper()


def message_for_row(
    *,
    topic: str,
    msg_id: str,
    index: int,
    key: str | None,
    body: bytes,
    schema_json: str,
    key_field: str,
    born_ms: int,
    previous: MessageExt | None = None,
    source_line: bool = False,
) -> MessageExt:
    """The message to send back for row ``index`` of a batch.

    ``previous`` is the message the row arrived as (a retried row): it is kept
    as it is, so its history and ``ORIGIN_MESSAGE_ID`` survive. A main-stream
    row becomes a message with ``msg_id`` (see :mod:`idem.spark.batch`: the
    source's message id, or one derived from the row's key and payload, so a
    redelivered copy is the same message and joins the same retry chain). ``source_line``:
    the body is the source's own line (see :data:`SOURCE_LINE_PROPERTY`).
    """
    if previous is not None:
        return previous
    properties = {
        SCHEMA_PROPERTY: schema_json,
        KEY_FIELD_PROPERTY: key_field,
        MessageConst.PROPERTY_KEYS: key or "",
    }
    if source_line:
        properties[SOURCE_LINE_PROPERTY] = "1"
    return MessageExt(
        topic=topic,
        msg_id=msg_id,
        body=body,
        keys=key,
        queue_id=0,
        queue_offset=index,
        born_timestamp=born_ms,
        store_timestamp=born_ms,
        reconsume_times=0,
        properties=properties,
    )
