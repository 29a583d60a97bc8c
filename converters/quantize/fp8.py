"""FP8 E4M3 weight quantization, byte for byte as compressed-tensors 0.20.1 does it (observers/helpers.py,
quantization/utils/helpers.py `calculate_qparams`, lifecycle/forward_helpers.py `_quantize`):

    scale = amax(|W|) / 448              per row ("channel"), per 128x128 block ("block", zero-padded to whole
                                          blocks) or for the whole tensor ("tensor"); a zero scale becomes the
                                          dtype's eps
    q     = clamp(W / scale, -448, 448).to(float8_e4m3fn)

both computed in the weight's own dtype (bf16 division rounds before the cast to FP8, and so must ours).

Done with numpy and ml_dtypes, no torch (importing torch alone costs ~1 CPU-s and ~190 MB of RSS): the values are
widened to float32 (exact), divided there and rounded back to the weight's dtype (torch's bf16/fp16 division is
a float32 division rounded to nearest even, so the bytes are the same), clamped (448 is exact in every dtype, so
clamping before or after that rounding is the same) and cast to FP8 by ml_dtypes (round to nearest even, as
torch's cast). Zero padding never changes a block's |max|, so blocks are reduced without padding.

Only NaNs may differ, in their sign bit: a weight holding inf or NaN gives NaN where torch does, but ml_dtypes
writes every FP8 NaN as 0x7F while torch keeps the quotient's sign, which its vector kernels set differently
with the extent of the tensor (torch on a slab and torch on the whole tensor already disagree there).

`Slab` works on one slab of whole rows (a multiple of 128 rows) in buffers it reuses, so memory stays at a few
slabs whatever the tensor's size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from .config import BLOCK

if TYPE_CHECKING:
    import torch

FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = 448.0
DTYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def scale_of(amax: np.ndarray, dtype: str) -> np.ndarray:
    """The scales (in `dtype`) of groups whose largest magnitudes are `amax` (float32 values of `dtype`)."""
    kind = DTYPES[dtype]
    scale = (amax / np.float32(FP8_MAX)).astype(kind)  # calculate_qparams: amax / (896 / 2) in the dtype
    scale[scale == 0] = ml_dtypes.finfo(kind).eps
    return scale


class Slab:
    """FP8 bytes and |max| of slabs of rows, in float32 work buffers reused from slab to slab."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def _buffer(self, name: str, count: int, kind: Any) -> np.ndarray:
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
            np.copyto(out, np.frombuffer(raw, dtype=DTYPES[dtype]).reshape(shape))
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
        """FP8 values (as uint8) of float32 `rows` given their scales in `dtype` ([n, 1], [ceil(n/128),
        ceil(cols/128)] or [1], as `amax` groups them); the result lives in a reused buffer."""
        n, cols = rows.shape
        divisor = scale.astype(np.float32)
        quotient = self._buffer("work", rows.size, np.float32).reshape(n, cols)
        with np.errstate(all="ignore"):
            self._divide(rows, divisor, quotient, strategy)
        np.clip(quotient, -FP8_MAX, FP8_MAX, out=quotient)
        out = self._buffer("fp8", rows.size, FP8).reshape(n, cols)
        if dtype == "float32":
            np.copyto(out, quotient, casting="unsafe")
        else:  # rounded to the weight's dtype first, as torch's division in that dtype is
            narrow = self._buffer("narrow", rows.size, DTYPES[dtype]).reshape(n, cols)
            np.copyto(narrow, quotient, casting="unsafe")
            np.copyto(out, narrow, casting="unsafe")
        return out.view(np.uint8)

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
