"""FP8 E4M3 weight quantization of a whole tensor with torch, as compressed-tensors 0.20.1 does it (see `fp8` for
the formulas): `quantize`, the form tests hold the export's numpy path against. The export never imports it
(importing torch costs ~1 CPU-s and ~190 MB).
"""

from __future__ import annotations

import torch

from .config import BLOCK

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _divisor(dtype: torch.dtype) -> torch.Tensor:
    # calculate_qparams: max_val_pos / (bit_range.to(dtype) / 2), bit_range = 448 - (-448)
    return torch.tensor(2 * FP8_MAX, dtype=dtype) / 2


def _no_zero(scale: torch.Tensor) -> torch.Tensor:
    eps = torch.tensor(torch.finfo(scale.dtype).eps, dtype=scale.dtype)
    return torch.where(scale == 0, eps, scale)


def amax_rows(rows: torch.Tensor) -> torch.Tensor:
    """|max| of each row: [n, 1] (max(-min, max), as calculate_qparams takes it, without an |rows| copy)."""
    return torch.maximum(rows.amax(dim=1, keepdim=True), rows.amin(dim=1, keepdim=True).neg_())


def _blocks(rows: torch.Tensor) -> torch.Tensor:
    """`rows` as [R, 128, C, 128] blocks, zero-padded to whole blocks (a copy only when padding is needed)."""
    bh, bw = BLOCK
    n, cols = rows.shape
    if n % bh or cols % bw:
        rows = torch.nn.functional.pad(rows, (0, -cols % bw, 0, -n % bh))
    return rows.reshape(rows.shape[0] // bh, bh, rows.shape[1] // bw, bw)


def amax_blocks(rows: torch.Tensor) -> torch.Tensor:
    """|max| of each 128x128 block of `rows` (zero-padded to whole blocks): [ceil(n/128), ceil(cols/128)]."""
    blocks = _blocks(rows)
    return torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg_())


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """The scale for a group whose largest magnitude is `amax` (same dtype as the weight)."""
    return _no_zero(amax / _divisor(amax.dtype))


def quantize_rows(rows: torch.Tensor, scale: torch.Tensor, strategy: str) -> torch.Tensor:
    """FP8 values of `rows` ([n, cols]) given their scales: [n, 1] (channel), [ceil(n/128), ceil(cols/128)]
    (block) or [1] (tensor). One temporary of the rows' size (the quotient, clamped in place)."""
    if strategy == "block":
        n, cols = rows.shape
        scaled = _blocks(rows) / scale[:, None, :, None]
        scaled = scaled.reshape(scaled.shape[0] * BLOCK[0], -1)[:n, :cols]
    else:
        scaled = rows / scale
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def quantize(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale) of a whole 2-D weight in memory (the streamed path in `export` does the same per slab)."""
    if strategy == "tensor":
        scale = scale_of(weight.abs().amax().reshape(1))
    elif strategy == "channel":
        scale = scale_of(amax_rows(weight))
    else:
        scale = scale_of(amax_blocks(weight))
    return quantize_rows(weight, scale, strategy), scale

