"""Tensor types and bytes as llama.cpp's converter chooses and writes them (conversion/base.py prepare_tensors):

- the output type (`outtype`) f32, f16, bf16 or q8_0 sets general.file_type and the type of the 2-D+ weights;
- 1-D tensors, norms, biases (names not ending in .weight) and the MoE router (ffn_gate_inp) stay F32;
- a Q8_0 tensor whose rows are not whole 32-value blocks falls back to F16, as llama.cpp's converter does;
- the values go through float32 (a float16 source stays float16; bfloat16 is widened by its bits, exact as
  torch's cast) and then gguf-py's own quantizer
  (`gguf.quants.quantize`), one slab of whole rows at a time; Q8_0 blocks lie within a row, so slabbing by rows
  gives the same bytes as the whole tensor at once.
"""

from __future__ import annotations

import gguf
import numpy as np

from ..errors import OptionError

Q = gguf.GGMLQuantizationType
OUTTYPES = {"f32": (Q.F32, gguf.LlamaFileType.ALL_F32), "f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),
            "bf16": (Q.BF16, gguf.LlamaFileType.MOSTLY_BF16), "q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}
FLOATS = ("float32", "float16", "bfloat16", "float64")
_ALWAYS_F32 = (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP, gguf.MODEL_TENSOR.POS_EMBD,
               gguf.MODEL_TENSOR.TOKEN_TYPES)


def outtype(name: str) -> tuple[gguf.GGMLQuantizationType, int]:
    """The tensor type and general.file_type of an `outtype` option."""
    if name not in OUTTYPES:
        raise OptionError(f"outtype {name!r} is not one of {', '.join(OUTTYPES)}", field="outtype", option="outtype")
    qtype, ftype = OUTTYPES[name]
    return qtype, int(ftype)


def _is(arch: gguf.MODEL_ARCH, name: str, key: gguf.MODEL_TENSOR) -> bool:
    if key not in gguf.MODEL_TENSORS[arch]:
        return False
    pattern = gguf.TENSOR_NAMES[key] + ".weight"
    if "{bid}" not in pattern:
        return name == pattern
    head, _, tail = pattern.partition("{bid}")
    middle = name[len(head): len(name) - len(tail)] if name.startswith(head) and name.endswith(tail) else ""
    return middle.isdecimal()


def tensor_type(arch: gguf.MODEL_ARCH, name: str, shape: tuple[int, ...], wanted: gguf.GGMLQuantizationType
                ) -> gguf.GGMLQuantizationType:
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") \
            or any(_is(arch, name, key) for key in _ALWAYS_F32):
        return Q.F32
    if wanted in gguf.GGML_QUANT_SIZES and wanted not in (Q.F32, Q.F16, Q.BF16):
        block = gguf.GGML_QUANT_SIZES[wanted][0]
        if shape[-1] % block:
            return Q.F16  # llama.cpp's converter: QuantError -> "falling back to F16"
    return wanted


def nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    count = 1
    for n in shape:
        count *= n
    return count // block * size


def converted(rows: np.ndarray, dtype: str, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """The GGUF bytes of `rows` (whole rows of the tensor, of source dtype `dtype`; bfloat16 held as uint16) in
    type `qtype`."""
    if dtype == "bfloat16":
        rows = (rows.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif dtype not in ("float16", "float32"):
        rows = rows.astype(np.float32)  # float64: round to nearest even, as torch's .to(float32)
    return gguf.quants.quantize(rows, qtype)


class Converter:
    """`converted`, writing F32 and F16 slabs of a float32 or float16 source into one buffer it reuses (gguf-py's
    quantizer is numpy's cast for those types, so the bytes are the same): no slab-sized allocation per slab, whose
    pages the heap trim between slabs would hand back and fault in again."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)

    def __call__(self, rows: np.ndarray, dtype: str, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
        if qtype not in (Q.F32, Q.F16) or dtype not in ("float32", "float16"):
            return converted(rows, dtype, qtype)
        kind = np.dtype(np.float32 if qtype == Q.F32 else np.float16)
        if rows.dtype == kind:
            return rows
        if self._buffer.nbytes < rows.size * kind.itemsize:
            self._buffer = np.empty(rows.size * kind.itemsize, dtype=np.uint8)
        out = self._buffer[: rows.size * kind.itemsize].view(kind).reshape(rows.shape)
        np.copyto(out, rows, casting="same_kind")
        return out
