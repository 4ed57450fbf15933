"""A batch's keys, validated and bucketed a slice of rows at a time (docs/pages/protocol.md).

A big batch is claimed in waves (see :mod:`idem.claiming`): while Redis
runs the claims of one slice of rows, this process validates and buckets the
next. :class:`BatchKeys` carries what the slices share: the first row of every
key (in-batch duplicates are decided across the whole batch, in precedence
order), the invalid rows and each row's bucket.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

from idem.errors import InvalidKey
from idem.keys import validate_key
from idem.outcome import DuplicateCause, Invalid


class BatchKeys:
    """Validation and bucketing state of one batch's keys."""

    def __init__(self, keys: Sequence[object], *, field: str, max_bytes: int, buckets: int) -> None:
        self.keys = keys
        self.field = field
        self.max_bytes = max_bytes
        self.bucket_count = buckets
        size = len(keys)
        self.normalised: list[str | None] = [None] * size
        """The validated key of every row (``None`` for bad keys and rows not taken yet)."""
        self.invalid: list[Invalid] = []
        self.duplicates: dict[int, DuplicateCause] = {}
        """Rows whose key an earlier row (in precedence order) has: ``IN_BATCH``."""
        self.first: dict[str, int] = {}
        """Every valid key and the row that carries it to the claim."""
        self.buckets: list[int] = [-1] * size
        """The bucket of every row in ``first`` (``-1`` for the others)."""

    def take(self, rows: Iterable[int]) -> dict[int, list[str]]:
        """Validate ``rows`` (in precedence order); return their new keys by bucket.

        A key seen in an earlier row (of this call or an earlier one) is an
        in-batch duplicate and not returned again.
        """
        keys, normalised, first, row_buckets = self.keys, self.normalised, self.first, self.buckets
        duplicates, buckets, crc = self.duplicates, self.bucket_count, zlib.crc32
        max_bytes = self.max_bytes
        grouped: dict[int, list[str]] = {}
        for i in rows:
            value = keys[i]
            # The common case, inline (as keys.valid_keys): a non-blank ASCII str that fits.
            if (
                type(value) is str
                and value.isascii()
                and 0 < len(value) <= max_bytes
                and not value.isspace()
            ):
                key = value
            else:
                try:
                    key = validate_key(value, field=self.field, max_bytes=self.max_bytes)
                except InvalidKey as exc:
                    self.invalid.append(Invalid(i, exc.field, exc.reason, str(exc)))
                    continue
            normalised[i] = key
            if key in first:
                duplicates[i] = DuplicateCause.IN_BATCH
                continue
            first[key] = i
            bucket = crc(key.encode("utf-8")) % buckets
            row_buckets[i] = bucket
            found = grouped.get(bucket)
            if found is None:
                grouped[bucket] = [key]
            else:
                found.append(key)
        return grouped
