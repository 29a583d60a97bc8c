"""The engine's settings as one typed, immutable value: `EngineConfig`.

The entry points (`convert`, `reshard`, `verify`, `inspect`, opening an index) take `config=` and run under
`use(config or current())`; modules below them read `current()`. Nothing below the entry points reads the
environment: `EngineConfig.from_env` is the one builder from today's `CKPT_*` variables (the CLI uses it),
the service builds one from its `Settings`, and job processes and Ray tasks receive it as one JSON document
(`to_json` / `from_json`) and install it with `use`.

With no config installed, `current()` is `EngineConfig()`: the defaults, never the environment. A process's
entry point may `install` one for the rest of its main thread. Threads do not inherit a `ContextVar`: pools
that run engine work are `ContextPool`s (each task runs in the context of the thread that submitted it), and
long-lived threads that reach storage are `ContextThread`s (they run in the context they were made in).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar, copy_context
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, ParamSpec, TypeVar

from .errors import OptionError

EXECUTORS = ("local", "ray")
DEFAULT_MAX_METADATA = 256 * 1024 * 1024
DEFAULT_UPLOAD_PARALLEL = 4
DEFAULT_RAY_PART_BYTES = 1 << 30


@dataclass(frozen=True)
class PickleLimits:
    """Bounds on one pickle (each can be raised with its environment variable, `CKPT_MAX_PICKLE_*`)."""

    max_bytes: int = 1 << 30  # CKPT_MAX_PICKLE_BYTES: size of one pickle
    max_memo: int = 20_000_000  # CKPT_MAX_PICKLE_MEMO: memo entries
    max_objects: int = 100_000_000  # CKPT_MAX_PICKLE_OBJECTS: objects built
    max_shared: int = 10_000_000  # CKPT_MAX_PICKLE_SHARED: elements reached again through shared references
    max_depth: int = 100  # CKPT_MAX_PICKLE_DEPTH: nesting depth of containers and MARKs
    max_memory: int | None = None  # CKPT_MAX_PICKLE_MEMORY: bytes of objects built (None: `memory_budget`)

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if value is None and item.name == "max_memory":
                continue
            _check_positive(f"pickle.{item.name}", value)


#: environment variable -> the field of `EngineConfig` (or of its `pickle` limits) it sets
ENV_VARS = {
    "CKPT_EXECUTOR": "executor",
    "CKPT_RAY_ADDRESS": "ray_address",
    "CKPT_CONFINE_READS": "read_roots",
    "CKPT_MAX_METADATA_BYTES": "max_metadata_bytes",
    "CKPT_UPLOAD_PARALLEL": "upload_parallel",
    "CKPT_RAY_PART_BYTES": "ray_part_bytes",
    "CKPT_MAX_PICKLE_BYTES": "pickle.max_bytes",
    "CKPT_MAX_PICKLE_MEMO": "pickle.max_memo",
    "CKPT_MAX_PICKLE_OBJECTS": "pickle.max_objects",
    "CKPT_MAX_PICKLE_SHARED": "pickle.max_shared",
    "CKPT_MAX_PICKLE_DEPTH": "pickle.max_depth",
    "CKPT_MAX_PICKLE_MEMORY": "pickle.max_memory",
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine reads that is not a per-call option.

    executor / ray_address: where conversion plans run (`local` threads, or Ray at `ray_address`:
    `ray://host:10001`, `auto` or a GCS address); read_roots: reads are confined to these local folders or
    URI prefixes, as given (storage resolves symlinks when it checks; None: no confinement);
    max_metadata_bytes: the cap on every whole-file read (metadata, index JSON, zip directory, pickles);
    pickle: bounds on one pickle; upload_parallel: multipart upload parts in flight per output;
    ray_part_bytes: bytes of output files per Ray task.
    """

    executor: str = "local"
    ray_address: str = "auto"
    read_roots: tuple[str, ...] | None = None
    max_metadata_bytes: int = DEFAULT_MAX_METADATA
    pickle: PickleLimits = field(default_factory=PickleLimits)
    upload_parallel: int = DEFAULT_UPLOAD_PARALLEL
    ray_part_bytes: int = DEFAULT_RAY_PART_BYTES

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise OptionError(f"executor {self.executor!r}: choose local or ray", field="executor")
        if not isinstance(self.ray_address, str) or not self.ray_address.strip():
            raise OptionError("ray_address: give a Ray address (ray://host:10001, auto or a GCS address)",
                              field="ray_address")
        if self.read_roots is not None:
            if isinstance(self.read_roots, str) or not all(isinstance(r, str) for r in self.read_roots):
                raise OptionError("read_roots: give a list of folders or URI prefixes", field="read_roots")
            object.__setattr__(self, "read_roots", tuple(self.read_roots))
        if isinstance(self.pickle, Mapping):
            object.__setattr__(self, "pickle", _pickle_limits(dict(self.pickle)))
        if not isinstance(self.pickle, PickleLimits):
            raise OptionError("pickle: give the pickle limits as an object", field="pickle")
        for name in ("max_metadata_bytes", "upload_parallel", "ray_part_bytes"):
            _check_positive(name, getattr(self, name))

    # -- builders

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EngineConfig:
        """The config today's `CKPT_*` variables describe (unset or empty: the default); a bad value is an
        `OptionError` naming the variable. The one place the engine's settings are read from the environment."""
        env = os.environ if environ is None else environ
        top: dict[str, Any] = {}
        limits: dict[str, Any] = {}
        for var, name in ENV_VARS.items():
            text = env.get(var, "").strip()
            if not text:
                continue
            value = _parse(var, name, text)
            if name.startswith("pickle."):
                limits[name.removeprefix("pickle.")] = value
            else:
                top[name] = value
        return cls(**top, pickle=PickleLimits(**limits))  # every value was checked above, naming its variable

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["read_roots"] = None if self.read_roots is None else list(self.read_roots)
        return data

    def to_json(self) -> str:
        """One JSON document (for a job process's argv or a file, or `--print-config`)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        if not isinstance(data, Mapping):
            raise OptionError("engine config: expected a JSON object")
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise OptionError(f"engine config: unknown setting {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**dict(data))

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        try:
            data = json.loads(text)
        except ValueError:
            raise OptionError("engine config: not a JSON document") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with `changes` (e.g. a CLI flag applied onto the environment's config)."""
        return replace(self, **changes)


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise OptionError(f"{name}={value!r}: give a positive whole number", field=name)


def _pickle_limits(data: dict[str, Any]) -> PickleLimits:
    known = {item.name for item in fields(PickleLimits)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise OptionError(f"pickle: unknown limit {unknown[0]!r}; known: {', '.join(sorted(known))}", field="pickle")
    return PickleLimits(**data)


def _parse(var: str, name: str, text: str) -> Any:
    if name in ("executor", "ray_address"):
        if name == "executor" and text not in EXECUTORS:
            raise OptionError(f"{var}={text}: choose local or ray")
        return text
    if name == "read_roots":
        try:
            items = json.loads(text) if text.startswith("[") else [text]
        except ValueError:
            items = None
        if not isinstance(items, list):
            raise OptionError(f"{var}: not a JSON list of roots")
        return tuple(str(r) for r in items if str(r).strip())
    value = _whole(text)
    if value <= 0:
        raise OptionError(f"{var}={text!r}: give a positive whole number")
    return value


# -- the config in force

_current: ContextVar[EngineConfig | None] = ContextVar("ckpt_engine_config", default=None)
_DEFAULT = EngineConfig()


def current() -> EngineConfig:
    """The config installed by the innermost `use` in this context; the defaults when none is."""
    config = _current.get()
    return _DEFAULT if config is None else config


@contextmanager
def use(config: EngineConfig | None) -> Iterator[EngineConfig]:
    """Run the block with `config` in force (None: keep the one in force)."""
    config = config or current()
    token = _current.set(config)
    try:
        yield config
    finally:
        _current.reset(token)


def install(config: EngineConfig) -> None:
    """Put `config` in force for the rest of this context: for a process's entry point (its main thread), so
    that what it runs, and what it starts that copies the context (`ContextPool`, `ContextThread`, asyncio
    tasks and the threads they hand work to), run under it. Library code uses `use`."""
    _current.set(config)


class ContextThread(threading.Thread):
    """A thread that runs in (a copy of) the context of the thread that created it, so `current()` in it is
    the config in force where it was made; subclasses override `run` as usual."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        context, run = copy_context(), self.run
        self.run = lambda: context.run(run)  # type: ignore[method-assign]  # this instance's run, wrapped


_P = ParamSpec("_P")
_R = TypeVar("_R")


class ContextPool(ThreadPoolExecutor):
    """A thread pool whose tasks run in the context of the thread that submitted them (so `current()` in a
    task is the config of the call that queued it, as it would be without the pool)."""

    def submit(self, fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_R]:
        context = copy_context()

        def in_context() -> _R:
            return context.run(fn, *args, **kwargs)

        return super().submit(in_context)
