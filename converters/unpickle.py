"""A closed pickle interpreter: read the pickles inside checkpoints without importing or running anything.

The interpreter executes only the opcodes that torch.save, DCP and Python's pickler emit for state
dicts. A global the pickle names is looked up in an allow-list and pushed as a `Token` (plain data,
never the named object); a token can only be called (REDUCE/NEWOBJ) through a handler that checks
its argument types and builds a stand-in: a `Stub` that records state, a `TensorRef`, a dtype name.
Nothing outside the list is ever imported, and torch is not imported at all.

Closed means: no opcode can change an allow-listed global or an object that is already referenced
elsewhere. APPEND/SETITEM/ADDITEMS only fill a list/dict/set that was never fetched from the memo;
BUILD only sets the state of a fresh stand-in (`Stub`, the OrderedDict stand-in, `OpaqueBytes`)
once, with the state types torch writes. Every resource is bounded (`PickleLimits`): pickle bytes,
memo entries, objects built, elements reached again through shared references (so a
"billion laughs" pickle fails at once, and any later walk over the result is bounded), and nesting
depth. Every refusal is a `FormatError` (`UnsafePickleError` for a name off the list) naming the file.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from . import dtypes
from .errors import FormatError, UnsafePickleError

# ---------------------------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class PickleLimits:
    """Bounds on one pickle; each can be raised with its environment variable (`CKPT_MAX_PICKLE_*`)."""

    max_bytes: int = 1 << 30  # CKPT_MAX_PICKLE_BYTES: size of one pickle
    max_memo: int = 20_000_000  # CKPT_MAX_PICKLE_MEMO: memo entries
    max_objects: int = 100_000_000  # CKPT_MAX_PICKLE_OBJECTS: objects built
    max_shared: int = 10_000_000  # CKPT_MAX_PICKLE_SHARED: elements reached again through shared references
    max_depth: int = 100  # CKPT_MAX_PICKLE_DEPTH: nesting depth of containers and MARKs


_ENV = {"max_bytes": "CKPT_MAX_PICKLE_BYTES", "max_memo": "CKPT_MAX_PICKLE_MEMO",
        "max_objects": "CKPT_MAX_PICKLE_OBJECTS", "max_shared": "CKPT_MAX_PICKLE_SHARED",
        "max_depth": "CKPT_MAX_PICKLE_DEPTH"}
_overrides: dict[str, int] = {}


def set_limits(**values: int) -> PickleLimits:
    """Override limits for this process (e.g. `set_limits(max_depth=500)`); returns the limits now in force."""
    for key, value in values.items():
        if key not in _ENV or not isinstance(value, int) or value < 1:
            raise ValueError(f"unknown or invalid pickle limit {key}={value!r}")
    _overrides.update(values)
    return limits()


def limits() -> PickleLimits:
    """The limits in force: `set_limits` overrides, then the environment, then the defaults."""
    values: dict[str, int] = {}
    for key, var in _ENV.items():
        raw = os.environ.get(var)
        if raw:
            try:
                values[key] = int(raw)
            except ValueError:
                raise FormatError(f"{var}={raw!r}: not an integer") from None
    values.update(_overrides)
    return replace(PickleLimits(), **values)


# ---------------------------------------------------------------------------------------------- stand-ins


class Stub:
    """Stand-in for an allow-listed class: keeps `args` and `state`, runs no code of the original."""

    qualname: str = "Stub"
    state_kind: str = "mapping"  # "mapping": a dict or a (dict | None, dict) slots pair; "tuple": a tuple

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
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


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
        raise Bad(f"{what} must be an int >= {low}, got {_describe(value)}")
    return value


def check_ints(value: Any, what: str) -> tuple[int, ...]:
    if type(value) not in (tuple, Size, list) or len(value) > MAX_DIMS:
        raise Bad(f"{what} must be a tuple of at most {MAX_DIMS} ints, got {_describe(value)}")
    return tuple(check_int(v, what) for v in value)


def check_bool(value: Any, what: str) -> bool:
    if type(value) is not bool:
        raise Bad(f"{what} must be a bool, got {_describe(value)}")
    return value


def check_str(value: Any, what: str, pattern: str | None = None) -> str:
    if not isinstance(value, str) or len(value) > 4096 or (pattern and not re.fullmatch(pattern, value)):
        raise Bad(f"{what} must be a string{f' like {pattern}' if pattern else ''}, got {_describe(value)}")
    return str(value)


def check_args(args: tuple, name: str, low: int, high: int) -> None:
    if not low <= len(args) <= high:
        count = str(low) if low == high else f"{low} to {high}"
        raise Bad(f"{name} takes {count} arguments, got {len(args)}")


def _describe(value: Any) -> str:
    text = repr(value) if isinstance(value, int | float | bool | str | type(None)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _empty_hooks(value: Any, name: str) -> None:
    if type(value) not in (OrderedDictStub, dict) or value:
        raise Bad(f"{name}: backward hooks must be an empty OrderedDict, got {_describe(value)}")


def _no_metadata(rest: tuple, name: str) -> None:
    if rest and rest[0]:
        raise Bad(f"{name}: tensor metadata {rest[0]!r} (e.g. a conjugate or negative bit) is not supported; "
                  "call resolve_conj()/resolve_neg() before saving")


# ---------------------------------------------------------------------------------------------- handlers


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, name: str) -> TensorRef:
    if not isinstance(storage, StorageRef) or storage.dtype is None:
        raise Bad(f"{name}: the storage argument must be a typed storage reference, got {_describe(storage)}")
    offset = check_int(offset, f"{name}: storage offset")
    shape, strides = check_ints(size, f"{name}: size"), check_ints(stride, f"{name}: stride")
    if len(shape) != len(strides):
        raise Bad(f"{name}: size {list(shape)} and stride {list(strides)} differ in length")
    span = 1 + sum((s - 1) * st for s, st in zip(shape, strides)) if all(shape) else 0
    if offset + span > storage.numel:
        raise Bad(f"{name}: a {list(shape)} view at offset {offset} reaches past its storage of "
                  f"{storage.numel} elements")
    return TensorRef(storage, offset, shape, strides)


def rebuild_tensor_v2(args: tuple) -> TensorRef:
    name = "torch._utils._rebuild_tensor_v2"
    check_args(args, name, 6, 7)
    check_bool(args[4], f"{name}: requires_grad")
    _empty_hooks(args[5], name)
    _no_metadata(args[6:], name)
    return _tensor(args[0], args[1], args[2], args[3], name)


def rebuild_tensor_v3(args: tuple) -> TensorRef:
    name = "torch._utils._rebuild_tensor_v3"
    check_args(args, name, 7, 8)
    storage, dtype = args[0], args[6]
    if not isinstance(storage, StorageRef) or storage.dtype is not None:
        raise Bad(f"{name}: the storage argument must be an UntypedStorage reference, got {_describe(storage)}")
    if type(dtype) is not DType:
        raise Bad(f"{name}: dtype must be a torch dtype, got {_describe(dtype)}")
    check_bool(args[4], f"{name}: requires_grad")
    _empty_hooks(args[5], name)
    _no_metadata(args[7:], name)
    item = dtypes.itemsize(dtype)
    if storage.numel % item:
        raise Bad(f"{name}: an UntypedStorage of {storage.numel} bytes cannot hold {dtype} elements")
    typed = replace(storage, dtype=str(dtype), numel=storage.numel // item)
    return _tensor(typed, args[1], args[2], args[3], name)


def _state(value: Any, name: str) -> Any:
    """Python state of a tensor (its `__dict__`, or a (dict, slots) pair): checked, then ignored."""
    if value is None or (type(value) is dict and all(isinstance(k, str) for k in value)):
        return value
    if (type(value) is tuple and len(value) == 2 and (value[0] is None or type(value[0]) is dict)
            and type(value[1]) is dict):
        return value
    raise Bad(f"{name}: tensor state must be a dict, got {_describe(value)}")


def rebuild_from_type_v2(args: tuple) -> Any:
    name = "torch._tensor._rebuild_from_type_v2"
    check_args(args, name, 4, 4)
    func, new_type, func_args, state = args
    if not isinstance(new_type, Token) or new_type.kind not in ("tensor-type", "subclass"):
        raise Bad(f"{name}: the type argument must be torch.Tensor, Parameter or a known subclass, "
                  f"got {_describe(new_type)}")
    if not isinstance(func, Token) or func.kind != ("rebuild" if new_type.kind == "tensor-type" else "wrapper"):
        raise Bad(f"{name}: cannot rebuild a {new_type.qualname} with {_describe(func)}")
    if type(func_args) is not tuple:
        raise Bad(f"{name}: arguments must be a tuple, got {_describe(func_args)}")
    assert func.call is not None
    value = func.call(func_args)
    if new_type.kind == "subclass":
        if state is not None and type(state) not in (dict, tuple):
            raise Bad(f"{name}: {new_type.qualname} state must be a dict or tuple, got {_describe(state)}")
        return Wrapped(new_type.qualname, value, state)
    _state(state, name)
    return value


def rebuild_parameter(args: tuple) -> TensorRef:
    name = "torch._utils._rebuild_parameter"
    check_args(args, name, 3, 4)
    if not isinstance(args[0], TensorRef):
        raise Bad(f"{name}: data must be a tensor, got {_describe(args[0])}")
    check_bool(args[1], f"{name}: requires_grad")
    _empty_hooks(args[2], name)
    if len(args) == 4:
        _state(args[3], name)
    return args[0]


def _size(args: tuple) -> Size:
    check_args(args, "torch.Size", 0, 1)
    return Size(check_ints(args[0], "torch.Size") if args else ())


def _device(args: tuple) -> Device:
    check_args(args, "torch.device", 1, 2)
    kind = check_str(args[0], "torch.device type", r"[a-z_]{1,16}(:\d{1,6})?")
    if len(args) == 2:
        return Device(f"{kind}:{check_int(args[1], 'torch.device index')}")
    return Device(kind)


def _layout(args: tuple) -> str:
    check_args(args, "torch.serialization._get_layout", 1, 1)
    return check_str(args[0], "layout", r"torch\.(strided|sparse_coo|sparse_csr|sparse_csc|sparse_bsr|sparse_bsc|"
                                        r"_mkldnn|jagged)")


def _ordered_dict(args: tuple) -> OrderedDictStub:
    if args:
        raise Bad(f"collections.OrderedDict takes no arguments here, got {len(args)}")
    return OrderedDictStub()


def _encode(args: tuple) -> bytes:
    check_args(args, "_codecs.encode", 1, 2)
    text = args[0]
    encoding = args[1] if len(args) == 2 else "utf-8"
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise Bad(f"_codecs.encode takes a string and latin1/utf-8, got {_describe(text)}, {_describe(encoding)}")
    return text.encode(encoding)


def _items(args: tuple, name: str) -> list:
    check_args(args, name, 0, 1)
    if args and type(args[0]) not in (list, tuple):
        raise Bad(f"{name} takes a list, got {_describe(args[0])}")
    return list(args[0]) if args else []


def _bytearray(args: tuple) -> bytearray:
    check_args(args, "builtins.bytearray", 0, 1)
    if args and type(args[0]) is not bytes:
        raise Bad(f"builtins.bytearray takes bytes, got {_describe(args[0])}")
    return bytearray(args[0] if args else b"")


def _complex(args: tuple) -> complex:
    check_args(args, "builtins.complex", 1, 2)
    if not all(type(a) in (int, float) for a in args):
        raise Bad("builtins.complex takes numbers")
    return complex(*args)


def _path(args: tuple) -> str:
    if not all(isinstance(a, str) for a in args):
        raise Bad("pathlib paths take strings")
    return "/".join(args).replace("//", "/")


def enum_int(name: str) -> Callable[[tuple], int]:
    def make(args: tuple) -> int:
        check_args(args, name, 1, 1)
        return check_int(args[0], name)

    return make


def stub_token(qualname: str, state_kind: str = "mapping", kind: str = "") -> Token:
    """A class stand-in that NEWOBJ instantiates (arguments kept as plain data)."""
    cls = stub(qualname, state_kind)
    return Token(qualname, new=lambda args: cls(*args), kind=kind)


def _storage_tokens() -> dict[str, Token]:
    table = {"torch.storage.UntypedStorage": Token("torch.storage.UntypedStorage", kind="storage")}
    for dtype in dtypes.names():
        storage = dtypes.storage_class(dtype)
        if storage:
            table[f"torch.{storage}"] = Token(f"torch.{storage}", kind="storage", dtype=dtype)
    return table


def _dtype_values() -> dict[str, Any]:
    return {f"torch.{alias}": DType(name) for alias, name in dtypes.spellings().items()}


_DCP = "torch.distributed.checkpoint"

# Globals of DCP `.metadata` files and of torch.save pickles of plain state dicts: what
# torch.load(weights_only=True) accepts from honest checkpoints (torch 2.4 and later).
# A value that is not a Token is pushed as-is (dtype names).
BASE_ALLOWED: dict[str, Any] = {
    **_dtype_values(),
    **_storage_tokens(),
    "torch.Tensor": Token("torch.Tensor", kind="tensor-type"),
    "torch.nn.parameter.Parameter": Token("torch.nn.parameter.Parameter", kind="tensor-type"),
    "torch._utils._rebuild_tensor_v2": Token("torch._utils._rebuild_tensor_v2", rebuild_tensor_v2, kind="rebuild"),
    "torch._utils._rebuild_tensor_v3": Token("torch._utils._rebuild_tensor_v3", rebuild_tensor_v3, kind="rebuild"),
    "torch._utils._rebuild_parameter": Token("torch._utils._rebuild_parameter", rebuild_parameter),
    "torch._utils._rebuild_parameter_with_state": Token("torch._utils._rebuild_parameter_with_state",
                                                        rebuild_parameter),
    "torch._tensor._rebuild_from_type_v2": Token("torch._tensor._rebuild_from_type_v2", rebuild_from_type_v2),
    "torch.Size": Token("torch.Size", _size),
    "torch.device": Token("torch.device", _device),
    "torch.serialization._get_layout": Token("torch.serialization._get_layout", _layout),
    "collections.OrderedDict": Token("collections.OrderedDict", _ordered_dict),
    "builtins.set": Token("builtins.set", lambda a: set(_items(a, "builtins.set"))),
    "builtins.frozenset": Token("builtins.frozenset", lambda a: frozenset(_items(a, "builtins.frozenset"))),
    "builtins.bytearray": Token("builtins.bytearray", _bytearray),
    "builtins.complex": Token("builtins.complex", _complex),
    "_codecs.encode": Token("_codecs.encode", _encode),
    "_io.BytesIO": Token("_io.BytesIO", new=lambda args: _BytesIOBuilder(args), kind="bytesio"),
    **{f"pathlib.{name}": Token(f"pathlib.{name}", _path)
       for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")},
    f"{_DCP}.metadata._MEM_FORMAT_ENCODING": Token(f"{_DCP}.metadata._MEM_FORMAT_ENCODING",
                                                   enum_int("_MEM_FORMAT_ENCODING")),
    f"{_DCP}.metadata.TensorProperties": stub_token(f"{_DCP}.metadata.TensorProperties", "tuple"),
    **{f"{_DCP}.metadata.{name}": stub_token(f"{_DCP}.metadata.{name}") for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
        "StorageMeta")},
    f"{_DCP}.filesystem._StorageInfo": stub_token(f"{_DCP}.filesystem._StorageInfo"),
}


class _BytesIOBuilder:
    """`io.BytesIO()` between NEWOBJ and its BUILD; becomes an `OpaqueBytes` when BUILD sets its state."""

    __slots__ = ("args",)

    def __init__(self, args: tuple) -> None:
        if args:
            raise Bad("io.BytesIO is created without arguments in pickles")
        self.args = args


def _build_bytesio(state: Any) -> OpaqueBytes:
    if not (type(state) is tuple and len(state) == 3 and type(state[0]) in (bytes, bytearray)
            and type(state[1]) is int and state[1] >= 0 and (state[2] is None or type(state[2]) is dict)):
        raise Bad(f"io.BytesIO state must be (bytes, position, dict | None), got {_describe(state)}")
    if state[2]:
        raise Bad("io.BytesIO with extra attributes is not supported")
    return OpaqueBytes(bytes(state[0]), state[1])


def _build(inst: Any, state: Any) -> Any:
    """BUILD: set the state of a fresh stand-in, once, with the types torch writes. Returns the object."""
    if type(inst) is _BytesIOBuilder:
        return _build_bytesio(state)
    if type(inst) is OrderedDictStub:
        if type(state) is not dict or not all(isinstance(k, str) for k in state) or inst.attrs:
            raise Bad(f"OrderedDict state must be set once, as a dict of attributes, got {_describe(state)}")
        inst.attrs = state
        return inst
    if isinstance(inst, Stub) and type(inst) is not Stub:
        if inst.state is not None:
            raise Bad(f"{inst.qualname}: state is set twice")
        if inst.state_kind == "tuple":
            ok = type(state) is tuple
        else:
            ok = (type(state) is dict and all(isinstance(k, str) for k in state)) or (
                type(state) is tuple and len(state) == 2 and (state[0] is None or type(state[0]) is dict)
                and type(state[1]) is dict and all(isinstance(k, str) for k in state[1]))
        if not ok:
            raise Bad(f"{inst.qualname}: state must be a {inst.state_kind}, got {_describe(state)}")
        inst.state = state
        return inst
    raise Bad(f"BUILD on {_describe(inst)}: only the state of tensors' and known classes' stand-ins can be set")


# ---------------------------------------------------------------------------------------------- interpreter

_MUTABLE = (list, dict, set, OrderedDictStub)
_HASHABLE_ATOMS = (str, int, float, bool, type(None), bytes, DType, Device, complex)


_PY2_MODULES = {"__builtin__": "builtins"}  # protocol 2 spells builtins the Python 2 way


class _Mark:
    __slots__ = ()


class Interpreter:
    """Run one pickle over the closed opcode set; `load()` returns the object."""

    def __init__(self, data: bytes, source: str, allowed: dict[str, Any] | None = None,
                 persistent: Callable[[Any], Any] | None = None, bounds: PickleLimits | None = None) -> None:
        self.bounds = bounds or limits()
        if len(data) > self.bounds.max_bytes:
            raise FormatError(f"{source}: pickle of {len(data)} bytes is larger than the limit of "
                              f"{self.bounds.max_bytes} (raise CKPT_MAX_PICKLE_BYTES if the file is trusted)")
        self.data = memoryview(data)
        self.source = source
        self.allowed = BASE_ALLOWED if allowed is None else allowed
        self.persistent = persistent
        self.pos = 0
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.built = 0
        self.shared = 0
        self.info: dict[int, tuple[int, int]] = {}  # id -> (weight, depth) of every container-like object
        self.keep: list[Any] = []  # keeps those objects alive, so their ids stay theirs
        self.sealed: set[int] = set()  # ids of objects fetched from the memo: never mutated again
        self.builders: dict[int, list[int]] = {}  # io.BytesIO stand-ins awaiting BUILD -> their memo keys
        self.ops: dict[int, Callable[[], Any]] = {}
        for code, method in _OPS.items():
            self.ops[code] = getattr(self, method)

    # -- errors and limits

    def fail(self, message: str) -> FormatError:
        return FormatError(f"{self.source}: {message} (pickle byte {self.pos}); the file is damaged or crafted, "
                           "refusing to load it")

    def _limit(self, what: str, limit: int, var: str) -> FormatError:
        return FormatError(f"{self.source}: the pickle has more than {limit} {what}; refusing to load it "
                           f"(raise {var} if the file is trusted)")

    def weigh(self, obj: Any, children: Any) -> Any:
        """Record the weight (nodes a walk visits) and depth of a new container-like object."""
        weight, depth = 1, 0
        info = self.info
        for child in children:
            w, d = info.get(id(child), (1, 0))
            weight += w
            if d > depth:
                depth = d
        depth += 1
        if depth > self.bounds.max_depth:
            raise self._limit("levels of nesting", self.bounds.max_depth, "CKPT_MAX_PICKLE_DEPTH")
        info[id(obj)] = (weight, depth)
        self.keep.append(obj)
        return obj

    def grow(self, obj: Any, children: Any) -> None:
        """Add children to the recorded weight and depth of a container being filled."""
        weight, depth = self.info.get(id(obj), (1, 1))
        info = self.info
        for child in children:
            w, d = info.get(id(child), (1, 0))
            weight += w
            if d + 1 > depth:
                depth = d + 1
        if depth > self.bounds.max_depth:
            raise self._limit("levels of nesting", self.bounds.max_depth, "CKPT_MAX_PICKLE_DEPTH")
        info[id(obj)] = (weight, depth)

    def push(self, obj: Any) -> None:
        self.built += 1
        if self.built > self.bounds.max_objects:
            raise self._limit("objects", self.bounds.max_objects, "CKPT_MAX_PICKLE_OBJECTS")
        self.stack.append(obj)

    def new_container(self, obj: Any) -> None:
        self.push(obj)
        self.info[id(obj)] = (1, 1)
        self.keep.append(obj)

    # -- reading

    def read(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise self.fail("truncated pickle")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def unpack(self, fmt: str, size: int) -> Any:
        return struct.unpack(fmt, self.read(size))[0]

    def pop(self) -> Any:
        if not self.stack:
            raise self.fail("stack underflow")
        return self.stack.pop()

    def top(self) -> Any:
        if not self.stack:
            raise self.fail("stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[Any]:
        if not self.marks:
            raise self.fail("no MARK")
        items = self.stack
        self.stack = self.marks.pop()
        return items

    def load(self) -> Any:
        data, ops = self.data, self.ops
        try:
            while True:
                if self.pos >= len(data):
                    raise self.fail("pickle ends without STOP")
                code = data[self.pos]
                self.pos += 1
                op = ops.get(code)
                if op is None:
                    raise self.fail(f"unsupported pickle opcode 0x{code:02x}")
                if op():
                    break
        except Bad as exc:
            raise self.fail(str(exc)) from None
        except RecursionError:
            raise self._limit("levels of nesting", self.bounds.max_depth, "CKPT_MAX_PICKLE_DEPTH") from None
        except MemoryError:
            raise FormatError(f"{self.source}: the pickle needs more memory than is available; refusing it") from None
        if len(self.stack) != 1 or self.marks:
            raise self.fail("pickle leaves extra items on its stack")
        result = self.stack[0]
        self.check_value(result)
        return result

    def check_value(self, obj: Any) -> None:
        if isinstance(obj, Token | _BytesIOBuilder | _Mark):
            raise Bad(f"{_describe(obj)} is left uncalled")

    # -- opcodes

    def op_proto(self) -> None:
        if self.read(1)[0] > 5:
            raise self.fail("unknown pickle protocol")

    def op_frame(self) -> None:
        self.read(8)

    def op_stop(self) -> bool:
        return True

    def op_mark(self) -> None:
        if len(self.marks) >= self.bounds.max_depth:
            raise self._limit("levels of nesting", self.bounds.max_depth, "CKPT_MAX_PICKLE_DEPTH")
        self.marks.append(self.stack)
        self.stack = []

    def op_pop(self) -> None:
        self.pop()

    def op_pop_mark(self) -> None:
        self.pop_mark()

    def op_none(self) -> None:
        self.push(None)

    def op_true(self) -> None:
        self.push(True)

    def op_false(self) -> None:
        self.push(False)

    def op_binint(self) -> None:
        self.push(self.unpack("<i", 4))

    def op_binint1(self) -> None:
        self.push(self.read(1)[0])

    def op_binint2(self) -> None:
        self.push(self.unpack("<H", 2))

    def op_long1(self) -> None:
        self.push(int.from_bytes(self.read(self.read(1)[0]), "little", signed=True))

    def op_long4(self) -> None:
        n = self.unpack("<i", 4)
        if not 0 <= n <= 64:
            raise self.fail("integer too long")
        self.push(int.from_bytes(self.read(n), "little", signed=True))

    def op_binfloat(self) -> None:
        self.push(self.unpack(">d", 8))

    def _text(self, n: int) -> None:
        try:
            self.push(str(self.read(n), "utf-8", "surrogatepass"))
        except UnicodeDecodeError:
            raise self.fail("string is not UTF-8") from None

    def op_short_binunicode(self) -> None:
        self._text(self.read(1)[0])

    def op_binunicode(self) -> None:
        self._text(self.unpack("<I", 4))

    def op_binunicode8(self) -> None:
        self._text(self.unpack("<Q", 8))

    def op_short_binstring(self) -> None:
        try:
            self.push(str(self.read(self.read(1)[0]), "ascii"))
        except UnicodeDecodeError:
            raise self.fail("string is not ASCII") from None

    def op_short_binbytes(self) -> None:
        self.push(bytes(self.read(self.read(1)[0])))

    def op_binbytes(self) -> None:
        self.push(bytes(self.read(self.unpack("<I", 4))))

    def op_binbytes8(self) -> None:
        self.push(bytes(self.read(self.unpack("<Q", 8))))

    def op_bytearray8(self) -> None:
        self.push(bytearray(self.read(self.unpack("<Q", 8))))

    def _tuple(self, items: list[Any]) -> None:
        for item in items:
            if isinstance(item, _BytesIOBuilder):
                raise Bad("an unfinished io.BytesIO is used as a value")
        value = tuple(items)
        self.push(self.weigh(value, items) if items else value)

    def op_empty_tuple(self) -> None:
        self.push(())

    def op_tuple(self) -> None:
        self._tuple(self.pop_mark())

    def op_tuple1(self) -> None:
        self._tuple([self.pop()])

    def op_tuple2(self) -> None:
        b, a = self.pop(), self.pop()
        self._tuple([a, b])

    def op_tuple3(self) -> None:
        c, b, a = self.pop(), self.pop(), self.pop()
        self._tuple([a, b, c])

    def op_empty_list(self) -> None:
        self.new_container([])

    def op_empty_dict(self) -> None:
        self.new_container({})

    def op_empty_set(self) -> None:
        self.new_container(set())

    def target(self, kinds: tuple[type, ...], opcode: str) -> Any:
        obj = self.top()
        if type(obj) not in kinds:
            raise Bad(f"{opcode} on {_describe(obj)}: only fresh containers can be filled")
        if id(obj) in self.sealed:
            raise Bad(f"{opcode} on a {type(obj).__name__} that is already referenced elsewhere")
        return obj

    def values(self, items: list[Any]) -> list[Any]:
        for item in items:
            if isinstance(item, Token | _BytesIOBuilder):
                raise Bad(f"{_describe(item)} cannot be stored as a value")
        return items

    def keys(self, items: list[Any]) -> list[Any]:
        for key in items:
            if not self.hashable(key):
                raise Bad(f"{_describe(key)} cannot be a dict key or set element")
        return items

    def hashable(self, key: Any) -> bool:
        if type(key) in _HASHABLE_ATOMS or isinstance(key, Stub | TensorRef):
            return True
        if type(key) in (tuple, Size, frozenset):
            return all(self.hashable(k) for k in key)
        return False

    def op_append(self) -> None:
        item = self.pop()
        target = self.target((list,), "APPEND")
        target.append(self.values([item])[0])
        self.grow(target, (item,))

    def op_appends(self) -> None:
        items = self.pop_mark()
        target = self.target((list,), "APPENDS")
        target.extend(self.values(items))
        self.grow(target, items)

    def op_setitem(self) -> None:
        value, key = self.pop(), self.pop()
        target = self.target((dict, OrderedDictStub), "SETITEM")
        self.keys([key])
        self.values([value])
        target[key] = value
        self.grow(target, (key, value))

    def op_setitems(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise Bad("SETITEMS with an odd number of items")
        target = self.target((dict, OrderedDictStub), "SETITEMS")
        keys, vals = items[0::2], items[1::2]
        self.keys(keys)
        self.values(vals)
        for key, value in zip(keys, vals):
            target[key] = value
        self.grow(target, items)

    def op_additems(self) -> None:
        items = self.pop_mark()
        target = self.target((set,), "ADDITEMS")
        target.update(self.keys(items))
        self.grow(target, items)

    def op_frozenset(self) -> None:
        items = self.keys(self.pop_mark())
        value = frozenset(items)
        self.push(self.weigh(value, items))

    def _global(self, module: str, name: str) -> None:
        qualname = f"{_PY2_MODULES.get(module, module)}.{name}"
        if qualname not in self.allowed:
            raise UnsafePickleError(
                f"{self.source}: the pickle references {qualname}, which is not on the allow-list; "
                "refusing to load it (nothing was imported or run). Only load checkpoints you trust "
                "with other tools.")
        self.push(self.allowed[qualname])

    def op_global(self) -> None:
        module = self._line()
        self._global(module, self._line())

    def _line(self) -> str:
        raw = bytes(self.data[self.pos:self.pos + 256])
        end = raw.find(b"\n")
        if end < 0:
            raise self.fail("GLOBAL name too long or unterminated")
        self.pos += end + 1
        try:
            return raw[:end].decode("ascii")
        except UnicodeDecodeError:
            raise self.fail("GLOBAL name is not ASCII") from None

    def op_stack_global(self) -> None:
        name, module = self.pop(), self.pop()
        if type(module) is not str or type(name) is not str:
            raise Bad("STACK_GLOBAL needs two strings")
        self._global(module, name)

    def op_reduce(self) -> None:
        args = self.pop()
        func = self.pop()
        if not isinstance(func, Token) or func.call is None:
            raise Bad(f"REDUCE on {_describe(func)}: it cannot be called")
        if type(args) is not tuple:
            raise Bad(f"{func.qualname}: arguments must be a tuple, got {_describe(args)}")
        value = func.call(args)
        self.push(self.weigh(value, (args,)) if isinstance(value, (*_MUTABLE, Stub, Wrapped)) else value)

    def op_newobj(self) -> None:
        args = self.pop()
        cls = self.pop()
        if not isinstance(cls, Token) or cls.new is None:
            raise Bad(f"NEWOBJ on {_describe(cls)}: it cannot be instantiated")
        if type(args) is not tuple:
            raise Bad(f"{cls.qualname}: arguments must be a tuple, got {_describe(args)}")
        self.values(list(args))
        self.push(self.weigh(cls.new(args), (args,)))

    def op_build(self) -> None:
        state = self.pop()
        inst = self.top()
        if id(inst) in self.sealed:
            raise Bad(f"BUILD on a {type(inst).__name__} that is already referenced elsewhere")
        self.values([state])
        built = _build(inst, state)
        if built is not inst:  # an io.BytesIO became its OpaqueBytes: so does its memo entry
            self.stack[-1] = built
            self.keep.append(built)
            for key in self.builders.pop(id(inst), ()):
                self.memo[key] = built
        self.grow(built, (state,))

    def op_binpersid(self) -> None:
        pid = self.pop()
        if self.persistent is None:
            raise Bad("unexpected persistent id")
        value = self.persistent(pid)
        self.push(value)

    def _put(self, index: int) -> None:
        if index not in self.memo and len(self.memo) >= self.bounds.max_memo:
            raise self._limit("memo entries", self.bounds.max_memo, "CKPT_MAX_PICKLE_MEMO")
        obj = self.top()
        self.memo[index] = obj
        if type(obj) is _BytesIOBuilder:
            self.builders.setdefault(id(obj), []).append(index)

    def op_binput(self) -> None:
        self._put(self.read(1)[0])

    def op_long_binput(self) -> None:
        self._put(self.unpack("<I", 4))

    def op_memoize(self) -> None:
        self._put(len(self.memo))

    def _get(self, index: int) -> None:
        try:
            obj = self.memo[index]
        except KeyError:
            raise self.fail(f"memo entry {index} is read before it is written") from None
        weight = self.info.get(id(obj), (1, 0))[0]
        if weight > 1 or isinstance(obj, (*_MUTABLE, Stub, _BytesIOBuilder)):
            self.sealed.add(id(obj))
            self.shared += weight
            if self.shared > self.bounds.max_shared:
                raise self._limit("elements reached through shared references", self.bounds.max_shared,
                                  "CKPT_MAX_PICKLE_SHARED")
        self.push(obj)

    def op_binget(self) -> None:
        self._get(self.read(1)[0])

    def op_long_binget(self) -> None:
        self._get(self.unpack("<I", 4))


_OPS: dict[int, str] = {
    0x80: "op_proto", 0x95: "op_frame", ord("."): "op_stop", ord("("): "op_mark", ord("0"): "op_pop",
    ord("1"): "op_pop_mark", ord("N"): "op_none", 0x88: "op_true", 0x89: "op_false", ord("J"): "op_binint",
    ord("K"): "op_binint1", ord("M"): "op_binint2", 0x8A: "op_long1", 0x8B: "op_long4", ord("G"): "op_binfloat",
    0x8C: "op_short_binunicode", ord("X"): "op_binunicode", 0x8D: "op_binunicode8",
    ord("U"): "op_short_binstring", ord("C"): "op_short_binbytes", ord("B"): "op_binbytes",
    0x8E: "op_binbytes8", 0x96: "op_bytearray8", ord(")"): "op_empty_tuple", ord("t"): "op_tuple",
    0x85: "op_tuple1", 0x86: "op_tuple2", 0x87: "op_tuple3", ord("]"): "op_empty_list", ord("}"): "op_empty_dict",
    0x8F: "op_empty_set", ord("a"): "op_append", ord("e"): "op_appends", ord("s"): "op_setitem",
    ord("u"): "op_setitems", 0x90: "op_additems", 0x91: "op_frozenset", ord("c"): "op_global",
    0x93: "op_stack_global", ord("R"): "op_reduce", 0x81: "op_newobj", ord("b"): "op_build",
    ord("Q"): "op_binpersid", ord("q"): "op_binput", ord("r"): "op_long_binput", 0x94: "op_memoize",
    ord("h"): "op_binget", ord("j"): "op_long_binget",
}


def torch_storage_loader(source: str, allowed: dict[str, Any] | None = None) -> Callable[[Any], StorageRef]:
    """persistent_load for torch.save pickles: ('storage', storage class, key, location, numel).

    Storages saved on any device (`cuda:0`, ...) are read from the archive like CPU ones."""

    def load(pid: Any) -> StorageRef:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise Bad(f"unsupported storage reference {_describe(pid)} in torch.save pickle")
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, Token) or storage_type.kind != "storage":
            raise Bad(f"unsupported storage type {_describe(storage_type)}")
        check_str(key, "storage key", r"[A-Za-z0-9_]{1,64}")
        check_str(location, "storage location", r"[a-z_]{1,16}(:\d{1,6})?")
        return StorageRef(key=str(key), dtype=storage_type.dtype, numel=check_int(numel, "storage size"),
                          location=str(location))

    return load


def loads(data: bytes, source: str, allowed: dict[str, Any] | None = None,
          persistent: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle `data` with the allow-list; raise FormatError for anything that is not a valid, bounded pickle."""
    try:
        return Interpreter(data, source, allowed, persistent).load()
    except FormatError:
        raise
    except Bad as exc:
        raise FormatError(f"{source}: {exc}; the file is damaged or crafted, refusing to load it") from None
    except Exception as exc:  # a defect in a handler must still name the file, never escape as a traceback
        raise FormatError(f"{source}: not a readable pickle ({type(exc).__name__}: {exc})") from None
