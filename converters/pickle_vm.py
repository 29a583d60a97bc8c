"""The closed pickle machine: runs only the opcodes torch.save, DCP and Python's pickler emit for state dicts.

Allow-listed globals are pushed as inert `Token`s; APPEND/SETITEM/ADDITEMS only fill a list/dict/set
that was never fetched from the memo, BUILD only sets the state of a fresh stand-in once, REDUCE and
NEWOBJ only call a token's checked handler. Every resource is bounded by `PickleLimits` (pickle bytes,
memo entries, objects built, elements reached again through shared references, nesting depth, memory), so
hostile pickles fail quickly with a `FormatError` and any later walk over the result is bounded.

Memory: every opcode is charged what it can allocate at most (`_COSTS`: the object it builds, its stack
slot, the interpreter's bookkeeping of it), containers and handler results what they really grew by; the
total may not pass a budget that the pickle's size justifies (`memory_budget`), so a megabyte of empty sets
(about 340 bytes of memory per byte of pickle) is refused at once instead of taking hundreds of megabytes.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .config import PickleLimits, current
from .errors import FormatError, UnsafePickleError
from .pickle_types import (
    Bad,
    BytesIOBuilder,
    OrderedDictStub,
    Stub,
    Token,
    Wrapped,
    build_state,
    describe,
    hashable,
)


def limits() -> PickleLimits:
    """The limits in force: the engine config's (`EngineConfig.pickle`, `CKPT_MAX_PICKLE_*` for the CLI)."""
    return current().pickle


MEMORY_FLOOR = 64 << 20  # any pickle may build this much
MEMORY_PER_BYTE = 80  # ... and this much more per byte of pickle (honest ones are charged up to about 50)
MEMORY_CAP = 2 << 30  # ... but never more than this, unless CKPT_MAX_PICKLE_MEMORY says so


def memory_budget(size: int, bounds: PickleLimits) -> int:
    """Bytes of objects a pickle of `size` bytes may build: what its size justifies, or CKPT_MAX_PICKLE_MEMORY."""
    return bounds.max_memory or min(MEMORY_CAP, MEMORY_FLOOR + MEMORY_PER_BYTE * size)


_MUTABLE = (list, dict, set, OrderedDictStub)


_ATOMS = frozenset({str, int, float, bool, type(None), Token})
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_PY2_MODULES = {"__builtin__": "builtins"}  # protocol 2 spells builtins the Python 2 way


class Interpreter:
    """Run one pickle over the closed opcode set; `load()` returns the object."""

    def __init__(self, data: bytes, source: str, allowed: dict[str, Any],
                 persistent: Callable[[Any], Any] | None = None, bounds: PickleLimits | None = None) -> None:
        self.bounds = bounds or limits()
        if len(data) > self.bounds.max_bytes:
            raise FormatError(f"{source}: pickle of {len(data)} bytes is larger than the limit of "
                              f"{self.bounds.max_bytes} (raise CKPT_MAX_PICKLE_BYTES if the file is trusted)")
        self.data = memoryview(data)
        self.source = source
        self.allowed = allowed
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
        self.budget = memory_budget(len(data), self.bounds)
        self.grown = 0  # bytes charged beyond `_COSTS`: containers filled, handlers' results
        self.spent = 0  # bytes charged in all, once `load` ends
        self.ops: list[Callable[[], Any] | None] = [None] * 256
        for code, method in _OPS.items():
            self.ops[code] = getattr(self, method)

    # -- errors and limits

    def fail(self, message: str) -> FormatError:
        return FormatError(f"{self.source}: {message} (pickle byte {self.pos}); the file is damaged or crafted, "
                           "refusing to load it")

    def _over_budget(self) -> FormatError:
        return FormatError(f"{self.source}: the pickle of {len(self.data)} bytes builds more than {self.budget} "
                           "bytes of objects, its memory budget; refusing to load it "
                           "(set CKPT_MAX_PICKLE_MEMORY to a larger budget if the file is trusted)", uri=self.source)

    def _release(self) -> None:
        """Drop everything built but the result (which the caller holds)."""
        self.stack, self.marks = [], []
        self.memo, self.info, self.keep, self.sealed, self.builders = {}, {}, [], set(), {}

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
        self.stack.append(obj)  # every opcode builds at most one object: `load` counts them

    def new_container(self, obj: Any) -> None:
        self.stack.append(obj)
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
        try:
            return self._run()
        finally:
            self._release()  # what was built is dropped at once, even while a refusal's traceback keeps this

    def _run(self) -> Any:
        data, ops, size = self.data, self.ops, len(self.data)
        steps, max_steps = 0, self.bounds.max_objects
        spent, budget = 0, self.budget
        try:
            while True:
                if self.pos >= size:
                    raise self.fail("pickle ends without STOP")
                code = data[self.pos]
                self.pos += 1
                op = ops[code]
                if op is None:
                    raise self.fail(f"unsupported pickle opcode 0x{code:02x}")
                steps += 1
                if steps > max_steps:
                    raise self._limit("objects", max_steps, "CKPT_MAX_PICKLE_OBJECTS")
                spent += _COST[code]
                if spent + self.grown > budget:
                    raise self._over_budget()
                if op():
                    break
        except (IndexError, struct.error):  # a fixed-size argument runs past the end, or the stack is empty
            raise self.fail("truncated pickle or stack underflow") from None
        except Bad as exc:
            raise self.fail(str(exc)) from None
        except RecursionError:
            raise self._limit("levels of nesting", self.bounds.max_depth, "CKPT_MAX_PICKLE_DEPTH") from None
        except MemoryError:
            self._release()  # first: showing the error needs memory
            raise FormatError(f"{self.source}: the pickle needs more memory than is available; refusing it",
                              uri=self.source) from None
        finally:
            self.spent = spent + self.grown
        if len(self.stack) != 1 or self.marks:
            raise self.fail("pickle leaves extra items on its stack")
        result = self.stack[0]
        self.check_value(result)
        return result

    def check_value(self, obj: Any) -> None:
        if isinstance(obj, Token | BytesIOBuilder):
            raise Bad(f"{describe(obj)} is left uncalled")

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
        self.stack.append(self.data[self.pos])
        self.pos += 1

    def op_binint2(self) -> None:
        self.stack.append(_U16.unpack_from(self.data, self.pos)[0])
        self.pos += 2

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
        n = self.data[self.pos]
        self.pos += 1
        self._text(n)

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
            if type(item) is BytesIOBuilder:
                raise Bad("an unfinished io.BytesIO is used as a value")
        value = tuple(items)
        self.grown += 8 * len(items)
        self.stack.append(self.weigh(value, items))

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
            raise Bad(f"{opcode} on {describe(obj)}: only fresh containers can be filled")
        if id(obj) in self.sealed:
            raise Bad(f"{opcode} on a {type(obj).__name__} that is already referenced elsewhere")
        return obj

    def values(self, items: list[Any]) -> list[Any]:
        for item in items:
            if isinstance(item, Token | BytesIOBuilder):
                raise Bad(f"{describe(item)} cannot be stored as a value")
        return items

    def keys(self, items: list[Any]) -> list[Any]:
        for key in items:
            if not hashable(key):
                raise Bad(f"{describe(key)} cannot be a dict key or set element")
        return items

    def op_append(self) -> None:
        item = self.pop()
        target = self.target((list,), "APPEND")
        self.fill(target, lambda: target.append(self.values([item])[0]), (item,))

    def op_appends(self) -> None:
        items = self.pop_mark()
        target = self.target((list,), "APPENDS")
        self.fill(target, lambda: target.extend(self.values(items)), items)

    def op_setitem(self) -> None:
        value, key = self.pop(), self.pop()
        target = self.target((dict, OrderedDictStub), "SETITEM")
        self.keys([key])
        self.values([value])
        self.fill(target, lambda: target.__setitem__(key, value), (key, value))

    def op_setitems(self) -> None:
        items = self.pop_mark()
        if len(items) % 2:
            raise Bad("SETITEMS with an odd number of items")
        target = self.target((dict, OrderedDictStub), "SETITEMS")
        keys, vals = items[0::2], items[1::2]
        self.keys(keys)
        self.values(vals)
        self.fill(target, lambda: target.update(zip(keys, vals)), items)

    def op_additems(self) -> None:
        items = self.pop_mark()
        target = self.target((set,), "ADDITEMS")
        self.fill(target, lambda: target.update(self.keys(items)), items)

    def fill(self, target: Any, update: Callable[[], object], items: Sequence[Any]) -> None:
        """Run `update` (adding `items` to the container `target`), counting what the container grew by."""
        before = sys.getsizeof(target)
        update()
        self.grown += sys.getsizeof(target) - before
        self.grow(target, items)

    def op_frozenset(self) -> None:
        items = self.keys(self.pop_mark())
        value = frozenset(items)
        self.grown += sys.getsizeof(value)
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

    def pop_callee(self, op: str, attr: str, refusal: str) -> tuple[Callable[[tuple], Any], tuple]:
        """The arguments and, under them, the allowed global that REDUCE calls or NEWOBJ instantiates."""
        args = self.pop()
        token = self.pop()
        callee = getattr(token, attr) if isinstance(token, Token) else None
        if callee is None:
            raise Bad(f"{op} on {describe(token)}: {refusal}")
        if type(args) is not tuple:
            raise Bad(f"{token.qualname}: arguments must be a tuple, got {describe(args)}")
        return callee, args

    def op_reduce(self) -> None:
        call, args = self.pop_callee("REDUCE", "call", "it cannot be called")
        value = call(args)
        self.grown += _size(value)  # a handler may copy (bytearray, encode, set of a list)
        if isinstance(value, (*_MUTABLE, Stub, Wrapped)):
            self.grown += _BOOKKEEPING
            value = self.weigh(value, (args,))
        self.push(value)

    def op_newobj(self) -> None:
        new, args = self.pop_callee("NEWOBJ", "new", "it cannot be instantiated")
        self.values(list(args))
        value = new(args)
        self.grown += _size(value) + _BOOKKEEPING
        self.push(self.weigh(value, (args,)))

    def op_build(self) -> None:
        state = self.pop()
        inst = self.top()
        if id(inst) in self.sealed:
            raise Bad(f"BUILD on a {type(inst).__name__} that is already referenced elsewhere")
        self.values([state])
        built = build_state(inst, state)
        if built is not inst:  # an io.BytesIO became its OpaqueBytes: so does its memo entry
            self.grown += len(built.data)
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
        memo = self.memo
        if len(memo) >= self.bounds.max_memo and index not in memo:
            raise self._limit("memo entries", self.bounds.max_memo, "CKPT_MAX_PICKLE_MEMO")
        obj = self.stack[-1]
        memo[index] = obj
        if type(obj) is BytesIOBuilder:
            self.builders.setdefault(id(obj), []).append(index)

    def op_binput(self) -> None:
        self.pos += 1
        self._put(self.data[self.pos - 1])

    def op_long_binput(self) -> None:
        self.pos += 4
        self._put(_U32.unpack_from(self.data, self.pos - 4)[0])

    def op_memoize(self) -> None:
        self._put(len(self.memo))

    def _get(self, index: int) -> None:
        try:
            obj = self.memo[index]
        except KeyError:
            raise self.fail(f"memo entry {index} is read before it is written") from None
        if type(obj) in _ATOMS:
            self.stack.append(obj)
            return
        weight = self.info.get(id(obj), (1, 0))[0]
        if weight > 1 or isinstance(obj, (*_MUTABLE, Stub, BytesIOBuilder)):
            if id(obj) not in self.sealed:
                self.grown += _SEALED
            self.sealed.add(id(obj))
            self.shared += weight
            if self.shared > self.bounds.max_shared:
                raise self._limit("elements reached through shared references", self.bounds.max_shared,
                                  "CKPT_MAX_PICKLE_SHARED")
        self.push(obj)

    def op_binget(self) -> None:
        self.pos += 1
        self._get(self.data[self.pos - 1])

    def op_long_binget(self) -> None:
        self.pos += 4
        self._get(_U32.unpack_from(self.data, self.pos - 4)[0])


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


# What each opcode may allocate at most, in bytes (CPython 3.11, 64-bit): the object it builds, its stack slot
# (8), and for containers the interpreter's record of them (`info` entry and `keep` slot); what containers
# grow by and what handlers return is charged as it happens (`Interpreter.grown`). Strings and bytes are copies
# of the pickle's own bytes, which the budget allows for (`MEMORY_PER_BYTE`).
_BOOKKEEPING = 176
_SEALED = 96  # an entry of `Interpreter.sealed`
_INSTANCE = 112  # the attributes of an instance (a stand-in, a TensorRef), beyond `sys.getsizeof`


def _size(value: Any) -> int:
    """Bytes an object built by a handler holds, its attributes included (not the objects they refer to)."""
    return sys.getsizeof(value) + (_INSTANCE if type(value).__dictoffset__ else 0)

_COSTS: dict[str, int] = {
    "op_proto": 0, "op_frame": 0, "op_stop": 0, "op_pop": 0, "op_pop_mark": 0, "op_mark": 64,
    "op_none": 8, "op_true": 8, "op_false": 8, "op_empty_tuple": 8, "op_global": 8, "op_stack_global": 8,
    "op_binint": 40, "op_binint1": 40, "op_binint2": 40, "op_long1": 48, "op_long4": 48, "op_binfloat": 32,
    "op_short_binunicode": 88, "op_binunicode": 88, "op_binunicode8": 88, "op_short_binstring": 64,
    "op_short_binbytes": 48, "op_binbytes": 48, "op_binbytes8": 48, "op_bytearray8": 72,
    "op_tuple": 48 + _BOOKKEEPING, "op_tuple1": 48 + _BOOKKEEPING, "op_tuple2": 48 + _BOOKKEEPING,
    "op_tuple3": 48 + _BOOKKEEPING, "op_empty_list": 64 + _BOOKKEEPING, "op_empty_dict": 72 + _BOOKKEEPING,
    "op_empty_set": 224 + _BOOKKEEPING, "op_frozenset": 8 + _BOOKKEEPING,
    "op_append": 0, "op_appends": 0, "op_setitem": 0, "op_setitems": 0, "op_additems": 0,
    "op_reduce": 8, "op_newobj": 8, "op_build": 56, "op_binpersid": 176,
    "op_binput": 112, "op_long_binput": 112, "op_memoize": 112, "op_binget": 8, "op_long_binget": 8,
}
_COST = [_COSTS[_OPS[code]] if code in _OPS else 0 for code in range(256)]
