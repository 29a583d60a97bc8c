"""FP8 E4M3 weight quantization, byte for byte as compressed-tensors 0.20.1 does it (observers/helpers.py,
quantization/utils/helpers.py `calculate_qparams`, lifecycle/forward_helpers.py `_quantize`):

    scale = amax(|W|) / 448              per row ("channel"), per 128x128 block ("block", zero-padded to whole
                                          blocks) or for the whole tensor ("tensor"); a zero scale becomes the
                                          dtype's eps
    q     = clamp(W / scale, -448, 448).to(float8_e4m3fn)

both computed in the weight's own dtype (bf16 division rounds before the cast to FP8, and so must ours).

Done with numpy alone, no torch (importing torch alone costs ~1 CPU-s and ~190 MB of RSS) and no ml_dtypes
(importing it costs ~0.6 CPU-s, a quarter of a 1 GB export): the values are widened to float32 (exact), divided
there and rounded back to the weight's dtype (torch's bf16/fp16 division is a float32 division rounded to nearest
even, so the bytes are the same; bfloat16 by bit arithmetic, float16 by numpy), clamped (448 is exact in every
dtype, so clamping before or after that rounding is the same) and cast to FP8 through a table of the FP8 code of
every 16-bit pattern (`FROM_BF16`, `FROM_F16`: round to nearest even, as torch's and ml_dtypes' casts; tests check
the casts against ml_dtypes on every bfloat16 and float16 pattern and on float32 edges and random patterns). A
float32 is looked up by its upper 16 bits (a bfloat16 pattern) with the lowest of them ORed with "any of the lower
16 bits set": FP8 keeps at most 3 mantissa bits, so bits 0-16 only ever count as "something below the rounding
bit", and the OR keeps exactly that. Zero padding never changes a block's |max|, so blocks are reduced without
padding. Scales are float32 arrays holding values of the weight's dtype (`scale_bytes` gives their bytes).

Only NaNs may differ, in their sign bit: a weight holding inf or NaN gives NaN where torch does, but the quotient's
NaN here keeps the sign of the NaN it came from (x86's default NaN is negative), as ml_dtypes does, while torch
keeps the quotient's sign as its vector kernels set it, differently with the extent of the tensor (torch on a slab
and torch on the whole tensor already disagree there).

`Slab` works on one slab of whole rows (a multiple of 128 rows) in buffers it reuses, so memory stays at a few
slabs whatever the tensor's size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .config import BLOCK

if TYPE_CHECKING:
    import torch

FP8_MAX = 448.0
EPS = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}  # each dtype's machine epsilon


def fp8_codes(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn codes (uint8) of float32 bit patterns `bits`, rounded to nearest even: |x| below 2^-6 (FP8's
    subnormals, steps of 2^-9) by rounding x * 2^9 to an integer, above by rounding the mantissa to 3 bits; beyond
    448 (after rounding), inf and NaN: NaN (0x7F), the sign kept. Exact and slow: builds the tables."""
    a = bits.astype(np.uint32) & 0x7FFFFFFF
    sign = ((bits.astype(np.uint32) >> 24) & 0x80).astype(np.uint8)
    magnitude = np.where(a < 0x7F800000, a, 0).view(np.float32).astype(np.float64)
    normal = ((a.astype(np.int64) + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    code = np.where(magnitude < 2.0 ** -6, np.rint(np.minimum(magnitude, 1.0) * 512.0).astype(np.int64), normal)
    code = np.where((code > 0x7E) | (a >= 0x7F800000), 0x7F, code).astype(np.uint8)
    return code | sign


_PATTERNS = np.arange(1 << 16, dtype=np.uint32)
FROM_BF16 = fp8_codes(_PATTERNS << 16)  # the FP8 code of each bfloat16 pattern
FROM_F16 = fp8_codes(_PATTERNS.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32))
del _PATTERNS


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """The bfloat16 patterns (uint16) of float32 `values`, rounded to nearest even; NaN: the quiet NaN 0x7FC0 with
    its sign, as ml_dtypes (and torch) round."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, (bits >> 16) & 0x8000 | 0x7FC0, rounded).astype(np.uint16)


def scale_of(amax: np.ndarray, dtype: str) -> np.ndarray:
    """The scales (float32 holding values of `dtype`) of groups whose largest magnitudes are `amax` (float32 values
    of `dtype`)."""
    scale = amax / np.float32(FP8_MAX)  # calculate_qparams: amax / (896 / 2) in the dtype
    if dtype == "bfloat16":
        scale = (bf16_bits(scale).astype(np.uint32) << 16).view(np.float32)
    elif dtype == "float16":
        scale = scale.astype(np.float16).astype(np.float32)
    scale[scale == 0] = EPS[dtype]
    return scale


def scale_bytes(scale: np.ndarray, dtype: str) -> bytes:
    """The bytes of scales (`scale_of`) in their dtype."""
    if dtype == "bfloat16":
        return bf16_bits(scale).tobytes()
    return scale.astype(np.float16 if dtype == "float16" else np.float32).tobytes()


class Slab:
    """FP8 bytes and |max| of slabs of rows, in float32 work buffers reused from slab to slab."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def _buffer(self, name: str, count: int, kind: type) -> np.ndarray:
        have = self._buffers.get(name)
        if have is None or have.nbytes < count * np.dtype(kind).itemsize:
            have = self._buffers[name] = np.empty(count * np.dtype(kind).itemsize, dtype=np.uint8)
        return have[: count * np.dtype(kind).itemsize].view(kind)

    def widen(self, raw: memoryview | np.ndarray, dtype: str, shape: tuple[int, int]) -> np.ndarray:
        """The rows in `raw` (bytes of `dtype`) as float32 (the bytes themselves when they are float32)."""
        if dtype == "float32":
            return np.frombuffer(raw, dtype=np.float32).reshape(shape)
        out = self._buffer("wide", shape[0] * shape[1], np.float32).reshape(shape)
        if dtype == "bfloat16":
            np.left_shift(np.frombuffer(raw, dtype=np.uint16).reshape(shape), 16, out=out.view(np.uint32),
                          dtype=np.uint32)
        else:
            np.copyto(out, np.frombuffer(raw, dtype=np.float16).reshape(shape))
        return out

    def _abs(self, rows: np.ndarray) -> np.ndarray:
        return np.abs(rows, out=self._buffer("work", rows.size, np.float32).reshape(rows.shape))

    def amax(self, rows: np.ndarray, strategy: str) -> np.ndarray:
        """|max| of each group of float32 `rows`: [n, 1] (channel), [ceil(n/128), ceil(cols/128)] (block), [1]."""
        n, cols = rows.shape
        if not rows.size:
            shape = (n, 1) if strategy == "channel" else (-(-n // BLOCK[0]), -(-cols // BLOCK[1])) \
                if strategy == "block" else (1,)
            return np.zeros(shape, dtype=np.float32)
        magnitude = self._abs(rows)
        if strategy == "channel":
            return magnitude.max(axis=1, keepdims=True)
        if strategy == "tensor":
            return magnitude.max().reshape(1)
        starts = np.arange(0, cols, BLOCK[1])
        return np.stack([np.maximum.reduceat(magnitude[at: at + BLOCK[0]].max(axis=0), starts)
                         for at in range(0, n, BLOCK[0])])

    def quantize(self, rows: np.ndarray, scale: np.ndarray, dtype: str, strategy: str) -> np.ndarray:
        """FP8 values (as uint8) of float32 `rows` given their scales (`scale_of`: [n, 1], [ceil(n/128),
        ceil(cols/128)] or [1], as `amax` groups them); the result lives in a reused buffer."""
        n, cols = rows.shape
        divisor = scale.astype(np.float32)
        quotient = self._buffer("work", rows.size, np.float32).reshape(n, cols)
        with np.errstate(all="ignore"):
            self._divide(rows, divisor, quotient, strategy)
        np.clip(quotient, -FP8_MAX, FP8_MAX, out=quotient)
        out = self._buffer("fp8", rows.size, np.uint8)
        bits = quotient.reshape(-1).view(np.uint32)
        if dtype == "float16":  # rounded to the weight's dtype first, as torch's division in that dtype is
            narrow = self._buffer("narrow", rows.size, np.float16)
            np.copyto(narrow, quotient.reshape(-1), casting="unsafe")
            np.take(FROM_F16, narrow.view(np.uint16), out=out, mode="wrap")
        elif dtype == "bfloat16":  # to nearest even in place (a NaN here has 16 low zero bits: it stays NaN)
            low = self._buffer("low", rows.size, np.uint32)
            np.right_shift(bits, 16, out=low)
            np.bitwise_and(low, 1, out=low)
            np.add(bits, low, out=bits)
            np.add(bits, 0x7FFF, out=bits)
            np.right_shift(bits, 16, out=bits)
            np.take(FROM_BF16, bits, out=out, mode="wrap")
        else:  # the upper 16 bits, the lowest of them ORed with any of the lower 16
            low = self._buffer("low", rows.size, np.uint32)
            np.bitwise_and(bits, 0xFFFF, out=low)
            np.minimum(low, 1, out=low)
            np.right_shift(bits, 16, out=bits)
            np.bitwise_or(bits, low, out=bits)
            np.take(FROM_BF16, bits, out=out, mode="wrap")
        return out.reshape(n, cols)

    @staticmethod
    def _divide(rows: np.ndarray, divisor: np.ndarray, quotient: np.ndarray, strategy: str) -> None:
        n, cols = rows.shape
        if strategy == "block":
            for block, at in enumerate(range(0, n, BLOCK[0])):
                across = np.repeat(divisor[block], BLOCK[1])[:cols]
                np.divide(rows[at: at + BLOCK[0]], across, out=quotient[at: at + BLOCK[0]])
        else:
            np.divide(rows, divisor, out=quotient)


def quantize(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale) of a whole 2-D torch weight in memory, computed by torch (`torch_fp8`): the form tests
    hold the streamed path in `export` against."""
    from .torch_fp8 import quantize as by_torch

    return by_torch(weight, strategy)


def scale_shape(shape: tuple[int, ...], strategy: str) -> tuple[int, ...]:
    rows, cols = shape
    if strategy == "tensor":
        return (1,)
    if strategy == "channel":
        return (rows, 1)
    return (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
