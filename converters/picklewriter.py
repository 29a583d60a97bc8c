"""Write pickles that name torch classes without importing torch.

`Global`, `Call` and `Obj` stand for a module-level name, a call, and an object built with
NEWOBJ + BUILD; `Persistent` is a persistent id (torch storages). The output is protocol 2 with
the opcodes torch's weights_only unpickler understands, so `torch.load(weights_only=True)` and
DCP's `pickle.load` both read it.

The writer is closed like the reader: it writes plain data (None, bool, int, float, complex, str,
bytes, tuples, lists, dicts, sets), the reader's stand-ins (dtypes, devices, `torch.Size`,
OrderedDict, `io.BytesIO` as `OpaqueBytes`) and the markers above, and refuses anything else, so it
never looks up or imports the module of an object it was handed.
"""

from __future__ import annotations

import codecs
import io
import pickle
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

from . import dtypes
from .errors import FormatError
from .unpickle import Device, DType, OpaqueBytes, OrderedDictStub, Size


@dataclass(frozen=True)
class Global:
    module: str
    name: str


@dataclass(frozen=True)
class Call:
    func: Global
    args: tuple


@dataclass
class Obj:
    cls: Global
    state: Any


class Pairs(list):
    """A dict given as (key, value) pairs, for keys that are not hashable here (e.g. `Obj`)."""


@dataclass(frozen=True)
class Persistent:
    pid: tuple


_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, tuple, list, dict, set, frozenset)
# the callables pickle itself writes for bytes, sets and complex numbers at protocol 2
_PLAIN_GLOBALS = (codecs.encode, bytes, bytearray, set, frozenset, complex)


class _Pickler(pickle._Pickler):  # the pure-Python pickler lets us add opcodes
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, Persistent) else None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        kind = type(obj)
        if kind is DType:
            self.save(Global("torch", str(obj)))
        elif kind is Device:
            self.save(Call(Global("torch", "device"), (str(obj),)))
        elif kind is Size:
            self.save(Call(Global("torch", "Size"), (tuple(obj),)))
        elif kind is OrderedDictStub:
            self.save(ORDERED_DICT)
            self.save(())
            self.write(pickle.REDUCE)
            self._batch_setitems(iter(obj.items()))
        elif kind is OpaqueBytes:  # what pickle writes for an io.BytesIO
            self.save(Global("_io", "BytesIO"))
            self.save(())
            self.write(pickle.NEWOBJ)
            self.save((obj.data, obj.position, None))
            self.write(pickle.BUILD)
        elif kind is Persistent:
            super().save(obj, save_persistent_id)
        elif kind is Global:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        elif isinstance(obj, Call):
            self.save(obj.func)
            self.save(obj.args)
            self.write(pickle.REDUCE)
        elif isinstance(obj, Pairs):
            self.write(pickle.EMPTY_DICT)
            self._batch_setitems(iter(obj))
        elif isinstance(obj, Obj):
            self.save(obj.cls)
            self.save(())
            self.write(pickle.NEWOBJ)
            self.save(obj.state)
            self.write(pickle.BUILD)
        elif kind in _PLAIN or any(obj is g for g in _PLAIN_GLOBALS):
            super().save(obj, save_persistent_id)
        else:
            raise FormatError(f"cannot write a {kind.__name__} value into a pickle; only plain data, tensors and "
                              "the torch types torch.load(weights_only=True) accepts are written")

    def save_dict(self, obj: dict) -> None:  # no memo entries for plain containers
        self.write(pickle.EMPTY_DICT)
        self._batch_setitems(iter(obj.items()))

    def save_list(self, obj: list) -> None:
        self.write(pickle.EMPTY_LIST)
        self._batch_appends(iter(obj))

    dispatch: ClassVar[dict] = dict(pickle._Pickler.dispatch)
    dispatch[dict] = save_dict
    dispatch[list] = save_list


_BATCH = pickle._Pickler._BATCHSIZE  # items per APPENDS / SETITEMS
_U16 = struct.Struct("<H").pack
_I32 = struct.Struct("<i").pack
_U32 = struct.Struct("<I").pack
_F64 = struct.Struct(">d").pack


class _Emitter:
    """Writes what `_Pickler` writes for the values a checkpoint's pickles are made of (plain data, `Global`,
    `Call`, `Obj`, `Pairs`, `Persistent`, dtypes, sizes), byte for byte, in one call per value instead of the
    pure-Python pickler's several; any other value (bytes, sets, devices, OrderedDicts, ...) is `_Pickler`'s.
    Without a memo every value's bytes depend on it alone, so the two can take turns."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.buf = io.BytesIO()
        self.pickler = _Pickler(self.buf, protocol=2)
        self.pickler.fast = True  # no memo: every object is written where it appears

    def slow(self, obj: Any) -> None:
        self.buf.seek(0)
        self.buf.truncate()
        self.pickler.save(obj)
        self.out.append(self.buf.getvalue())

    def emit(self, obj: Any) -> None:  # one branch per kind, as `_Pickler.save`
        kind, out = type(obj), self.out
        if kind is str:
            data = obj.encode("utf-8", "surrogatepass")
            out.append(pickle.BINUNICODE + _U32(len(data)) + data)
        elif kind is int and 0 <= obj <= 0xFF:
            out.append(pickle.BININT1 + bytes((obj,)))
        elif kind is int and 0 <= obj <= 0xFFFF:
            out.append(pickle.BININT2 + _U16(obj))
        elif kind is int and -0x80000000 <= obj <= 0x7FFFFFFF:
            out.append(pickle.BININT + _I32(obj))
        elif kind is tuple or kind is Size:
            if kind is Size:  # torch.Size(tuple)
                out.append(pickle.GLOBAL + b"torch\nSize\n")
                self.emit((tuple(obj),))
                out.append(pickle.REDUCE)
            elif not obj:
                out.append(pickle.EMPTY_TUPLE)
            elif len(obj) <= 3:
                for item in obj:
                    self.emit(item)
                out.append(_TUPLE_CODES[len(obj)])
            else:
                out.append(pickle.MARK)
                for item in obj:
                    self.emit(item)
                out.append(pickle.TUPLE)
        elif kind is Global:
            out.append(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        elif kind is Call:
            self.emit(obj.func)
            self.emit(obj.args)
            out.append(pickle.REDUCE)
        elif kind is Obj:
            self.emit(obj.cls)
            out.append(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
            self.emit(obj.state)
            out.append(pickle.BUILD)
        elif kind is dict or kind is Pairs:
            out.append(pickle.EMPTY_DICT)
            self.items(list(obj.items()) if kind is dict else obj, pickle.SETITEM, pickle.SETITEMS)
        elif kind is list:
            out.append(pickle.EMPTY_LIST)
            self.items(obj, pickle.APPEND, pickle.APPENDS)
        elif obj is None:
            out.append(pickle.NONE)
        elif kind is bool:
            out.append(pickle.NEWTRUE if obj else pickle.NEWFALSE)
        elif kind is float:
            out.append(pickle.BINFLOAT + _F64(obj))
        elif kind is DType:
            out.append(pickle.GLOBAL + f"torch\n{obj}\n".encode())
        elif kind is Persistent and type(obj.pid) is tuple:
            self.emit(obj.pid)
            out.append(pickle.BINPERSID)
        else:
            self.slow(obj)

    def items(self, items: list[Any], one: bytes, many: bytes) -> None:
        """A list's items or a dict's (key, value) pairs in batches, as `_batch_appends`/`_batch_setitems`."""
        pairs = many == pickle.SETITEMS
        for start in range(0, len(items), _BATCH):
            batch = items[start:start + _BATCH]
            if len(batch) > 1:
                self.out.append(pickle.MARK)
            for item in batch:
                if pairs:
                    key, value = item
                    self.emit(key)
                    self.emit(value)
                else:
                    self.emit(item)
            self.out.append(many if len(batch) > 1 else one)


_TUPLE_CODES = {1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}


def dumps(obj: Any, label: str = "") -> bytes:
    """Pickle `obj` (protocol 2, no memo); FormatError naming `label` for a value it must not write."""
    emitter = _Emitter()
    try:
        emitter.emit(obj)
    except FormatError as exc:
        raise FormatError(f"{label}: {exc}" if label else str(exc)) from None
    except RecursionError:
        raise FormatError(f"{label}: nested too deeply to write" if label else "nested too deeply to write") from None
    return b"".join((pickle.PROTO, b"\x02", *emitter.out, pickle.STOP))


ORDERED_DICT = Global("collections", "OrderedDict")
REBUILD_TENSOR = Global("torch._utils", "_rebuild_tensor_v2")
REBUILD_TENSOR_V3 = Global("torch._utils", "_rebuild_tensor_v3")
UNTYPED_STORAGE = Global("torch.storage", "UntypedStorage")


@lru_cache(maxsize=4096)
def tensor_pickle(storage_key: str, dtype: str, shape: tuple[int, ...], location: str = "cpu") -> bytes:
    """`dumps(tensor(...))`: the pickle of a record of one tensor, made once per dtype and shape (a DCP file
    holds a record per chunk, most of them alike: every layer's, on every rank)."""
    return dumps(tensor(storage_key, dtype, shape, location))


def tensor(storage_key: str, dtype: str, shape: tuple[int, ...], location: str = "cpu") -> Call:
    """A contiguous tensor over storage `data/<storage_key>`, pickled exactly as torch.save does.

    Dtypes with a legacy typed storage class: `_rebuild_tensor_v2` over `torch.<X>Storage` (size in
    elements); the others (float8, uint16/32/64, ...): `_rebuild_tensor_v3` over
    `torch.storage.UntypedStorage` (size in bytes) with the dtype as the last argument."""
    stride = dtypes.row_major(tuple(shape))
    numel = dtypes.numel(shape)
    hooks = Call(ORDERED_DICT, ())
    storage_class = dtypes.storage_class(dtype)
    if storage_class:
        storage = Persistent(("storage", Global("torch", storage_class), storage_key, location, numel))
        return Call(REBUILD_TENSOR, (storage, 0, tuple(shape), tuple(stride), False, hooks))
    nbytes = numel * dtypes.itemsize(dtype)
    storage = Persistent(("storage", UNTYPED_STORAGE, storage_key, location, nbytes))
    return Call(REBUILD_TENSOR_V3, (storage, 0, tuple(shape), tuple(stride), False, hooks, Global("torch", dtype)))
