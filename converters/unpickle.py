"""Allow-list unpickling: read the pickles inside checkpoints without importing or running their classes.

Every global a pickle names is looked up in an allow-list and replaced by a plain stand-in:
a `Stub` that records constructor arguments and state, or a small function that builds a
value (a dtype name, a tuple, a `TensorRef`). Anything else raises `UnsafePickleError`
naming the class; nothing outside the list is ever imported, and torch is not imported at all.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import dtypes
from .errors import FormatError, UnsafePickleError


class Stub:
    """Stand-in for an allow-listed class: keeps `args` and `state`, runs no code of the original."""

    qualname: str = "Stub"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs
        self.state: Any = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Stub:
        obj = super().__new__(cls)
        obj.args, obj.kwargs, obj.state = args, kwargs, None
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def get(self, name: str, default: Any = None) -> Any:
        """Read a field from the recorded state (a dict, or a (dict, slots) pair)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            slots = state[1]
            if name in slots:
                return slots[name]
            state = state[0]
        if isinstance(state, dict):
            return state.get(name, default)
        return default

    def __repr__(self) -> str:
        return f"<{self.qualname} args={self.args!r} state={self.state!r}>"


_STUB_TYPES: dict[str, type[Stub]] = {}


def stub(qualname: str) -> type[Stub]:
    """The (cached) stand-in class for a fully qualified class name."""
    if qualname not in _STUB_TYPES:
        _STUB_TYPES[qualname] = type(qualname.rsplit(".", 1)[-1], (Stub,), {"qualname": qualname})
    return _STUB_TYPES[qualname]


@dataclass(frozen=True)
class StorageRef:
    """A persistent-id storage reference in a torch.save pickle (the bytes live in `data/<key>`)."""

    key: str
    dtype: str
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor in a torch.save pickle: a strided view into a storage."""

    storage: StorageRef
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def _rebuild_tensor(storage: StorageRef, offset: int, size: Any, stride: Any, *_: Any) -> TensorRef:
    return TensorRef(storage, int(offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    return data


class _Dict(dict):
    """OrderedDict stand-in; BUILD state (e.g. a state dict's `_metadata`) becomes attributes, not items."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


def _path(*parts: Any) -> str:
    return "/".join(str(p) for p in parts).replace("//", "/")


def _dtype_globals() -> dict[str, Any]:
    table: dict[str, Any] = {}
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                 "bool", "float8_e4m3fn", "float8_e5m2", "complex64", "uint16", "uint32", "uint64"):
        table[f"torch.{name}"] = name
        storage = dtypes.storage_class(name)
        table[f"torch.{storage}"] = ("storage-class", name)
    for alias, name in (("float", "float32"), ("half", "float16"), ("double", "float64"),
                        ("long", "int64"), ("int", "int32")):
        table[f"torch.{alias}"] = name
    return table


_DCP = "torch.distributed.checkpoint"

# Globals seen in DCP `.metadata` files and in torch.save pickles of plain tensors.
BASE_ALLOWED: dict[str, Any] = {
    **_dtype_globals(),
    "torch.Size": lambda *a: tuple(a[0]) if a else (),
    "torch.serialization._get_layout": lambda name: str(name),
    "torch.device": lambda *a: ":".join(str(x) for x in a),
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
    "torch._utils._rebuild_tensor_v3": lambda s, o, size, stride, *rest: _rebuild_tensor(s, o, size, stride),
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "collections.OrderedDict": _Dict,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.slice": slice,
    "builtins.complex": complex,
    "_codecs.encode": lambda text, encoding="utf-8": str(text).encode(encoding),
    "pathlib.PosixPath": _path,
    "pathlib.WindowsPath": _path,
    "pathlib.PurePosixPath": _path,
    "pathlib.Path": _path,
    f"{_DCP}.metadata._MEM_FORMAT_ENCODING": lambda value: value,
    **{f"{_DCP}.metadata.{name}": stub(f"{_DCP}.metadata.{name}") for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta")},
    f"{_DCP}.filesystem._StorageInfo": stub(f"{_DCP}.filesystem._StorageInfo"),
}


class AllowListUnpickler(pickle.Unpickler):
    """Unpickler whose globals come only from `allowed`; `source` names the file in errors."""

    def __init__(self, data: bytes, source: str, allowed: dict[str, Any] | None = None,
                 persistent: Callable[[Any], Any] | None = None) -> None:
        super().__init__(io.BytesIO(data))
        self.source = source
        self.allowed = BASE_ALLOWED if allowed is None else allowed
        self.persistent = persistent

    def find_class(self, module: str, name: str) -> Any:
        qualname = f"{module}.{name}"
        if qualname not in self.allowed:
            raise UnsafePickleError(
                f"{self.source}: the pickle references {qualname}, which is not on the allow-list; "
                "refusing to load it (nothing was imported or run). Only load checkpoints you trust "
                "with other tools.")
        return self.allowed[qualname]

    def persistent_load(self, pid: Any) -> Any:
        if self.persistent is None:
            raise FormatError(f"{self.source}: unexpected persistent id in pickle")
        return self.persistent(pid)


def torch_storage_loader(source: str) -> Callable[[Any], StorageRef]:
    """persistent_load for torch.save pickles: ('storage', storage_class, key, location, numel)."""

    def load(pid: Any) -> StorageRef:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise FormatError(f"{source}: unsupported storage reference {pid!r} in torch.save pickle")
        storage_type = pid[1]
        if not (isinstance(storage_type, tuple) and storage_type[0] == "storage-class"):
            raise FormatError(f"{source}: unsupported storage type {storage_type!r}")
        return StorageRef(key=str(pid[2]), dtype=storage_type[1], numel=int(pid[4]))

    return load


def loads(data: bytes, source: str, allowed: dict[str, Any] | None = None,
          persistent: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle `data` with the allow-list; raise FormatError for anything that is not a valid pickle."""
    try:
        return AllowListUnpickler(data, source, allowed, persistent).load()
    except UnsafePickleError:
        raise
    except FormatError:
        raise
    except Exception as exc:
        raise FormatError(f"{source}: not a readable pickle ({type(exc).__name__}: {exc})") from None
