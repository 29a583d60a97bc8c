"""Apply a family's table entry to a Megatron GPT checkpoint's clean, unstacked view (`decoder.layers.{i}.…`).

Every Megatron tensor must be used by a rule, and every rule that applies must find its tensor: a model the
family cannot express is one line naming what is missing or left over, never a partial export.
"""

from __future__ import annotations

from typing import Any

from ..errors import FormatError, OptionError
from ..index import CheckpointIndex, TensorEntry
from .config import FEATURE_WORDS, ModelConfig, deepseek_group_mismatch, hf_config, read_megatron
from .table import FAMILIES, TOP, Family, Rule
from .transforms import expert

AUTO = "auto"
CHOICES = (AUTO, *FAMILIES)


def detect(mc: ModelConfig, where: str) -> Family:
    """The family the checkpoint's own config names (NeMo's config class) or implies (its features)."""
    for family in FAMILIES.values():
        if mc.nemo_class and mc.nemo_class in family.nemo_classes:
            return family
    # the plainest fit first
    for name in ("deepseek_v3", "gemma3", "gemma2", "qwen3_moe", "mixtral", "qwen3", "qwen2", "llama", "mistral"):
        family = FAMILIES[name]
        if family.features <= mc.features <= family.features | family.optional:
            return family
    raise OptionError(f"{where}: no family in the table has " + ", ".join(FEATURE_WORDS[f] for f in sorted(mc.features))
                      + f" together; choose one of {', '.join(FAMILIES)} only if it fits, or export without `to_hf`",
                      option="to_hf")


def check(family: Family, mc: ModelConfig, where: str) -> None:
    """One line naming every feature the model has that the family lacks, or the family needs that it lacks."""
    if family.norm_eps is not None and mc.eps != family.norm_eps:
        raise OptionError(f"{where}: to_hf {family.name}: the model's norm epsilon is {mc.eps:g}, but "
                          f"{family.architecture} uses {family.norm_eps:g} for some of its norms whatever its config "
                          "says, so its logits would differ; export without `to_hf` to keep Megatron names",
                          option="to_hf")
    groups = (mc.extra.get("moe_router_num_groups"), mc.extra.get("moe_router_group_topk"))
    if "sigmoid" in family.features and (why := deepseek_group_mismatch(mc.top_k, *groups)) is not None:
        raise OptionError(f"{where}: to_hf {family.name}: {why}, so {family.architecture} would route other experts; "
                          "export without `to_hf` to keep Megatron names", option="to_hf")
    extra = mc.features - family.features - family.optional
    missing = family.features - mc.features
    if not extra and not missing:
        return
    fits = [f.name for f in FAMILIES.values() if f.features <= mc.features <= f.features | f.optional]
    parts = [f"the model has {FEATURE_WORDS[f]}, which {family.architecture} does not" for f in sorted(extra)]
    parts += [f"{family.architecture} needs {FEATURE_WORDS[f]}, which the model does not have" for f in sorted(missing)]
    hint = f"; choose {' or '.join(fits)} (or auto)" if fits else "; export without `to_hf` to keep Megatron names"
    raise OptionError(f"{where}: to_hf {family.name}: " + "; ".join(parts) + hint, option="to_hf")


def applies(r: Rule, mc: ModelConfig, layer: int = 0) -> bool:
    """Whether the rule's tensor exists in the model (at `layer`, for the per-layer conditions)."""
    if not r.when:
        return True
    if r.when in ("dense_layer", "moe_layer"):
        return mc.is_moe(layer) == (r.when == "moe_layer")
    if r.when == "no_q_lora":
        return "q_lora" not in mc.features
    return not mc.tied if r.when == "untied" else r.when in mc.features


def _apply(view: CheckpointIndex, r: Rule, src: str, dst: str, mc: ModelConfig, used: set[str]) -> list[TensorEntry]:
    names = tuple(dst + n for n in r.hf)
    if not r.per_expert:
        for old in r.megatron:
            if src + old in view.tensors:
                used.add(src + old)
                return r.transform(view.tensors[src + old], mc.shape, names)
        raise FormatError(f"{view.uri}: no {src + r.megatron[0]!r} in the checkpoint (the config says the model "
                          "has it); the config does not match the weights")
    count = mc.shape.experts
    out: list[TensorEntry] = []
    for old in r.megatron:
        if "{e}" not in old and src + old in view.tensors:
            used.add(src + old)
            stacked = view.tensors[src + old]
            for e in range(count):
                out += r.transform(expert(stacked, e, count), mc.shape, tuple(n.format(e=e) for n in names))
            return out
        if "{e}" in old and src + old.format(e=0) in view.tensors:
            for e in range(count):
                name = src + old.format(e=e)
                if name not in view.tensors:
                    raise FormatError(f"{view.uri}: no {name!r}; the config says {count} experts")
                used.add(name)
                out += r.transform(view.tensors[name], mc.shape, tuple(n.format(e=e) for n in names))
            return out
    raise FormatError(f"{view.uri}: no {src + r.megatron[0]!r} (nor one tensor per expert) in the checkpoint; "
                      "the config says the model has experts")


def to_hf(view: CheckpointIndex, cfg: dict[str, Any], where: str,
          family_name: str = AUTO) -> tuple[CheckpointIndex, dict[str, Any], list[str]]:
    """The view under the family's HF names and layouts, its config.json, and a report."""
    mc = read_megatron(cfg, where)
    if family_name == AUTO:
        family = detect(mc, where)
    elif family_name in FAMILIES:
        family = FAMILIES[family_name]
    else:
        raise OptionError(f"to_hf {family_name}: choose one of {', '.join(CHOICES)}", option="to_hf")
    check(family, mc, where)
    tensors: dict[str, TensorEntry] = {}
    used: set[str] = set()
    for r in TOP:
        if applies(r, mc):
            for entry in _apply(view, r, "", "", mc, used):
                tensors[entry.name] = entry
    for i in range(mc.shape.layers):
        for r in family.layer:
            if applies(r, mc, i):
                for entry in _apply(view, r, f"decoder.layers.{i}.", f"model.layers.{i}.", mc, used):
                    tensors[entry.name] = entry
    # multi-token prediction layers (mtp_num_layers): no HF class of the table runs them (transformers'
    # DeepseekV3ForCausalLM has no MTP module): left out, said in the report
    mtp = [n for n in view.tensors if n not in used and n.startswith("mtp.")] if mc.extra.get("mtp_num_layers") else []
    left = [n for n in view.tensors if n not in used and n not in mtp]
    if left:
        raise FormatError(f"{view.uri}: tensors with no {family.architecture} counterpart: {', '.join(left[:5])}"
                          + (f" (and {len(left) - 5} more)" if len(left) > 5 else "")
                          + "; export without `to_hf` to keep them")
    embed = view.tensors["embedding.word_embeddings.weight"]
    config = hf_config(family.architecture, family.model_type, mc, embed.shape[0], embed.dtype,
                       family.config_fields(mc))
    out = CheckpointIndex(uri=view.uri, format=view.format, producer=view.producer, world_size=view.world_size,
                          tensors=tensors, files=view.files)
    s = mc.shape
    moe = f", {s.experts} experts (top {mc.top_k})" if s.experts else ""
    report = [f"mapped to {family.architecture}: {s.layers} layers, {s.heads} heads in {s.groups} query groups{moe}, "
              f"vocab {config['vocab_size']} (config from {where})"]
    if mtp:
        report.append(f"left out the {mc.extra['mtp_num_layers']} multi-token prediction layer(s) ({len(mtp)} tensors "
                      f"under mtp.): {family.architecture} has no MTP module; export without `to_hf` to keep them")
    return out, config, report
