"""Dtype names without torch: canonical names, item sizes, and the spellings of each format."""

from __future__ import annotations

from .errors import OptionError

# canonical name -> (itemsize, safetensors code, torch legacy storage class name)
_TABLE: dict[str, tuple[int, str, str]] = {
    "float64": (8, "F64", "DoubleStorage"),
    "float32": (4, "F32", "FloatStorage"),
    "float16": (2, "F16", "HalfStorage"),
    "bfloat16": (2, "BF16", "BFloat16Storage"),
    "int64": (8, "I64", "LongStorage"),
    "int32": (4, "I32", "IntStorage"),
    "int16": (2, "I16", "ShortStorage"),
    "int8": (1, "I8", "CharStorage"),
    "uint8": (1, "U8", "ByteStorage"),
    "bool": (1, "BOOL", "BoolStorage"),
    "float8_e4m3fn": (1, "F8_E4M3", "Float8_e4m3fnStorage"),
    "float8_e5m2": (1, "F8_E5M2", "Float8_e5m2Storage"),
    "complex64": (8, "C64", "ComplexFloatStorage"),
    "uint16": (2, "U16", "UInt16Storage"),
    "uint32": (4, "U32", "UInt32Storage"),
    "uint64": (8, "U64", "UInt64Storage"),
}
_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "long": "int64", "int": "int32",
            "fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
CAST_TARGETS = ("float32", "bfloat16", "float16")

_BY_SAFETENSORS = {code: name for name, (_, code, _) in _TABLE.items()}
_BY_STORAGE = {storage: name for name, (_, _, storage) in _TABLE.items()}


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


def to_safetensors(dtype: str) -> str:
    return _TABLE[dtype][1]


def from_safetensors(code: str) -> str:
    try:
        return _BY_SAFETENSORS[code]
    except KeyError:
        raise OptionError(f"unsupported safetensors dtype {code!r}") from None


def from_storage_class(name: str) -> str | None:
    return _BY_STORAGE.get(name)


def storage_class(dtype: str) -> str:
    return _TABLE[dtype][2]


def cast_target(name: str | None) -> str | None:
    """Validate a `--dtype` value: only float32, bfloat16 and float16 are cast targets."""
    if name is None:
        return None
    dtype = canonical(name)
    if dtype not in CAST_TARGETS:
        raise OptionError(f"--dtype {name}: choose one of {', '.join(CAST_TARGETS)}")
    return dtype


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
