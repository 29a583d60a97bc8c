"""Per-tensor statistics accumulated block by block in float64.

`Moments` takes a tensor's elements in blocks (any order, any sizes) and keeps, in float64:

- counts: elements, NaN, +Inf, -Inf, zeros (exact);
- over the finite elements only (NaN and +-Inf are counted, then left out): min and max (exact: every
  floating value is exact in float64; integers and bool in their own dtype), the mean, the population
  standard deviation (sqrt(M2 / n), divisor n, not n-1), and the L2 norm sqrt(sum x**2) (inf when the sum of
  squares overflows float64, values beyond ~1e154);
- the sum and the sum of squares of each sub-block, widened to float64 and shifted (by its first value for a
  tensor's first, then by the mean so far while that lies outside half the spread so far, else not at all),
  give its mean and M2 (a second pass about the sub-block's own mean when the shift is outside its spread),
  combined across sub-blocks with Chan, Golub and LeVeque's parallel update; the sum of squares of a
  sub-block from its M2 and mean (no cancellation: both terms are non-negative), summed with Neumaier's
  compensation. The results equal torch's float64 computation on the whole tensor to float64 rounding
  (tests: within 1e-12 relative).

Work per sub-block of `SUB_BLOCK` elements is a few numpy passes, nothing per element in Python: float32,
and bfloat16 and float16 made float32 exactly by integer operations on their bits, are checked for NaN
and infinities by their min and max, have their zeros counted, and are widened once into a reused float64
buffer that stays in cache for the two sums, taken by BLAS dots over rows short enough that OpenBLAS runs
them in the calling thread (no BLAS threads spinning on shared cores). Other dtypes (float8, integers,
bool) and blocks holding NaN or infinities are widened by numpy's casts and filtered. Integers and bool
are taken as their values (bool: 0 and 1); the mean and spread of integers beyond 2**53 are as exact as
float64 holds them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import dtypes

SUB_BLOCK = 1 << 17  # elements per step: a float64 copy of 1 MiB stays in cache

_INTEGER = dtypes.INTEGER
SUPPORTED = dtypes.WITH_STATISTICS  # every dtype statistics are computed for


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
    `load` returns a view valid until the next. float16 and bfloat16 blocks are first made float32 exactly by
    integer operations on their bits (`single`): numpy's own casts from float16 run element by element."""

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self._buf = np.empty(0, dtype=np.float64)
        self._bits_buf = np.empty(0, dtype=np.uint32)

    def buffer(self, n: int) -> np.ndarray:
        """The reused float64 buffer, `n` elements of it."""
        if self._buf.size < n:
            self._buf = np.empty(max(n, SUB_BLOCK), dtype=np.float64)
        return self._buf[:n]

    def single(self, part: np.ndarray) -> np.ndarray | None:
        """`part` as exact float32 values (a view valid until the next call) for float32, bfloat16 and float16;
        None for the other dtypes. A float16 NaN or infinity comes out as a finite value of magnitude 65536 or
        more (`SINGLE_LIMIT`), above every finite float16: its caller takes such a block the slow way."""
        if self.dtype == "float32":
            return part
        if self.dtype == "bfloat16":
            return self._bfloat16(part)
        if self.dtype == "float16" and _exact_subnormals():
            return self._float16(part)
        return None

    def _bits(self, n: int) -> np.ndarray:
        if self._bits_buf.size < n:
            self._bits_buf = np.empty(max(n, SUB_BLOCK), dtype=np.uint32)
        return self._bits_buf[:n]

    def _bfloat16(self, part: np.ndarray) -> np.ndarray:
        bits = self._bits(part.size)  # a bfloat16 is the upper half of a float32
        np.copyto(bits, part)
        np.left_shift(bits, 16, out=bits)
        return bits.view(np.float32)

    def _float16(self, part: np.ndarray) -> np.ndarray:
        """Sign-extended to 32 bits and shifted so that its sign is a float32's and its exponent and fraction
        sit at the top of a float32's: as a float32 that is the value times 2**-112 (a subnormal float16 lands
        on a subnormal float32), exactly; a multiplication by 2**112 rebiases it, exactly."""
        bits = self._bits(part.size)
        np.copyto(bits.view(np.int32), part.view(np.int16))
        np.left_shift(bits, 13, out=bits)
        np.bitwise_and(bits, np.uint32(0x8FFFE000), out=bits)
        values = bits.view(np.float32)
        np.multiply(values, np.float32(2.0**112), out=values)
        return values

    def load(self, part: np.ndarray) -> np.ndarray:
        out = self.buffer(part.size)
        if self.dtype == "bfloat16":  # exact float32 from its bits (numpy does not know bfloat16)
            part = self._bfloat16(part)
        with np.errstate(invalid="ignore"):  # a signalling NaN stays a NaN, without a warning
            np.copyto(out, part, casting="unsafe")
        return out


#: the magnitude from which a block made float32 by `Widener.single` may hold NaN or infinities
SINGLE_LIMIT = {"float32": math.inf, "bfloat16": math.inf, "float16": 65536.0}
ROW = 8192  # float64 elements per BLAS dot: OpenBLAS splits a dot over more than 10000 across threads


def _exact_subnormals() -> bool:
    """Whether this thread's float arithmetic takes subnormal inputs as they are (no denormals-are-zero mode
    set by some other library), as `Widener.single` needs for float16's subnormals."""
    return bool(np.float32(1e-45) * np.float32(2.0**112) != 0)


def sums(d: np.ndarray) -> tuple[float, float]:
    """(sum of squares, sum) of the float64 array `d`, by BLAS dots over rows of `ROW` elements (single-threaded:
    no BLAS threads spinning on shared cores; several times faster than einsum)."""
    rows, body, tail = _rows(d)
    with np.errstate(over="ignore", invalid="ignore"):  # a sum beyond float64 is inf, as reported
        s = float(tail.sum())
        if rows:
            s += float(np.matmul(body, _ones()).sum())
    return sum_squares(d), s


def sum_squares(d: np.ndarray) -> float:
    """The sum of squares of the float64 array `d` (as `sums`)."""
    rows, body, tail = _rows(d)
    with np.errstate(over="ignore", invalid="ignore"):
        ss = float(np.dot(tail, tail))
        if rows:
            ss += float(np.matmul(body, body.reshape(rows, ROW, 1)).sum())
    return ss


def _rows(d: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """`d` as rows of `ROW` elements (shaped for batched dots) and the rest."""
    rows = d.size // ROW
    return rows, d[: rows * ROW].reshape(rows, 1, ROW), d[rows * ROW:]


_ONES: list[np.ndarray] = []


def _ones() -> np.ndarray:
    """A column of `ROW` ones (created once, read-only)."""
    if not _ONES:
        ones = np.ones((ROW, 1))
        ones.flags.writeable = False
        _ONES.append(ones)
    return _ONES[0]


class Moments:
    """Statistics of one tensor, fed with `add(block)` (a flat numpy array read as `numpy_dtype(dtype)`),
    read with `result()`."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        self.stats = TensorStats(name, dtype, shape)
        self.integer = dtype in _INTEGER
        self.limit = SINGLE_LIMIT.get(dtype, math.inf)
        self.n = 0  # finite elements so far
        self.mean = 0.0
        self.m2 = 0.0
        self.sq = 0.0  # sum of squares (Neumaier: `sq + sq_err`)
        self.sq_err = 0.0
        self.lo: Any = None
        self.hi: Any = None
        self._wide = Widener(dtype)
        self._zero = np.empty(0, dtype=bool)

    def add(self, block: np.ndarray) -> None:
        """Take the elements of `block` (flat) into the statistics."""
        self.stats.count += block.size
        for start in range(0, block.size, SUB_BLOCK):
            self._add_part(block[start: start + SUB_BLOCK])

    def _add_part(self, part: np.ndarray) -> None:
        fast = part if self.stats.dtype == "float64" else self._wide.single(part)
        if fast is not None and fast.size:  # min, max and == on float32 (or float64) values as they are
            lo, hi = fast.min(), fast.max()  # NaN propagates, so one test finds any non-finite value
            if -self.limit < lo and hi < self.limit:
                self._extremes(float(lo), float(hi))
                self._count_zeros(fast)
                self._add_finite(fast)
                return
        d = self._wide.load(part)  # in cache from here on
        if self.integer:
            self._extremes(int(part.min()), int(part.max()))  # in the dtype: exact beyond 2**53
        else:
            lo, hi = d.min(), d.max()
            if not (math.isfinite(lo) and math.isfinite(hi)):
                d = self._finite(d)
                if not d.size:
                    return
                lo, hi = d.min(), d.max()
            self._extremes(float(lo), float(hi))
        self._count_zeros(d)
        self._add_finite(d)

    def _count_zeros(self, values: np.ndarray) -> None:
        if self._zero.size < values.size:
            self._zero = np.empty(max(values.size, SUB_BLOCK), dtype=bool)
        self.stats.zeros += int(np.count_nonzero(np.equal(values, 0, out=self._zero[: values.size])))

    def _add_finite(self, values: np.ndarray) -> None:
        """The moments of a block of finite values, widened to float64 and shifted by `k` in one pass: M2 = sum d**2
        - n (mean - k)**2, exact to a few roundings while the shift is within the block's spread (2 n (mean - k)**2
        <= sum d**2); otherwise a second pass about the block's own mean. `k` is 0 (no shift to apply) while the
        mean so far is within half the spread so far, else that mean (the first value for a first block)."""
        n = values.size
        k = 0.0
        if not self.n:
            k = float(values[0])
        elif 4 * self.n * self.mean * self.mean > self.m2:
            k = self.mean
        if k:
            d = np.subtract(values, k, out=self._wide.buffer(n), dtype=np.float64)  # one rounding of the shift
        elif values.dtype == np.float64:
            d = values  # read as it is, not written
        else:
            d = self._wide.buffer(n)
            np.copyto(d, values)  # exact
        ss, s = sums(d)
        delta = s / n
        if math.isfinite(ss) and 2 * n * delta * delta <= ss:
            m2 = max(ss - n * delta * delta, 0.0)
        else:
            d = np.subtract(d, delta, out=self._wide.buffer(n))
            m2 = sum_squares(d)
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
