"""Key transforms: pick model/optimizer entries, strip wrapper prefixes and containers, rename, filter.

Which entries are model weights, optimizer state or training state comes from `classify` (by
structure). Transforms act on an entry's path: the parameter FQN inside it is cleaned and renamed the
same way for model weights, optimizer state and `param_groups[*].params`, so model and optimizer stay
consistent. Without clean-up or renames, every selected entry keeps its name and path exactly.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

from .classify import Parts, classify
from .errors import OptionError
from .index import CheckpointIndex, ObjectEntry, TensorEntry
from .rangeread import RangeReader
from .stacking import unstack
from .tensorio import group_records
from .writers.objects import load_object

Only = Literal["model", "optim", "all"]
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
LEADING_PREFIXES = ("module.", "_forward_module.")


@dataclass
class KeyOptions:
    only: Only = "model"
    clean: bool | None = None  # None: keep keys for --only all (a training state), clean them otherwise
    renames: list[tuple[str, str]] = field(default_factory=list)
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    nest: bool = True  # with model and optimizer both selected, keep them under `model.` / `optim.`

    def __post_init__(self) -> None:
        if self.only not in ("model", "optim", "all"):
            raise OptionError(f"only {self.only}: choose model, optim or all", option="only")
        compiled = []
        for pattern, repl in self.renames:
            try:
                compiled.append((re.compile(pattern), repl))
            except re.error as exc:
                raise OptionError(f"rename {pattern}={repl}: bad regular expression ({exc})", option="rename") from None
        self._renames = compiled
        if self.clean is None:
            self.clean = self.only != "all"

    @staticmethod
    def parse_renames(values: list[str]) -> list[tuple[str, str]]:
        out = []
        for value in values:
            if "=" not in value:
                raise OptionError(f"rename {value!r}: expected REGEX=REPLACEMENT", option="rename")
            pattern, repl = value.split("=", 1)
            out.append((pattern, repl))
        return out


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


def replace_span(path: tuple[str, ...], span: tuple[int, int], new: str) -> tuple[str, ...]:
    """`path` with the dotted tokens `span` replaced by `new`, other component boundaries kept."""
    first = last = -1
    bounds = []
    pos = 0
    for i, comp in enumerate(path):
        n = comp.count(".") + 1
        bounds.append((pos, pos + n))
        if pos < span[1] and pos + n > span[0]:
            first = i if first < 0 else first
            last = i
        pos += n
    if first < 0:
        return path
    head = path[first].split(".")[:span[0] - bounds[first][0]]
    tail = path[last].split(".")[span[1] - bounds[last][0]:]
    merged = ".".join(t for t in (*head, new, *tail) if t)
    return (*path[:first], merged, *path[last + 1:])


class KeyMapper:
    """Maps source entries to output names for one checkpoint and one set of options.

    Without clean-up or renames every path is kept exactly (a training job resumes from the same keys).
    A rename changes only the parameter FQN inside a path; clean-up also strips wrapper prefixes and
    moves entries into canonical containers (`model.` / `optim.` with both selected, none otherwise).
    """

    def __init__(self, options: KeyOptions, with_optimizer: bool) -> None:
        self.options = options
        self.nest_model = options.nest and with_optimizer and options.only == "all"
        self.counts: Counter[str] = Counter()
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

    def path(self, path: tuple[str, ...], parts: Parts) -> tuple[tuple[str, ...], str]:
        """(output path, output FQN) of an entry."""
        if parts.kind in ("other", "unknown") or (not parts.fqn and not self.options.clean):
            return path, parts.fqn
        fqn = self.fqn(parts.fqn) if parts.fqn else ""
        if not self.options.clean:
            return (path if fqn == parts.fqn else replace_span(path, parts.span, fqn)), fqn
        if parts.optimizer:
            container: tuple[str, ...] = ("optim",) if self.options.only == "all" else ()
        else:
            container = ("model",) if self.nest_model else ()
        if parts.container and container != (parts.container,):
            self.counts[f"{parts.container}. (container)"] += 1
        if parts.optimizer:
            middle = (parts.group,) if parts.group else (fqn,)
            return (*container, parts.section, *middle, parts.leaf), fqn
        return (*container, fqn), fqn

    def value(self, parts: Parts, value: Any) -> Any:
        """Rename parameter FQNs listed in `param_groups[*].params`."""
        if parts.optimizer and parts.leaf == "params" and isinstance(value, list | tuple):
            return type(value)(self.fqn(v) if isinstance(v, str) else v for v in value)
        return value


class Selection(NamedTuple):
    """The selected entries under their output names, what changed, and each output entry's parts."""

    index: CheckpointIndex  # type: ignore[assignment]  # shadows tuple.index on purpose: callers read .index
    report: list[str]
    parts: dict[str, Parts]


def _names(names: list[str]) -> str:
    return ", ".join(names[:10]) + (f" (+{len(names) - 10} more)" if len(names) > 10 else "")


def apply(index: CheckpointIndex, options: KeyOptions, reader: RangeReader | None = None) -> Selection:
    """A view of `index` with the selected entries under their output names, and a report of what changed.

    `param_groups[*].params` lists stored as data (DCP) are loaded through `reader` to rename them.
    Layer-stacked tensors (Megatron) are split per layer when keys are cleaned."""
    unstacked: list[str] = []
    if options.clean and index.stacked:
        index, unstacked = unstack(index)
    everything: list[TensorEntry | ObjectEntry] = [*index.tensors.values(), *index.objects.values()]
    by_path = classify(everything, index.training_state)
    parts = {id(e): by_path[".".join(e.path)] for e in everything}
    wanted = {"model": {"model"}, "optim": {"optim"}, "all": {"model", "optim", "other", "unknown"}}[options.only]
    entries = [e for e in everything if parts[id(e)].kind in wanted]
    left = {kind: sorted(e.name for e in everything if parts[id(e)].kind == kind and kind not in wanted)
            for kind in ("optim", "other", "unknown")}
    mapper = KeyMapper(options, any(parts[id(e)].optimizer for e in entries))
    out = replace(index, tensors={}, objects={}, notes=list(index.notes))
    out_parts: dict[str, Parts] = {}
    sources: dict[str, str] = {}
    dropped = 0
    for entry in entries:
        p = parts[id(entry)]
        path, fqn = mapper.path(entry.path, p)
        name = entry.name if path == entry.path else ".".join(path)
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
        out_parts[name] = replace(p, fqn=fqn)
        if isinstance(entry, TensorEntry):
            out.tensors[name] = replace(entry, name=name, path=path)
        else:
            new = replace(entry, name=name, path=path)
            if entry.value is None and entry.data is not None and reader is not None and p.leaf == "params" \
                    and (options.clean or options.renames):
                new.value, new.data = load_object(entry, reader), None
            if new.value is not None:
                new.value = mapper.value(p, copy.deepcopy(new.value))
            out.objects[name] = new
    out.tensors = group_records(out.tensors)  # records read together from object storage: fetched together
    report = unstacked + [f"stripped {prefix} from {n} keys" for prefix, n in sorted(mapper.counts.items())]
    report += [f"renamed {n} keys with {pattern}" for pattern, n in mapper.rename_counts.items()]
    if dropped:
        report.append(f"left out {dropped} keys by --include/--exclude")
    if left["optim"] and options.only == "model":
        report.append(f"left out {len(left['optim'])} optimizer state entries (model weights only)")
    others = sorted({by_path[".".join(e.path)].container for e in everything
                     if parts[id(e)].kind == "other" and "other" not in wanted})
    if others:
        report.append(f"left out training state beside the model ({', '.join(others)}); --only all keeps it")
    if left["unknown"]:
        report.append(f"left out {len(left['unknown'])} entries that are neither model weights nor optimizer state "
                      f"(under an optimizer's name, without its state/param_groups structure): "
                      f"{_names(left['unknown'])}; --only all carries them as they are")
    return Selection(out, report, out_parts)
