"""A batch's completed keys as Arrow columns, handed to Redis bucket by bucket, a slice at a time.

:meth:`idem.hotstore_types.HotStore.complete_buckets` reads each bucket's keys a
call's worth at a time: :func:`bucket_slices` answers each read by taking just
those rows of the columns, so no more than one call's keys are ever Python text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from idem.hotstore_types import BucketKeys

Column: TypeAlias = pa.Array | pa.ChunkedArray
"""One column of a batch, in one piece or several."""

Reader: TypeAlias = Callable[[int, int], tuple[Sequence[str], Sequence[str]]]
"""Reads a bucket's keys ``start..stop`` and their fingerprints."""


def bucket_slices(
    keys: Column, buckets: Column, fingerprints: Column, *, bucket_count: int
) -> list[BucketKeys]:
    """Every bucket ``0..bucket_count-1`` (those without keys too), each with its rows'
    keys and fingerprints (a null fingerprint is ``""``) in the rows' order.

    Raises ``ValueError`` before anything is read for a bucket out of range or a
    fingerprint holding ``|``.
    """
    numbers = np.asarray(pc.cast(buckets, pa.int64()).to_numpy(), dtype=np.int64)
    if len(numbers) and (numbers.min() < 0 or numbers.max() >= bucket_count):
        raise ValueError(f"bucket: a row's bucket is outside 0..{bucket_count - 1}")
    prints = pc.fill_null(fingerprints, "") if fingerprints.null_count else fingerprints
    if len(prints) and pc.any(pc.match_substring(prints, "|")).as_py():
        raise ValueError("fingerprints: a fingerprint must not contain '|'")
    order = pa.array(np.argsort(numbers, kind="stable"))
    counts = np.bincount(numbers, minlength=bucket_count)
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return [
        BucketKeys(bucket, int(counts[bucket]), _reader(keys, prints, order, int(firsts[bucket])))
        for bucket in range(bucket_count)
    ]


def _reader(keys: Column, prints: Column, order: pa.Array, first: int) -> Reader:
    """Reads rows ``start..stop`` of the bucket whose rows begin at ``first`` in ``order``."""

    def read(start: int, stop: int) -> tuple[Sequence[str], Sequence[str]]:
        rows = order.slice(first + start, stop - start)
        return keys.take(rows).to_pylist(), prints.take(rows).to_pylist()

    return read
