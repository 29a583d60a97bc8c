"""Key transforms: pick model/optimizer entries, strip wrapper prefixes and containers, rename, filter.

Transforms act on an entry's path (see `index.split_path`): the parameter FQN inside it is cleaned
and renamed the same way for model weights, optimizer state and `param_groups[*].params`, so model
and optimizer stay consistent.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .errors import OptionError
from .index import MODEL_CONTAINERS, OPTIM_CONTAINERS, CheckpointIndex, ObjectEntry, TensorEntry
from .stacking import unstack

Only = Literal["model", "optim", "all"]
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
LEADING_PREFIXES = ("module.", "_forward_module.")


@dataclass
class KeyOptions:
    only: Only = "model"
    clean: bool = True
    renames: list[tuple[str, str]] = field(default_factory=list)
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    nest: bool = True  # with model and optimizer both selected, keep them under `model.` / `optim.`

    def __post_init__(self) -> None:
        if self.only not in ("model", "optim", "all"):
            raise OptionError(f"--only {self.only}: choose model, optim or all")
        compiled = []
        for pattern, repl in self.renames:
            try:
                compiled.append((re.compile(pattern), repl))
            except re.error as exc:
                raise OptionError(f"--rename {pattern}={repl}: bad regular expression ({exc})") from None
        self._renames = compiled

    @staticmethod
    def parse_renames(values: list[str]) -> list[tuple[str, str]]:
        out = []
        for value in values:
            if "=" not in value:
                raise OptionError(f"--rename {value!r}: expected REGEX=REPLACEMENT")
            pattern, repl = value.split("=", 1)
            out.append((pattern, repl))
        return out


@dataclass
class _Parts:
    optimizer: bool
    container: tuple[str, ...]
    section: tuple[str, ...]  # ("state",) / ("param_groups", i) for optimizer entries
    fqn: str
    leaf: tuple[str, ...]


def _parts(path: tuple[str, ...]) -> _Parts:
    if path[0] in OPTIM_CONTAINERS and len(path) > 1 and path[1] in ("state", "param_groups"):
        container, rest = path[:1], path[1:]
    else:
        container, rest = (), path
    if rest[0] == "state" and len(rest) >= 3:
        return _Parts(True, container, ("state",), ".".join(rest[1:-1]), rest[-1:])
    if rest[0] == "param_groups" and len(rest) >= 3:
        return _Parts(True, container, rest[:2], "", (".".join(rest[2:]),))
    if path[0] in MODEL_CONTAINERS and len(path) > 1:
        return _Parts(False, path[:1], (), ".".join(path[1:]), ())
    return _Parts(False, (), (), ".".join(path), ())


def strip_wrappers(fqn: str, counts: Counter[str]) -> str:
    for prefix in WRAPPER_PREFIXES:
        if prefix in fqn:
            new = re.sub(rf"(^|\.){re.escape(prefix)}", r"\1", fqn)
            if new != fqn:
                counts[prefix] += 1
                fqn = new
    for prefix in LEADING_PREFIXES:
        if fqn.startswith(prefix):
            counts[prefix] += 1
            fqn = fqn[len(prefix):]
    return fqn


class KeyMapper:
    """Maps source entries to output names for one checkpoint and one set of options."""

    def __init__(self, index: CheckpointIndex, options: KeyOptions, with_optimizer: bool) -> None:
        self.options = options
        self.nest_model = options.nest and with_optimizer and options.only == "all"
        self.counts: Counter[str] = Counter()
        self.report: list[str] = []
        self.rename_counts: Counter[str] = Counter()

    def fqn(self, fqn: str) -> str:
        if self.options.clean:
            fqn = strip_wrappers(fqn, self.counts)
        for pattern, repl in self.options._renames:
            new = pattern.sub(repl, fqn)
            if new != fqn:
                self.rename_counts[pattern.pattern] += 1
            fqn = new
        return fqn

    def path(self, path: tuple[str, ...]) -> tuple[str, ...]:
        p = _parts(path)
        opts = self.options
        fqn = (self.fqn(p.fqn),) if p.fqn else ()
        if not opts.clean:
            container = p.container
        elif p.optimizer and opts.only == "all":
            container = ("optim",)
        elif self.nest_model:
            container = ("model",)
        else:
            container = ()
        if p.container and container != p.container:
            self.counts[f"{p.container[0]}. (container)"] += 1
        if p.optimizer:
            return (*container, *p.section, *fqn, *p.leaf)
        return (*container, *fqn)

    def value(self, entry: ObjectEntry, value: Any) -> Any:
        """Rename parameter FQNs listed in `param_groups[*].params`."""
        p = _parts(entry.path)
        if p.optimizer and p.leaf == ("params",) and isinstance(value, list | tuple):
            return type(value)(self.fqn(v) if isinstance(v, str) else v for v in value)
        return value


def _kind(path: tuple[str, ...], has_model_root: bool) -> str:
    """"optim", "model", or "other": training state beside the model (dataloader, lr_scheduler, …)
    under a top-level name of its own, recognised only when the model's weights sit at the top or in
    a model container (so a checkpoint made only of nested modules stays all model)."""
    if _parts(path).optimizer:
        return "optim"
    if has_model_root and len(path) > 1 and path[0] not in MODEL_CONTAINERS and path[0] not in OPTIM_CONTAINERS:
        return "other"
    return "model"


def apply(index: CheckpointIndex, options: KeyOptions) -> tuple[CheckpointIndex, list[str]]:
    """A view of `index` with the selected entries under their output names, and a report of what changed."""
    unstacked: list[str] = []
    if options.clean and index.stacked:
        index, unstacked = unstack(index)
    everything: list[TensorEntry | ObjectEntry] = [*index.tensors.values(), *index.objects.values()]
    has_model_root = any(len(e.path) == 1 or e.path[0] in MODEL_CONTAINERS for e in everything)
    kinds = {id(e): "other" if e.name in index.training_state else _kind(e.path, has_model_root)
             for e in everything}
    wanted = {"model": {"model"}, "optim": {"optim"}, "all": {"model", "optim", "other"}}[options.only]
    entries = [e for e in everything if kinds[id(e)] in wanted]
    others = sorted({e.path[0] for e in everything if kinds[id(e)] == "other" and "other" not in wanted})
    mapper = KeyMapper(index, options, any(kinds[id(e)] == "optim" for e in entries))
    out = replace(index, tensors={}, objects={}, notes=list(index.notes))
    sources: dict[str, str] = {}
    dropped = 0
    for entry in entries:
        path = entry.path if kinds[id(entry)] == "other" else mapper.path(entry.path)
        name = ".".join(path)
        if options.include and not any(fnmatch.fnmatchcase(name, g) for g in options.include):
            dropped += 1
            continue
        if any(fnmatch.fnmatchcase(name, g) for g in options.exclude):
            dropped += 1
            continue
        if name in sources:
            raise OptionError(f"keys {sources[name]!r} and {entry.name!r} both become {name!r}; "
                              "use --keep-keys or a --rename that keeps them apart")
        sources[name] = entry.name
        if isinstance(entry, TensorEntry):
            out.tensors[name] = replace(entry, name=name, path=path)
        else:
            new = replace(entry, name=name, path=path)
            if entry.value is not None:
                new.value = mapper.value(entry, copy.deepcopy(entry.value))
            out.objects[name] = new
    report = unstacked + [f"stripped {prefix} from {n} keys" for prefix, n in sorted(mapper.counts.items())]
    report += [f"renamed {n} keys with {pattern}" for pattern, n in mapper.rename_counts.items()]
    if dropped:
        report.append(f"left out {dropped} keys by --include/--exclude")
    if others:
        report.append(f"left out training state beside the model ({', '.join(others)}); --only all keeps it")
    return out, report
