"""The values the closed unpickler builds: stand-ins for torch's classes, and the argument checks.

Nothing here imports or runs what a pickle names: a `Token` is an allow-listed name as data, a `Stub`
records the state a class would have received, `TensorRef`/`StorageRef` locate tensor bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import dtypes


class Stub:
    """Stand-in for an allow-listed class: keeps `args` and `state`, runs no code of the original."""

    qualname: str = "Stub"
    state_kind: str = "mapping"  # "mapping": a dict or a (dict | None, dict) slots pair; "tuple": also a tuple

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

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

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in ("args", "state"):
            raise AttributeError(name)
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"<{self.qualname} args={self.args!r} state={self.state!r}>"


_STUB_TYPES: dict[str, type[Stub]] = {}


def stub(qualname: str, state_kind: str = "mapping") -> type[Stub]:
    """The (cached) stand-in class for a fully qualified class name; call only with fixed names."""
    if qualname not in _STUB_TYPES:
        _STUB_TYPES[qualname] = type(qualname.rsplit(".", 1)[-1], (Stub,),
                                     {"qualname": qualname, "state_kind": state_kind, "__slots__": ()})
    return _STUB_TYPES[qualname]


class OrderedDictStub(dict):
    """OrderedDict stand-in; BUILD state (a state dict's `_metadata`) goes to `attrs`, never to attributes."""

    __slots__ = ("attrs",)

    def __init__(self) -> None:
        super().__init__()
        self.attrs: dict[str, Any] = {}


@dataclass(frozen=True)
class OpaqueBytes:
    """An `io.BytesIO` value (e.g. torchtitan's TrainState): its bytes, carried as-is and never unpickled."""

    data: bytes
    position: int = 0


class DType(str):
    """A `torch.<dtype>` global, as its canonical name."""


class Device(str):
    """A `torch.device(...)` value, as its string ("cpu", "cuda:0")."""


class Size(tuple):
    """A `torch.Size(...)` value."""


@dataclass(frozen=True)
class StorageRef:
    """A persistent-id storage reference in a torch.save pickle (the bytes live in `data/<key>`).

    `dtype` is None for an `UntypedStorage` until a tensor gives it one; `numel` counts elements of
    `dtype` (bytes while untyped)."""

    key: str
    dtype: str | None
    numel: int
    location: str = "cpu"


@dataclass(frozen=True)
class TensorRef:
    """A tensor in a torch.save pickle: a strided view into a storage."""

    storage: StorageRef
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype or "uint8"

    def is_contiguous(self) -> bool:
        return dtypes.is_row_major(self.shape, self.stride)


@dataclass(frozen=True)
class Wrapped:
    """A tensor subclass instance (ShardedTensor, DTensor) as `_rebuild_from_type_v2` describes it."""

    kind: str
    args: tuple
    state: Any


@dataclass(frozen=True, eq=False)
class Token:
    """An allow-listed global on the pickle stack: a name plus the handlers that may use it.

    `call` handles REDUCE, `new` handles NEWOBJ (each gets the argument tuple and returns the value);
    `kind` marks tokens that other handlers accept as arguments ("tensor-type", "subclass", "storage")."""

    qualname: str
    call: Callable[[tuple], Any] | None = None
    new: Callable[[tuple], Any] | None = None
    kind: str = ""
    dtype: str | None = None  # storage classes: the dtype they hold (None for UntypedStorage)

    def __repr__(self) -> str:
        return self.qualname


class Bad(Exception):
    """Raised by handlers for arguments of the wrong type; becomes a FormatError naming the file."""


# ---------------------------------------------------------------------------------------------- type checks

_INT64 = 1 << 63
MAX_DIMS = 64


def check_int(value: Any, what: str, low: int = 0) -> int:
    if type(value) is not int or not low <= value < _INT64:
        raise Bad(f"{what} must be an int >= {low}, got {describe(value)}")
    return value


def check_ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) in (tuple, Size) and len(value) <= MAX_DIMS and all(
            type(v) is int and 0 <= v < _INT64 for v in value):
        return tuple(value)
    if type(value) not in (tuple, Size, list) or len(value) > MAX_DIMS:
        raise Bad(f"{what} must be a tuple of at most {MAX_DIMS} ints, got {describe(value)}")
    return tuple(check_int(v, what) for v in value)


def check_bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise Bad(f"{what} must be a bool, got {describe(value)}")
    return value


def check_str(value: Any, what: str, pattern: str | None = None) -> str:
    if not isinstance(value, str) or len(value) > 4096 or (pattern and not re.fullmatch(pattern, value)):
        raise Bad(f"{what} must be a string{f' like {pattern}' if pattern else ''}, got {describe(value)}")
    return str(value)


def check_args(args: tuple, name: str, low: int, high: int) -> None:
    if not low <= len(args) <= high:
        count = str(low) if low == high else f"{low} to {high}"
        raise Bad(f"{name} takes {count} arguments, got {len(args)}")


def describe(value: Any) -> str:
    text = repr(value) if isinstance(value, int | float | bool | str | type(None)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


_HASH_SAFE = 1 << 52  # ints and floats below this never share a hash with another number


def hashable(key: Any) -> bool:
    """Keys and set elements: immutable, and not numbers crafted to collide (hash flooding makes dicts quadratic)."""
    kind = type(key)
    if kind in (str, bool, type(None), bytes, DType, Device) or isinstance(key, Stub | TensorRef):
        return True
    if kind is int:
        return -_HASH_SAFE < key < _HASH_SAFE
    if kind is float:
        return -_HASH_SAFE < key < _HASH_SAFE or key != key
    if kind in (tuple, Size, frozenset):
        return all(hashable(k) for k in key)
    return False


class BytesIOBuilder:
    """`io.BytesIO()` between NEWOBJ and its BUILD; becomes an `OpaqueBytes` when BUILD sets its state."""

    __slots__ = ("args",)

    def __init__(self, args: tuple) -> None:
        if args:
            raise Bad("io.BytesIO is created without arguments in pickles")
        self.args = args


def _build_bytesio(state: Any) -> OpaqueBytes:
    if not (type(state) is tuple and len(state) == 3 and type(state[0]) in (bytes, bytearray)
            and type(state[1]) is int and state[1] >= 0 and (state[2] is None or type(state[2]) is dict)):
        raise Bad(f"io.BytesIO state must be (bytes, position, dict | None), got {describe(state)}")
    if state[2]:
        raise Bad("io.BytesIO with extra attributes is not supported")
    return OpaqueBytes(bytes(state[0]), state[1])


def build_state(inst: Any, state: Any) -> Any:
    """BUILD: set the state of a fresh stand-in, once, with the types torch writes. Returns the object."""
    if type(inst) is BytesIOBuilder:
        return _build_bytesio(state)
    if type(inst) is OrderedDictStub:
        if type(state) is not dict or not all(isinstance(k, str) for k in state) or inst.attrs:
            raise Bad(f"OrderedDict state must be set once, as a dict of attributes, got {describe(state)}")
        inst.attrs = state
        return inst
    if isinstance(inst, Stub) and type(inst) is not Stub:
        if inst.state is not None:
            raise Bad(f"{inst.qualname}: state is set twice")
        ok = (type(state) is dict and all(isinstance(k, str) for k in state)) or (
            type(state) is tuple and len(state) == 2 and (state[0] is None or type(state[0]) is dict)
            and type(state[1]) is dict and all(isinstance(k, str) for k in state[1]))
        if inst.state_kind == "tuple":  # a `__getstate__` tuple (TensorProperties), or a dataclass dict as before
            ok = ok or type(state) is tuple
        if not ok:
            raise Bad(f"{inst.qualname}: state must be a {inst.state_kind}, got {describe(state)}")
        inst.state = state
        return inst
    raise Bad(f"BUILD on {describe(inst)}: only the state of tensors' and known classes' stand-ins can be set")
