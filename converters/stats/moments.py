"""Per-tensor statistics accumulated block by block in float64.

`Moments` takes a tensor's elements in blocks (any order, any sizes) and keeps, in float64:

- counts: elements, NaN, +Inf, -Inf, zeros (exact);
- over the finite elements only (NaN and +-Inf are counted, then left out): min and max (exact: every
  floating value is exact in float64; integers and bool in their own dtype), the mean, the population
  standard deviation (sqrt(M2 / n), divisor n, not n-1), and the L2 norm sqrt(sum x**2) (inf when the sum of
  squares overflows float64, values beyond ~1e154);
- the mean and M2 of each sub-block by two passes over it (in cache), combined across sub-blocks with Chan,
  Golub and LeVeque's parallel update; the sum of squares of a sub-block from its M2 and mean (no
  cancellation: both terms are non-negative), summed with Neumaier's compensation. The results equal
  torch's float64 computation on the whole tensor to float64 rounding (tests: within 1e-12 relative).

Work per block is a few numpy ops (single-threaded: no BLAS or OpenMP threads spinning on shared cores)
over sub-blocks of `SUB_BLOCK` elements, each widened once into one reused float64 buffer that stays in
cache for the passes over it; nothing is done per element in Python. Integers and bool are taken as their
values (bool: 0 and 1); the mean and spread of integers beyond 2**53 are as exact as float64 holds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

SUB_BLOCK = 1 << 17  # elements per step: a float64 copy of 1 MiB stays in cache

_INTEGER = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"})
#: every dtype statistics are computed for (the others, complex and packed sub-byte types, are listed as skipped)
SUPPORTED = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                       "float8_e4m3fnuz", "float8_e5m2fnuz", *_INTEGER})


@dataclass
class TensorStats:
    name: str
    dtype: str
    shape: tuple[int, ...]
    count: int = 0  # elements
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    zeros: int = 0
    min: float | int | None = None  # over the finite elements; None when there is none
    max: float | int | None = None
    mean: float | None = None
    std: float | None = None  # population standard deviation (divisor n) of the finite elements
    l2: float = 0.0  # sqrt of the sum of squares of the finite elements

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "count": self.count,
                "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf, "zeros": self.zeros,
                "min": json_number(self.min), "max": json_number(self.max), "mean": json_number(self.mean),
                "std": json_number(self.std), "l2": json_number(self.l2)}


def json_number(value: float | int | None) -> float | int | str | None:
    """JSON has no infinity or NaN: such a value (a float64 sum that overflowed) is written as a string."""
    return value if value is None or isinstance(value, int) or math.isfinite(value) else str(value)


def numpy_dtype(dtype: str) -> Any:
    """The numpy dtype a block of `dtype` is read as (bfloat16 as its uint16 bits: `Moments` widens them)."""
    if dtype == "bfloat16":
        return np.uint16
    if dtype.startswith("float8"):
        import ml_dtypes

        return getattr(ml_dtypes, dtype)
    return np.dtype(dtype)


class Widener:
    """Blocks of one dtype widened to float64 in one reused buffer (exact for every floating dtype): each
    `load` returns a view valid until the next."""

    def __init__(self, dtype: str) -> None:
        self.bf16 = dtype == "bfloat16"
        self._buf = np.empty(0, dtype=np.float64)
        self._bits = np.empty(0, dtype=np.uint32)

    def buffer(self, n: int) -> np.ndarray:
        """The reused float64 buffer, `n` elements of it."""
        if self._buf.size < n:
            self._buf = np.empty(max(n, SUB_BLOCK), dtype=np.float64)
        return self._buf[:n]

    def load(self, part: np.ndarray) -> np.ndarray:
        n = part.size
        out = self.buffer(n)
        if self.bf16:  # a bfloat16 is the upper half of a float32
            if self._bits.size < n:
                self._bits = np.empty(max(n, SUB_BLOCK), dtype=np.uint32)
            bits = self._bits[:n]
            np.copyto(bits, part)
            np.left_shift(bits, 16, out=bits)
            part = bits.view(np.float32)
        np.copyto(out, part, casting="unsafe")
        return out


class Moments:
    """Statistics of one tensor, fed with `add(block)` (a flat numpy array read as `numpy_dtype(dtype)`),
    read with `result()`."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.stats = TensorStats(name, dtype, shape)
        self.integer = dtype in _INTEGER
        self.simd = dtype in ("float32", "float64")  # numpy's min, max and == run natively on these
        self.n = 0  # finite elements so far
        self.mean = 0.0
        self.m2 = 0.0
        self.sq = 0.0  # sum of squares (Neumaier: `sq + sq_err`)
        self.sq_err = 0.0
        self.lo: Any = None
        self.hi: Any = None
        self._wide = Widener(dtype)

    def add(self, block: np.ndarray) -> None:
        """Take the elements of `block` (flat) into the statistics."""
        self.stats.count += block.size
        for start in range(0, block.size, SUB_BLOCK):
            self._add_part(block[start: start + SUB_BLOCK])

    def _add_part(self, part: np.ndarray) -> None:
        if self.simd:  # float32 and float64: min, max and == run on the block itself, widened once below
            lo, hi = part.min(), part.max()  # NaN propagates, so one test finds any non-finite value
            if math.isfinite(lo) and math.isfinite(hi):
                self._extremes(float(lo), float(hi))
                self.stats.zeros += int(np.count_nonzero(part == 0))
                self._add_shifted(part)
                return
        d = self._wide.load(part)  # in cache from here on
        own = part
        if self.integer:
            self._extremes(int(part.min()), int(part.max()))  # in the dtype: exact beyond 2**53
        else:
            own = part if self.simd else d  # float32 compares twice as many elements per instruction
            lo, hi = own.min(), own.max()  # NaN propagates, so one test finds any non-finite value
            if not (math.isfinite(lo) and math.isfinite(hi)):
                d = own = self._finite(d)
                if not d.size:
                    return
                lo, hi = d.min(), d.max()
            self._extremes(float(lo), float(hi))
        self.stats.zeros += int(np.count_nonzero(own == 0))
        n = d.size
        mean = float(d.sum()) / n
        d -= mean
        m2 = float(np.einsum("i,i->", d, d))  # einsum, not dot: no BLAS threads competing for the cores
        # sum x**2 = sum (x-m)**2 + 2m sum (x-m) + n m**2: two non-negative terms (the middle one is the
        # rounding of m, below 2 eps of the total: left out)
        self._add_sq(m2 + n * mean * mean)
        self._combine(n, mean, m2)

    def _add_shifted(self, part: np.ndarray) -> None:
        """The moments of a finite float block, widened and shifted by `k` (the mean so far, or its first value)
        in one pass: M2 = sum d**2 - n (mean - k)**2, exact to a few roundings while the shift is within the
        block's spread (2 n (mean - k)**2 <= sum d**2); otherwise a second pass about the block's own mean."""
        n = part.size
        k = self.mean if self.n else float(part[0])
        d = self._wide.buffer(n)
        np.subtract(part, k, out=d, dtype=np.float64)  # exact widening, one rounding of the shift
        ss = float(np.einsum("i,i->", d, d))
        delta = float(d.sum()) / n
        if math.isfinite(ss) and 2 * n * delta * delta <= ss:
            m2 = max(ss - n * delta * delta, 0.0)
        else:
            d -= delta
            m2 = float(np.einsum("i,i->", d, d))
        mean = k + delta
        self._add_sq(m2 + n * mean * mean)
        self._combine(n, mean, m2)

    def _finite(self, d: np.ndarray) -> np.ndarray:
        """Count the NaN and infinities of `d`; return its finite elements."""
        s = self.stats
        nan = int(np.count_nonzero(np.isnan(d)))
        pos = int(np.count_nonzero(d == math.inf))
        finite = d[np.isfinite(d)]
        s.nan += nan
        s.posinf += pos
        s.neginf += d.size - finite.size - nan - pos
        return finite

    def _extremes(self, low: float | int, high: float | int) -> None:
        self.lo = low if self.lo is None else min(self.lo, low)
        self.hi = high if self.hi is None else max(self.hi, high)

    def _combine(self, n: int, mean: float, m2: float) -> None:
        """Chan et al.'s update: the moments of the elements so far and of a new group together."""
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total

    def _add_sq(self, value: float) -> None:
        total = self.sq + value
        if not math.isfinite(total):  # float64 overflow (values beyond ~1e154): the norm is reported as inf
            self.sq, self.sq_err = math.inf, 0.0
            return
        if abs(self.sq) >= abs(value):
            self.sq_err += (self.sq - total) + value
        else:
            self.sq_err += (value - total) + self.sq
        self.sq = total

    def merge(self, other: Moments) -> None:
        """Take in the elements `other` saw (another part of the same tensor, computed side by side)."""
        s, o = self.stats, other.stats
        s.count += o.count
        s.nan += o.nan
        s.posinf += o.posinf
        s.neginf += o.neginf
        s.zeros += o.zeros
        if other.n:
            self._extremes(other.lo, other.hi)
            self._combine(other.n, other.mean, other.m2)
        self._add_sq(other.sq)
        self._add_sq(other.sq_err)
        other.n, other.mean, other.m2, other.sq, other.sq_err, other.lo, other.hi = 0, 0.0, 0.0, 0.0, 0.0, None, None
        o.count = o.nan = o.posinf = o.neginf = o.zeros = 0

    def result(self) -> TensorStats:
        s = self.stats
        if self.n:
            s.min, s.max = self.lo, self.hi
            s.mean = self.mean
            s.std = math.sqrt(max(self.m2, 0.0) / self.n)
        s.l2 = math.sqrt(self.sq + self.sq_err)
        return s
