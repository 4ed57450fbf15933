"""Business keys: validation, bucketing and payload fingerprints.

A key is the business key of a message (RocketMQ's message Key, e.g.
``ORDERID_100``), never the message id, which changes on every resend.
"""

from __future__ import annotations

import hashlib
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from idem.errors import InvalidKey


@dataclass(frozen=True, slots=True)
class UnreadableKey:
    """Stands for the key of a message it could not be read from (a body that is not
    JSON, say): :func:`validate_key` refuses it, with ``why``."""

    why: str


def validate_key(value: object, *, field: str = "key", max_bytes: int = 512) -> str:
    """Return ``value`` as a key, or raise :class:`InvalidKey` naming the field and limit.

    Bytes are accepted when they decode as UTF-8. Surrounding whitespace is
    significant (``" A"`` and ``"A"`` are different keys) but a key made only of
    whitespace counts as empty.
    """
    if value is None:
        raise InvalidKey(f"{field}: key is null", field=field, reason="null")
    if isinstance(value, UnreadableKey):
        raise InvalidKey(
            f"{field}: cannot read the key: {value.why}", field=field, reason="undecodable"
        )
    if isinstance(value, bytes | bytearray | memoryview):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidKey(
                f"{field}: key is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                field=field,
                reason="undecodable",
            ) from None
    if not isinstance(value, str):
        raise InvalidKey(
            f"{field}: key must be text, got {type(value).__name__}",
            field=field,
            reason="not_text",
        )
    if not value.strip():
        raise InvalidKey(f"{field}: key is empty", field=field, reason="empty")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:  # a lone surrogate, e.g. JSON's "\ud800"
        raise InvalidKey(
            f"{field}: key is not valid Unicode text ({exc.reason} at character {exc.start})",
            field=field,
            reason="undecodable",
        ) from None
    if size > max_bytes:
        raise InvalidKey(
            f"{field}: key is {size} bytes; the limit is {max_bytes} bytes (max_key_bytes)",
            field=field,
            reason="too_long",
        )
    return value


def valid_keys(
    values: Iterable[object], *, field: str = "key", max_bytes: int = 512
) -> list[str | None]:
    """:func:`validate_key` of each value, ``None`` where it is invalid.

    The common case (a non-blank ASCII ``str`` within ``max_bytes``: one byte per
    character, nothing to encode) is decided inline; :class:`~idem.batchkeys.BatchKeys`
    inlines the same test in its own loop, which also needs the reasons.
    """
    keys: list[str | None] = []
    for value in values:
        if (
            type(value) is str
            and value.isascii()
            and 0 < len(value) <= max_bytes
            and not value.isspace()
        ):
            keys.append(value)
            continue
        try:
            keys.append(validate_key(value, field=field, max_bytes=max_bytes))
        except InvalidKey:
            keys.append(None)
    return keys


def bucket_of(key: str, buckets: int) -> int:
    """The bucket of ``key``: CRC-32 of its UTF-8 bytes modulo ``buckets`` (stable everywhere)."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % buckets


def group_by_bucket(keys: Iterable[str], buckets: int) -> dict[int, list[str]]:
    """Keys grouped by bucket, each bucket's list in input order."""
    grouped: defaultdict[int, list[str]] = defaultdict(list)
    for key in keys:
        grouped[zlib.crc32(key.encode("utf-8", "surrogatepass")) % buckets].append(key)
    return dict(grouped)


def fingerprint(payload: bytes | str | None) -> str:
    """A short, stable digest of a payload (BLAKE2b-128, hex); empty string for no payload."""
    if payload is None:
        return ""
    data = payload.encode("utf-8") if isinstance(payload, str) else payload
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def fingerprints(payloads: Iterable[bytes]) -> list[str]:
    """:func:`fingerprint` of each of many bytes payloads."""
    blake2b = hashlib.blake2b
    return [blake2b(data, digest_size=16).hexdigest() for data in payloads]


def invert(grouped: Mapping[int, list[str]]) -> dict[str, int]:
    """``{key: bucket}`` from a bucket grouping."""
    return {key: bucket for bucket, keys in grouped.items() for key in keys}
