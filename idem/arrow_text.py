"""String arrays built straight from their bytes, without a Python object per row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

_MAX_BYTES = 2**31 - 1
"""What the 32-bit offsets of an Arrow ``string`` array can address."""


def fixed_width_strings(data: bytes, count: int, width: int) -> pa.Array:
    """``count`` strings of ``width`` UTF-8 bytes each, laid end to end in ``data``."""
    if count * width > _MAX_BYTES:
        raise ValueError(f"{count} strings of {width} bytes exceed {_MAX_BYTES} bytes")
    offsets = np.arange(count + 1, dtype=np.int32) * np.int32(width)
    return pa.StringArray.from_buffers(count, pa.py_buffer(offsets), pa.py_buffer(data))


def repeat_text(value: str, size: int) -> pa.Array:
    """``value`` ``size`` times as a string array (``pa.repeat`` of a string scalar copies
    it one row at a time, ~40x slower)."""
    data = value.encode("utf-8")
    if len(data) * size > _MAX_BYTES:
        return pa.repeat(pa.scalar(value, pa.string()), size)
    return fixed_width_strings(data * size, size, len(data))
