"""Giving freed heap back to the system between slabs of work.

glibc raises its mmap threshold to the size of the temporaries torch frees, so slab-sized buffers stay in the
heap after they are freed and RSS creeps up by a few slabs over a long export; `release()` trims it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def _trimmer() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


_TRIM = _trimmer()


def release() -> None:
    """Hand freed heap back to the system (a no-op where the C library is not glibc)."""
    if _TRIM is not None:
        _TRIM(0)
