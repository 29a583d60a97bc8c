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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from .index import MODEL_CONTAINERS, OPTIM_CONTAINERS, OPTIM_SECTIONS, CheckpointIndex, ObjectEntry, TensorEntry

Kind = Literal["model", "optim", "other", "unknown"]
#: Per-parameter state keys of torch.optim's optimizers (and Adafactor's), for optimizers saved without
#: param_groups and keyed by parameter id.
STATE_KEYS = frozenset({
    "step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "acc_delta",
    "grad_avg", "exp_inf", "eta", "mu", "ax", "prev", "step_size", "mu_product", "row_var", "col_var", "variance",
})


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
