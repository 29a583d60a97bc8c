"""What each entry of a checkpoint is: model weight, optimizer state, training state, or unknown.

Optimizer state is recognised by its structure, under any container name (or none):
`<container>.state.<param>.<key>` and `<container>.param_groups.<group or param>.<key>`, where the
container is an optimizer state dict (it holds `param_groups`, which torch always writes), or its
`state` keys name a parameter of the model, or a parameter id with a per-parameter optimizer key
(`exp_avg`, `momentum_buffer`, `step`, ...). This covers `Optimizer.state_dict()` (ids),
`get_optimizer_state_dict` (FQNs), torchtitan's flattened `optimizer.state.<fqn>.exp_avg` /
`optimizer.param_groups.<fqn>.lr`, and optimizer files read on their own.

Everything else is a model weight, except:
- "other": training state beside the model (`dataloader.…`, `lr_scheduler.…`, `train_state.…`): a
  top-level name of its own, recognised only when the model's weights sit at the top level or under a
  model container (so a checkpoint made only of nested modules stays all model);
- "unknown": entries under an optimizer-named container (`optim`, `optimizer`, …) that do not have an
  optimizer's structure. They are never taken for model weights; they are reported by name.

`classify` is the one classification used by export, reshard/convert `--only`, and `inspect`.

`optimizer_owners` matches each optimizer state tensor to the parameter it belongs to, through the checkpoint's
own `param_groups` (see there): the parameter whose layout the state takes when resharded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Literal

from .errors import FormatError, short
from .index import MODEL_CONTAINERS, OPTIM_CONTAINERS, OPTIM_SECTIONS, CheckpointIndex, ObjectEntry, TensorEntry

Kind = Literal["model", "optim", "other", "unknown"]
#: Per-parameter state keys of torch.optim's optimizers (and Adafactor's), for optimizers saved without
#: param_groups and keyed by parameter id.
STATE_KEYS = frozenset({
    "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "acc_delta",
    "grad_avg", "exp_inf", "eta", "mu", "ax", "prev", "step_size", "mu_product", "row_var", "col_var", "variance",
})
MAX_SIBLINGS = 12  # tensors of one module tried as the parts of a fused parameter (subsets: 2 ** this, at most)


@dataclass(frozen=True)
class Parts:
    """One entry's name taken apart. `span` is the token range of `fqn` in the dotted name."""

    kind: Kind
    container: str = ""  # dotted prefix before the section (optimizer) or the FQN (model), "" at the top
    section: str = ""  # "state" / "param_groups" for optimizer entries
    group: str = ""  # the param_groups index, when groups are keyed by index
    fqn: str = ""  # the parameter's FQN ("" for an indexed param_groups entry)
    leaf: str = ""  # the key under the parameter or group ("exp_avg", "lr", "params")
    span: tuple[int, int] = (0, 0)

    @property
    def optimizer(self) -> bool:
        return self.kind == "optim"


@dataclass(frozen=True)
class _Candidate:
    container: str
    section: str
    rest: tuple[str, ...]  # the tokens after the section
    at: int  # token index of the section


def _candidates(tokens: list[str]) -> list[_Candidate]:
    return [_Candidate(".".join(tokens[:i]), tok, tuple(tokens[i + 1:]), i)
            for i, tok in enumerate(tokens) if tok in OPTIM_SECTIONS and len(tokens) - i >= 3]


def classify(entries: Iterable[TensorEntry | ObjectEntry], training_state: Iterable[str] = ()) -> dict[str, Parts]:
    """Parts of every entry, keyed by the entry's dotted path (`".".join(entry.path)`).

    `training_state` names entries a reader knows to be training state (Megatron's `common.pt`,
    Lightning's `meta.pt`): they are "other" whatever their names look like."""
    entries = list(entries)
    known = set(training_state)
    fixed = {".".join(e.path): Parts("other", e.path[0], fqn=".".join(e.path[1:]), span=(1, len(e.path)))
             for e in entries if e.name in known}
    paths = {".".join(e.path): e.path for e in entries if ".".join(e.path) not in fixed}
    tokens = {name: name.split(".") for name in paths}
    candidates = {name: _candidates(toks) for name, toks in tokens.items()}
    optimizers = {c.container for cs in candidates.values() for c in cs if c.section == "param_groups"}
    plain = [name for name, cs in candidates.items() if not any(c.container in optimizers for c in cs)]
    params = set(plain) | {".".join(tokens[n][1:]) for n in plain if tokens[n][0] in MODEL_CONTAINERS}
    for cs in candidates.values():
        for c in cs:
            if c.section == "state" and (".".join(c.rest[:-1]) in params
                                         or (c.rest[0].isdigit() and len(c.rest) == 2 and c.rest[1] in STATE_KEYS)):
                optimizers.add(c.container)
    out: dict[str, Parts] = {}
    for name, cs in candidates.items():
        found = next((c for c in cs if c.container in optimizers), None)
        if found is not None:
            out[name] = _optimizer_parts(found, params)
        elif tokens[name][0] in OPTIM_CONTAINERS and len(tokens[name]) > 1:
            out[name] = Parts("unknown", tokens[name][0], fqn=".".join(tokens[name][1:]), span=(1, len(tokens[name])))
    rest = {name: path for name, path in paths.items() if name not in out}
    has_model_root = any(len(path) == 1 or path[0] in MODEL_CONTAINERS for path in rest.values())
    for name, path in rest.items():
        n = len(tokens[name])
        if len(path) > 1 and path[0] in MODEL_CONTAINERS:
            out[name] = Parts("model", path[0], fqn=".".join(tokens[name][1:]), span=(1, n))
        elif has_model_root and len(path) > 1:
            out[name] = Parts("other", path[0], fqn=name[len(path[0]) + 1:], span=(path[0].count(".") + 1, n))
        else:
            out[name] = Parts("model", fqn=name, span=(0, n))
    return out | fixed


def _optimizer_parts(c: _Candidate, params: set[str]) -> Parts:
    start = c.at + 1
    rest = c.rest
    if c.section == "state":
        return Parts("optim", c.container, "state", fqn=".".join(rest[:-1]), leaf=rest[-1],
                     span=(start, start + len(rest) - 1))
    flattened = ".".join(rest[:-1])
    if flattened in params or not rest[0].isdigit():  # torchtitan's `param_groups.<fqn>.<key>`
        return Parts("optim", c.container, "param_groups", fqn=flattened, leaf=rest[-1],
                     span=(start, start + len(rest) - 1))
    return Parts("optim", c.container, "param_groups", group=rest[0], leaf=".".join(rest[1:]),
                 span=(start + 1, start + 1))


def index_kinds(index: CheckpointIndex) -> dict[str, Parts]:
    return classify([*index.tensors.values(), *index.objects.values()], index.training_state)


@dataclass
class _Optimizer:
    """One optimizer's parameters as its own `param_groups` list them, and its state tensors by parameter key."""

    container: str
    listed: list[str] = field(default_factory=list)  # parameter keys in param_groups order (ids or FQNs)
    has_groups: bool = False
    names: dict[str, str] = field(default_factory=dict)  # id -> FQN, from `param_names`
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)  # group index -> {"params"/"param_names"}
    state: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)  # key -> entry name -> shape

    def where(self) -> str:
        return f"{self.container}.param_groups" if self.container else "param_groups"


def _optimizers(index: CheckpointIndex, parts: dict[str, Parts]) -> dict[str, _Optimizer]:
    found: dict[str, _Optimizer] = {}
    for name, p in parts.items():
        if not p.optimizer:
            continue
        opt = found.setdefault(p.container, _Optimizer(p.container))
        if p.section == "state" and name in index.tensors:
            opt.state.setdefault(p.fqn, {})[name] = index.tensors[name].shape
        elif p.section == "param_groups":
            opt.has_groups = True
            if p.fqn and p.fqn not in opt.listed:  # torchtitan's flattened `param_groups.<fqn>.<key>`
                opt.listed.append(p.fqn)
            elif p.leaf in ("params", "param_names") and name in index.objects:
                opt.groups.setdefault(p.group, {})[p.leaf] = index.objects[name].value
    for opt in found.values():
        for group in sorted(opt.groups, key=lambda g: (len(g), g)):  # "0", "1", ..., "10": numeric order
            params, names = opt.groups[group].get("params"), opt.groups[group].get("param_names")
            if not isinstance(params, list | tuple):
                raise FormatError(f"{opt.where()}.{group}.params is {short(params)}, expected a list of parameter "
                                  "ids or names; the optimizer state is damaged")
            keys = [str(v) for v in params]
            opt.listed += keys
            if isinstance(names, list | tuple) and len(names) == len(keys):
                opt.names.update((k, str(n)) for k, n in zip(keys, names))
    return found


def _fused(fqn: str, shape: tuple[int, ...], model: dict[str, tuple[int, ...]]) -> bool:
    """Whether the model stores `fqn` split into siblings (torchtitan's fused `wqkv` saved as `wq`/`wk`/`wv`): two
    or more tensors of the same module and leaf name, other dims equal, whose dim-0 sizes add up to its own."""
    module, _, leaf = fqn.rpartition(".")
    parent = module.rpartition(".")[0]
    rows = [s[0] for name, s in model.items() if name.endswith("." + leaf) and name != fqn
            and name[:-len(leaf) - 1].rpartition(".")[0] == parent and len(s) == len(shape) and s[1:] == shape[1:]]
    rows = rows[:MAX_SIBLINGS]
    return bool(shape) and any(sum(pick) == shape[0] for n in range(2, len(rows) + 1)
                               for pick in combinations(rows, n))


def _by_position(opt: _Optimizer, model: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Ids to parameters by position: torch numbers a plain `Optimizer.state_dict()`'s parameters 0, 1, ... in
    param_groups order, which for an optimizer built on `model.parameters()` is the order the model's state
    stores them in. Sound only when the counts agree (the shapes are checked by the caller)."""
    if not opt.has_groups:
        raise FormatError(f"optimizer state under {opt.container or 'the top level'!r} is keyed by parameter ids "
                          "and the checkpoint has no param_groups saying which parameter each id is; reshard with "
                          "`only` model, or save the optimizer with get_optimizer_state_dict (keyed by names)")
    if len(opt.listed) != len(model):
        raise FormatError(f"{opt.where()} lists {len(opt.listed)} parameter ids but the model stores {len(model)} "
                          "tensors, so which id is which parameter is unknown (buffers or tied weights in the model "
                          "state?); save the optimizer with get_optimizer_state_dict (keyed by names), or reshard "
                          "with `only` model")
    return dict(zip(opt.listed, model))


def optimizer_owners(index: CheckpointIndex, parts: dict[str, Parts]) -> dict[str, str]:
    """The FQN of the parameter each optimizer state tensor of `index` belongs to (`parts`: `classify`'s).

    The matching comes from the checkpoint's own `param_groups`: state keyed by name must be listed there (or,
    without param_groups, be a model parameter); state keyed by integer id (`Optimizer.state_dict()`, torchtune)
    takes `param_names` where recorded, else the model parameter at the id's position in the concatenated
    `param_groups[*].params`. A parameter the model state lacks is accepted when the model stores it split into
    siblings (a fused parameter). State tensors with the parameter's number of dimensions must have its shape.
    Raises FormatError naming the entry on any disagreement."""
    model = {parts[name].fqn: t.shape for name, t in index.tensors.items() if parts[name].kind == "model"}
    owners: dict[str, str] = {}
    for opt in _optimizers(index, parts).values():
        listed = set(opt.listed)
        positions: dict[str, str] | None = None
        for key, shapes in opt.state.items():
            first = next(iter(shapes))
            if opt.has_groups and key not in listed:
                raise FormatError(f"optimizer state {first!r} belongs to parameter {key!r}, which {opt.where()} does "
                                  "not list; the optimizer state is damaged, or reshard with `only` model")
            fqn = opt.names.get(key, key)
            if model and key.isdigit() and key not in opt.names and fqn not in model:
                positions = positions if positions is not None else _by_position(opt, model)
                fqn = positions[key]
            _check_owner(first, fqn, shapes, model)
            owners.update(dict.fromkeys(shapes, fqn))
        for key in opt.listed:
            fqn = opt.names.get(key, key)
            if model and not key.isdigit() and key not in opt.state and fqn not in model:
                raise FormatError(f"{opt.where()} lists parameter {key!r}, which the model does not have; check "
                                  "`rename`/`include`, or reshard with `only` model")
    return owners


def _check_owner(first: str, fqn: str, shapes: dict[str, tuple[int, ...]], model: dict[str, tuple[int, ...]]) -> None:
    if not model:
        return
    if fqn in model:
        want = model[fqn]
        bad = next((n for n, s in shapes.items() if len(s) == len(want) and s != want), None)
        if bad is not None:
            raise FormatError(f"optimizer state {bad!r} has shape {list(shapes[bad])} but its parameter {fqn!r} has "
                              f"{list(want)}; the optimizer is not this model's, or reshard with `only` model")
        return
    widest = max(shapes.values(), key=len)
    if not _fused(fqn, widest, model):
        raise FormatError(f"optimizer state {first!r} belongs to parameter {fqn!r}, which the model does not have; "
                          "check `rename`/`include`, or reshard with `only` model")
