"""Allow-list unpickling: read the pickles inside checkpoints without importing or running anything.

This module holds the allow-list and the checked handlers of its names; `pickle_vm` is the closed
interpreter that runs a pickle against it, `pickle_types` the stand-ins it builds. The interpreter
executes only the opcodes that torch.save, DCP and Python's pickler emit for state
dicts. A global the pickle names is looked up in an allow-list and pushed as a `Token` (plain data,
never the named object); a token can only be called (REDUCE/NEWOBJ) through a handler that checks
its argument types and builds a stand-in: a `Stub` that records state, a `TensorRef`, a dtype name.
Nothing outside the list is ever imported, and torch is not imported at all.

Closed means: no opcode can change an allow-listed global or an object that is already referenced
elsewhere. APPEND/SETITEM/ADDITEMS only fill a list/dict/set that was never fetched from the memo;
BUILD only sets the state of a fresh stand-in (`Stub`, the OrderedDict stand-in, `OpaqueBytes`)
once, with the state types torch writes. Every resource is bounded (`PickleLimits`): pickle bytes,
memo entries, objects built, elements reached again through shared references (so a
"billion laughs" pickle fails at once, and any later walk over the result is bounded), nesting
depth, and the memory of what it builds (by what the pickle's size justifies). Every refusal is a
`FormatError` (`UnsafePickleError` for a name off the list) naming the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from . import dtypes
from .errors import FormatError
from .pickle_types import (  # noqa: F401  (re-exported: the readers' vocabulary)
    MAX_DIMS,
    Bad,
    BytesIOBuilder,
    Device,
    DType,
    OpaqueBytes,
    OrderedDictStub,
    Size,
    StorageRef,
    Stub,
    TensorRef,
    Token,
    Wrapped,
    check_args,
    check_bool,
    check_int,
    check_ints,
    check_str,
    describe,
    hashable,
    stub,
)
from .pickle_vm import Interpreter, PickleLimits, limits  # noqa: F401

# ---------------------------------------------------------------------------------------------- handlers


def _empty_hooks(value: Any, name: str) -> None:
    if type(value) not in (OrderedDictStub, dict) or value:
        raise Bad(f"{name}: backward hooks must be an empty OrderedDict, got {describe(value)}")


def _no_metadata(rest: tuple, name: str) -> None:
    if rest and rest[0]:
        raise Bad(f"{name}: tensor metadata {rest[0]!r} (e.g. a conjugate or negative bit) is not supported; "
                  "call resolve_conj()/resolve_neg() before saving")


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, name: str) -> TensorRef:
    if not isinstance(storage, StorageRef) or storage.dtype is None:
        raise Bad(f"{name}: the storage argument must be a typed storage reference, got {describe(storage)}")
    offset = check_int(offset, f"{name}: storage offset")
    shape, strides = check_ints(size, f"{name}: size"), check_ints(stride, f"{name}: stride")
    if len(shape) != len(strides):
        raise Bad(f"{name}: size {list(shape)} and stride {list(strides)} differ in length")
    span = dtypes.strided_span(shape, strides)
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
        raise Bad(f"{name}: the storage argument must be an UntypedStorage reference, got {describe(storage)}")
    if type(dtype) is not DType:
        raise Bad(f"{name}: dtype must be a torch dtype, got {describe(dtype)}")
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
    raise Bad(f"{name}: tensor state must be a dict, got {describe(value)}")


def rebuild_from_type_v2(args: tuple) -> Any:
    name = "torch._tensor._rebuild_from_type_v2"
    check_args(args, name, 4, 4)
    func, new_type, func_args, state = args
    if not isinstance(new_type, Token) or new_type.kind not in ("tensor-type", "subclass"):
        raise Bad(f"{name}: the type argument must be torch.Tensor, Parameter or a known subclass, "
                  f"got {describe(new_type)}")
    if not isinstance(func, Token) or func.kind != ("rebuild" if new_type.kind == "tensor-type" else "wrapper"):
        raise Bad(f"{name}: cannot rebuild a {new_type.qualname} with {describe(func)}")
    if type(func_args) is not tuple:
        raise Bad(f"{name}: arguments must be a tuple, got {describe(func_args)}")
    assert func.call is not None
    value = func.call(func_args)
    if new_type.kind == "subclass":
        if state is not None and type(state) not in (dict, tuple):
            raise Bad(f"{name}: {new_type.qualname} state must be a dict or tuple, got {describe(state)}")
        return Wrapped(new_type.qualname, value, state)
    _state(state, name)
    return value


def rebuild_parameter(args: tuple) -> TensorRef:
    name = "torch._utils._rebuild_parameter"
    check_args(args, name, 3, 4)
    if not isinstance(args[0], TensorRef):
        raise Bad(f"{name}: data must be a tensor, got {describe(args[0])}")
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
        raise Bad(f"_codecs.encode takes a string and latin1/utf-8, got {describe(text)}, {describe(encoding)}")
    return text.encode(encoding)


def _items(args: tuple, name: str) -> list:
    check_args(args, name, 0, 1)
    if args and type(args[0]) not in (list, tuple):
        raise Bad(f"{name} takes a list, got {describe(args[0])}")
    items = list(args[0]) if args else []
    for item in items:
        if not hashable(item):
            raise Bad(f"{describe(item)} cannot be a set element")
    return items


def _bytearray(args: tuple) -> bytearray:
    check_args(args, "builtins.bytearray", 0, 1)
    if args and type(args[0]) is not bytes:
        raise Bad(f"builtins.bytearray takes bytes, got {describe(args[0])}")
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
    "_io.BytesIO": Token("_io.BytesIO", new=lambda args: BytesIOBuilder(args), kind="bytesio"),
    **{f"pathlib.{name}": Token(f"pathlib.{name}", _path)
       for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path")},
    f"{_DCP}.metadata._MEM_FORMAT_ENCODING": Token(f"{_DCP}.metadata._MEM_FORMAT_ENCODING",
                                                   enum_int("_MEM_FORMAT_ENCODING")),
    f"{_DCP}.metadata.TensorProperties": stub_token(f"{_DCP}.metadata.TensorProperties", "tuple"),
    **{f"{_DCP}.metadata.{name}": stub_token(f"{_DCP}.metadata.{name}") for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex",
        "StorageMeta")},
    f"{_DCP}.filesystem._StorageInfo": stub_token(f"{_DCP}.filesystem._StorageInfo"),
    # Megatron-core's planner keeps every rank's save plan in `.metadata` (`all_local_plans`)
    **{f"{_DCP}.planner.{name}": stub_token(f"{_DCP}.planner.{name}") for name in (
        "SavePlan", "WriteItem", "TensorWriteData")},
    f"{_DCP}.planner.WriteItemType": Token(f"{_DCP}.planner.WriteItemType", enum_int("WriteItemType")),
}


def enum_value(qualname: str) -> Token:
    """An enum member (REDUCE with its value) as the text `Class(value)`."""
    short = qualname.rsplit(".", 1)[-1]

    def make(args: tuple) -> str:
        check_args(args, qualname, 1, 1)
        if type(args[0]) not in (int, str):
            raise Bad(f"{qualname} takes an int or str value, got {describe(args[0])}")
        return f"{short}({args[0]!r})"

    return Token(qualname, make)


# Megatron-core `common.pt` (the non-sharded part of a dist checkpoint): what megatron.core.safe_globals
# lets torch.load read, less numpy (its RNG states are sharded objects, not in common.pt).
MEGATRON_ALLOWED: dict[str, Any] = {
    **BASE_ALLOWED,
    "argparse.Namespace": stub_token("argparse.Namespace"),
    "types.SimpleNamespace": stub_token("types.SimpleNamespace"),
    "megatron.core.optimizer.optimizer_config.OptimizerConfig":
        stub_token("megatron.core.optimizer.optimizer_config.OptimizerConfig"),
    **{name: enum_value(name) for name in (
        "megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
        "megatron.core.transformer.enums.CudaGraphScope", "megatron.core.rerun_state_machine.RerunDiagnostic",
        "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState",
        "signal.Signals")},
}


def torch_storage_loader(source: str, allowed: dict[str, Any] | None = None) -> Callable[[Any], StorageRef]:
    """persistent_load for torch.save pickles: ('storage', storage class, key, location, numel).

    Storages saved on any device (`cuda:0`, ...) are read from the archive like CPU ones."""

    def load(pid: Any) -> StorageRef:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise Bad(f"unsupported storage reference {describe(pid)} in torch.save pickle")
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, Token) or storage_type.kind != "storage":
            raise Bad(f"unsupported storage type {describe(storage_type)}")
        check_str(key, "storage key", r"[A-Za-z0-9_]{1,64}")
        check_str(location, "storage location", r"[a-z_]{1,16}(:\d{1,6})?")
        return StorageRef(key=str(key), dtype=storage_type.dtype, numel=check_int(numel, "storage size"),
                          location=str(location))

    return load


def loads(data: bytes, source: str, allowed: dict[str, Any] | None = None,
          persistent: Callable[[Any], Any] | None = None) -> Any:
    """Unpickle `data` with the allow-list; raise FormatError for anything that is not a valid, bounded pickle."""
    try:
        return Interpreter(data, source, BASE_ALLOWED if allowed is None else allowed, persistent).load()
    except FormatError:
        raise
    except Bad as exc:
        raise FormatError(f"{source}: {exc}; the file is damaged or crafted, refusing to load it", uri=source) from None
    except Exception as exc:  # a defect in a handler must still name the file, never escape as a traceback
        raise FormatError(f"{source}: not a readable pickle ({type(exc).__name__}: {exc})", uri=source) from None
