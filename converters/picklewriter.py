"""Write pickles that name torch classes without importing torch.

`Global`, `Call` and `Obj` stand for a module-level name, a call, and an object built with
NEWOBJ + BUILD; `Persistent` is a persistent id (torch storages). The output is protocol 2 with
the opcodes torch's weights_only unpickler understands, so `torch.load(weights_only=True)` and
DCP's `pickle.load` both read it.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, ClassVar


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


class _Pickler(pickle._Pickler):  # type: ignore[name-defined]  # the pure-Python pickler lets us add opcodes
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, Persistent) else None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, Global):
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
        else:
            super().save(obj, save_persistent_id)

    def save_dict(self, obj: dict) -> None:  # no memo entries for plain containers
        self.write(pickle.EMPTY_DICT)
        self._batch_setitems(iter(obj.items()))

    def save_list(self, obj: list) -> None:
        self.write(pickle.EMPTY_LIST)
        self._batch_appends(iter(obj))

    dispatch: ClassVar[dict] = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]
    dispatch[dict] = save_dict
    dispatch[list] = save_list


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    pickler = _Pickler(buf, protocol=2)
    pickler.fast = True  # no memo: every object is written where it appears
    pickler.dump(obj)
    return buf.getvalue()


ORDERED_DICT = Global("collections", "OrderedDict")
REBUILD_TENSOR = Global("torch._utils", "_rebuild_tensor_v2")


def tensor(storage_key: str, dtype: str, shape: tuple[int, ...]) -> Call:
    """A contiguous tensor over storage `data/<storage_key>`, as torch.save pickles it."""
    from . import dtypes

    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    numel = dtypes.numel(shape)
    storage = Persistent(("storage", Global("torch", dtypes.storage_class(dtype)), storage_key, "cpu", numel))
    return Call(REBUILD_TENSOR, (storage, 0, tuple(shape), tuple(stride), False, Call(ORDERED_DICT, ())))
