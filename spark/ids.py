"""Payload fingerprints and message ids of a batch's rows, as whole Arrow columns.

Spark hashes each row on the JVM (``xxhash64``, cheap) and ships the 64-bit
hashes; the text forms are made here for the whole column at once (numpy),
never row by row in Python and never with Spark's string functions (``hex``
and ``md5`` of 100k rows cost more than the hashes themselves).

- fingerprint: Spark's ``hex(xxhash64(<payload columns>, <their null flags>))``
  — uppercase, no leading zeros, as earlier versions stored it in the ledger
  and in Redis, so a key completed before still compares equal.
- derived message id (no ``msg_id`` column): 32 hex digits, the 64-bit hash of
  the key then the payload hash, so a redelivered copy of a row (same key, same
  payload) is the same message.
- positional message id (no fingerprint either): the batch owner's 24-digit
  prefix and the row's index in 8 digits.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from idem.arrow_text import fixed_width_strings

_DIGITS = np.frombuffer(b"0123456789ABCDEF", dtype=np.uint8)
_WORDS = np.arange(1 << 16)
_WORD_DIGITS: np.ndarray = (
    np.stack([_DIGITS[(_WORDS >> shift) & 15] for shift in (12, 8, 4, 0)], axis=1)
    .copy()
    .view(np.uint32)
    .reshape(1 << 16)
)
"""The four hex digits of every 16-bit value, as one 4-byte word each (a 256 KiB table:
one lookup per 16 bits beats one per 8 bits by ten times)."""


def hex_digits(values: pa.Array | pa.ChunkedArray, *, width: int = 16) -> pa.Array:
    """Uppercase hex of 64-bit integers, the last ``width`` (even, <= 16) digits each.

    Two's complement and zero padded; nulls count as 0.
    """
    return _strings(_hex_bytes(values, width))


def spark_hex(hashes: pa.Array | pa.ChunkedArray) -> pa.Array:
    """What Spark's ``hex()`` makes of 64-bit integers: uppercase, without leading zeros."""
    trimmed = pc.utf8_ltrim(hex_digits(hashes), characters="0")
    return pc.if_else(pc.equal(trimmed, ""), "0", trimmed)


def derived_msg_ids(
    key_hashes: pa.Array | pa.ChunkedArray, fingerprint_hashes: pa.Array | pa.ChunkedArray
) -> pa.Array:
    """Message ids from the key's and the payload's 64-bit hashes (32 hex digits)."""
    return _strings(np.hstack([_hex_bytes(key_hashes, 16), _hex_bytes(fingerprint_hashes, 16)]))


def positional_msg_ids(prefix: str, size: int) -> pa.Array:
    """``prefix`` (ASCII) followed by each row index in 8 hex digits."""
    index = _hex_bytes(pa.array(np.arange(size, dtype=np.int64)), 8)
    head = np.frombuffer(prefix.encode("ascii"), dtype=np.uint8)
    return _strings(np.hstack([np.broadcast_to(head, (size, len(head))), index]))


def _hex_bytes(values: pa.Array | pa.ChunkedArray, width: int) -> np.ndarray:
    """``n x width`` ASCII hex digits of the values (see :func:`hex_digits`)."""
    if width % 2 or not 0 < width <= 16:
        raise ValueError(f"width: {width} must be even and at most 16")
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if values.null_count:
        values = pc.fill_null(values, 0)
    numbers = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64)
    words = numbers.astype(">i8").view(">u2").reshape(len(numbers), 4).astype(np.intp)
    digits: np.ndarray = _WORD_DIGITS[words].view(np.uint8).reshape(len(numbers), 16)
    return digits[:, 16 - width :]


def _strings(rows: np.ndarray) -> pa.Array:
    """An Arrow string array of the rows of an ``n x width`` ASCII byte matrix."""
    n, width = rows.shape
    return fixed_width_strings(np.ascontiguousarray(rows).tobytes(), n, width)
