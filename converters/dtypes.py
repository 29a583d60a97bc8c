"""Dtype names without torch: canonical names, item sizes, and the spellings of each format.

Covers every dtype whose tensors torch (2.13) saves and loads: the table lists, per dtype, its item
size, its safetensors code (None where `safetensors.torch` cannot hold it) and the legacy typed
storage class torch.save pickles it with (None where torch pickles an `UntypedStorage` plus the
dtype: float8, uint16/32/64, complex32, float4, bits).
"""

from __future__ import annotations

from typing import Literal, get_args

from .errors import FormatError, OptionError, short

# canonical name -> (itemsize, safetensors code, torch legacy storage class name)
_TABLE: dict[str, tuple[int, str | None, str | None]] = {
    "float64": (8, "F64", "DoubleStorage"),
    "float32": (4, "F32", "FloatStorage"),
    "float16": (2, "F16", "HalfStorage"),
    "bfloat16": (2, "BF16", "BFloat16Storage"),
    "complex128": (16, None, "ComplexDoubleStorage"),
    "complex64": (8, "C64", "ComplexFloatStorage"),
    "complex32": (4, None, None),
    "int64": (8, "I64", "LongStorage"),
    "int32": (4, "I32", "IntStorage"),
    "int16": (2, "I16", "ShortStorage"),
    "int8": (1, "I8", "CharStorage"),
    "uint8": (1, "U8", "ByteStorage"),
    "uint16": (2, "U16", None),
    "uint32": (4, "U32", None),
    "uint64": (8, "U64", None),
    "bool": (1, "BOOL", "BoolStorage"),
    "float8_e4m3fn": (1, "F8_E4M3", None),
    "float8_e5m2": (1, "F8_E5M2", None),
    "float8_e4m3fnuz": (1, "F8_E4M3FNUZ", None),
    "float8_e5m2fnuz": (1, "F8_E5M2FNUZ", None),
    "float8_e8m0fnu": (1, None, None),
    "float4_e2m1fn_x2": (1, None, None),
    "bits8": (1, None, None),
    "bits16": (2, None, None),
    "bits1x8": (1, None, None),
    "bits2x4": (1, None, None),
    "bits4x2": (1, None, None),
}
# torch's other attribute names for the same dtypes (`torch.float` is `torch.float32`)
_TORCH_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "long": "int64", "int": "int32",
                  "short": "int16", "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32"}
_ALIASES = {**_TORCH_ALIASES, "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
# dtypes torch.distributed.checkpoint cannot save or load (its planner has no element size for them)
_NOT_IN_DCP = frozenset({"bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"})
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
INTEGER = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool"})
#: every dtype statistics are computed for (`converters.stats`; the others, complex and packed sub-byte types, are
#: listed as skipped): named here, without numpy, so a conversion decides what to count before it imports it
WITH_STATISTICS = frozenset({*FLOATING, "float8_e4m3fnuz", "float8_e5m2fnuz", *INTEGER})
#: the dtypes a conversion casts floating-point tensors to, declared once as a type (the service's option)
CastTarget = Literal["float32", "bfloat16", "float16"]
CAST_TARGETS: tuple[str, ...] = get_args(CastTarget)

_BY_SAFETENSORS = {code: name for name, (_, code, _) in _TABLE.items() if code}


def names() -> list[str]:
    """Every canonical dtype name."""
    return list(_TABLE)


def spellings() -> dict[str, str]:
    """Every `torch.<name>` attribute spelling of a dtype -> its canonical name."""
    return {**{name: name for name in _TABLE}, **_TORCH_ALIASES}


def canonical(name: str) -> str:
    """Return the canonical dtype name for `name` ("torch.float32", "fp32", "F32" all give "float32")."""
    key = name.removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key in _TABLE:
        return key
    if name in _BY_SAFETENSORS:
        return _BY_SAFETENSORS[name]
    raise OptionError(f"unknown dtype {name!r}; known: {', '.join(_TABLE)}")


def itemsize(dtype: str) -> int:
    return _TABLE[dtype][0]


def to_safetensors(dtype: str, name: str = "") -> str:
    """The safetensors code of `dtype`; a one-line refusal naming the tensor where safetensors has none."""
    code = _TABLE[dtype][1]
    if code is None:
        what = f"tensor {name!r} is {dtype}" if name else f"{dtype}"
        raise OptionError(f"{what}, which safetensors cannot hold; leave it out (`exclude`) or convert "
                          "`to` torch instead")
    return code


# the order `safetensors` lays tensors out in a file: by this rank of the dtype code (highest first), then by
# name; it puts 8-byte items first, so every tensor starts aligned to its item size
_SAFETENSORS_RANK = {code: rank for rank, code in enumerate(
    ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32",
     "U32", "F32", "C64", "F64", "I64", "U64"))}


def safetensors_order(dtype: str, name: str) -> tuple[int, str]:
    """Sort key that puts tensors in the order `safetensors.torch.save_file` writes them."""
    return -_SAFETENSORS_RANK.get(_TABLE[dtype][1] or "", -1), name


def check_dcp(dtype: str, name: str) -> None:
    """Refuse, naming the tensor, a dtype that torch.distributed.checkpoint cannot load."""
    if dtype in _NOT_IN_DCP:
        raise OptionError(f"tensor {name!r} is {dtype}, which torch.distributed.checkpoint cannot load; leave it "
                          "out (`exclude`) or convert `to` torch instead")


def from_safetensors(code: object, path: str, key: str | None = None) -> str:
    """The dtype of a safetensors header code read from `path` (entry `key`); a code we do not know means
    the file is damaged (or newer than this reader): a FormatError naming the file and the entry."""
    if isinstance(code, str) and code in _BY_SAFETENSORS:
        return _BY_SAFETENSORS[code]
    where = f"{path} ({key!r})" if key is not None else path
    raise FormatError(f"{where}: unsupported dtype {short(code)}", uri=path, key=key)


def storage_class(dtype: str) -> str | None:
    """The legacy typed storage class torch.save pickles `dtype` with, or None (UntypedStorage + dtype)."""
    return _TABLE[dtype][2]


def cast_target(name: str | None) -> str | None:
    """Validate a `--dtype` value: only float32, bfloat16 and float16 are cast targets."""
    if name is None:
        return None
    dtype = canonical(name)
    if dtype not in CAST_TARGETS:
        raise OptionError(f"dtype {name}: choose one of {', '.join(CAST_TARGETS)}", option="dtype")
    return dtype


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a contiguous (row-major) tensor of `shape`."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= size
    return tuple(reversed(out))


def is_row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a view of `shape` with `stride` is contiguous (dimensions of size 1 may have any stride)."""
    expected = 1
    for size, st in zip(reversed(shape), reversed(stride)):
        if size != 1 and st != expected:
            return False
        expected *= size
    return True


def strided_span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """How many storage elements a view of `shape` with `stride` reaches, from its first to its last (0 if empty)."""
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
