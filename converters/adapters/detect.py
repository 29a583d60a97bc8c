"""Find LoRA adapters in a checkpoint by structure, under any wrapper prefix.

PEFT's names, live (a training checkpoint: FSDP/DCP, Accelerate, DeepSpeed, after the engine's wrapper clean-up):

    base_model.model.<module>.base_layer.weight                       the frozen base weight
    base_model.model.<module>.lora_A.<adapter>.weight                 [r, in]
    base_model.model.<module>.lora_B.<adapter>.weight (.bias)         [out, r] (lora_bias)
    base_model.model.<module>.lora_magnitude_vector.<adapter>.weight  [out] (DoRA)
    base_model.model.<module>.lora_embedding_A.<adapter>              [r, num_embeddings] (an Embedding)
    base_model.model.<module>.lora_embedding_B.<adapter>              [dim, r]
    base_model.model.<module>.modules_to_save.<adapter>.<leaf>        replaces <module>.<leaf>
    base_model.model.<module>.original_module.<leaf>                  the base's own <module>.<leaf>

and as `save_pretrained` writes them (adapter_model.safetensors): the same without the adapter name nor the
magnitude's `.weight`, and a modules_to_save module under its own name (`base_model.model.lm_head.weight`).

`find_adapter` turns the names into one `Adapter`: per adapted module its rank, in/out features, variant and the
base weight it belongs to; the modules_to_save replacements; and, for a training checkpoint, where each base
weight lies. It reads no tensor data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..errors import FormatError, OptionError
from ..index import CheckpointIndex, TensorEntry

PEFT_PREFIX = "base_model.model."
LORA_ROLES = {"lora_A": "a", "lora_B": "b", "lora_magnitude_vector": "magnitude",
              "lora_embedding_A": "a", "lora_embedding_B": "b"}
#: tensor name tokens of other PEFT methods (and LoRA variants this engine does not merge), with their names
OTHER_METHODS = {"hada_w1_a": "LoHa", "hada_w1_b": "LoHa", "lokr_w1": "LoKr", "lokr_w1_a": "LoKr", "ia3_l": "IA3",
                 "oft_R": "OFT", "oft_r": "OFT", "boft_R": "BOFT", "vera_lambda_b": "VeRA", "vera_lambda_d": "VeRA",
                 "lora_E": "AdaLoRA", "ranknum": "AdaLoRA", "fourierft_spectrum": "FourierFT",
                 "hra_u": "HRA", "vblora_logits_A": "VB-LoRA", "lora_embedding_magnitude": "DoRA on an embedding"}
Kind = Literal["linear", "embedding"]
Variant = Literal["lora", "dora"]


@dataclass
class LoraModule:
    """One adapted module, named as in the base model (`model.layers.0.self_attn.q_proj`); tensors by their
    names in the checkpoint."""

    name: str
    kind: Kind
    a: str = ""
    b: str = ""
    b_bias: str | None = None  # lora_bias=True
    magnitude: str | None = None  # DoRA
    rank: int = 0
    in_features: int = 0
    out_features: int = 0

    @property
    def variant(self) -> Variant:
        return "dora" if self.magnitude else "lora"

    @property
    def weight(self) -> str:
        """The base weight it belongs to."""
        return f"{self.name}.weight"


@dataclass
class Adapter:
    """An adapter found in `uri`. `replaced`: base tensor name -> checkpoint name of its modules_to_save copy;
    `base`: base tensor name -> checkpoint name, for the base weights the checkpoint also holds."""

    uri: str
    name: str
    prefix: str  # the wrapper prefix before the base model's names ("base_model.model." for PEFT)
    modules: dict[str, LoraModule] = field(default_factory=dict)
    replaced: dict[str, str] = field(default_factory=dict)
    base: dict[str, str] = field(default_factory=dict)
    other_adapters: list[str] = field(default_factory=list)

    @property
    def variants(self) -> set[str]:
        return {m.variant for m in self.modules.values()}

    def nbytes(self, tensors: dict[str, TensorEntry]) -> int:
        names = [n for m in self.modules.values() for n in (m.a, m.b, m.b_bias, m.magnitude) if n]
        return sum(tensors[n].nbytes for n in names + list(self.replaced.values()))


@dataclass
class _Parsed:
    module: str  # tokens before the role, as found (prefix included)
    role: str  # a, b, magnitude, saved, original, base_layer
    adapter: str | None
    leaf: str  # weight, bias, or "" (a parameter of its own)
    embedding: bool = False


def _parse(name: str) -> _Parsed | None:
    tokens = name.split(".")
    for i, token in enumerate(tokens):
        if token in OTHER_METHODS:
            raise FormatError(f"{name}: a {OTHER_METHODS[token]} adapter tensor; only LoRA, rsLoRA and DoRA on Linear "
                              "layers (and plain LoRA on embeddings) are exported, export this adapter with PEFT",
                              key=name)
        rest = tokens[i + 1:]
        module = ".".join(tokens[:i])
        if token in LORA_ROLES and i:
            if len(rest) == 1 and rest[0] in ("weight", "bias"):
                adapter, leaf = None, rest[0]
            elif len(rest) <= 2 and all(rest):
                adapter, leaf = (rest[0] if rest else None), (rest[1] if len(rest) == 2 else "")
            else:
                return None
            return _Parsed(module, LORA_ROLES[token], adapter, leaf, token.startswith("lora_embedding"))
        if token == "modules_to_save" and i and len(rest) >= 2:
            return _Parsed(module, "saved", rest[0], ".".join(rest[1:]))
        if token in ("original_module", "base_layer") and i and rest:
            return _Parsed(module, token, None, ".".join(rest))
        if token.startswith("lora_") and i:
            raise FormatError(f"{name}: {token} is not a LoRA tensor this engine knows (lora_A, lora_B, "
                              "lora_magnitude_vector, lora_embedding_A/B); an unknown LoRA variant, export it "
                              "with PEFT", key=name)
    return None


def _strip(module: str) -> tuple[str, str]:
    """(wrapper prefix, module name in the base model)."""
    at = f".{module}.".find(f".{PEFT_PREFIX}")
    if at < 0:
        return "", module
    end = at + len(PEFT_PREFIX)
    return module[:end], module[end:]


def _base_name(name: str, prefix: str) -> str:
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def find_adapter(index: CheckpointIndex, adapter: str | None = None, saved_file: bool = False) -> Adapter | None:
    """The LoRA adapter in `index` (its model tensors, wrapper-cleaned), or None when it holds none. `saved_file`:
    the index is PEFT's adapter_model file, whose plain names are modules_to_save copies (not base weights).
    With several adapters, `adapter` picks one (else refused in one line naming them)."""
    parsed = {name: _parse(name) for name in index.tensors}
    lora = {n: p for n, p in parsed.items() if p and p.role in ("a", "b", "magnitude")}
    if not lora:
        return None
    names = sorted({p.adapter for p in parsed.values() if p and p.adapter and p.role in ("a", "b", "magnitude",
                                                                                          "saved")})
    if adapter is None:
        if len(names) > 1:
            raise OptionError(f"{index.uri}: holds the adapters {', '.join(names)}; pick one with adapter=NAME",
                              field="adapter", uri=index.uri)
        adapter = names[0] if names else "default"
    elif names and adapter not in names:
        raise OptionError(f"{index.uri}: no adapter {adapter!r}; it holds {', '.join(names)}", field="adapter",
                          uri=index.uri)
    prefixes = {_strip(p.module)[0] for p in lora.values()}
    if len(prefixes) > 1:
        raise FormatError(f"{index.uri}: LoRA tensors under several wrapper prefixes ({', '.join(sorted(prefixes))}); "
                          "the checkpoint mixes models", uri=index.uri)
    found = Adapter(index.uri, adapter, prefixes.pop(), other_adapters=[n for n in names if n != adapter])
    for name, p in parsed.items():
        if p is not None and p.adapter not in (None, adapter):
            continue  # another adapter's tensor
        if p is None or p.role in ("base_layer", "original_module"):
            base = _base_name(name, found.prefix) if p is None else \
                f"{_base_name(p.module, found.prefix)}.{p.leaf}"
            if p is None and saved_file:
                found.replaced[base] = name
            else:
                found.base.setdefault(base, name)
            continue
        module = _strip(p.module)[1]
        if p.role == "saved":
            found.replaced[f"{module}.{p.leaf}"] = name
            continue
        entry = found.modules.setdefault(module, LoraModule(module, "embedding" if p.embedding else "linear"))
        if p.role == "b" and p.leaf == "bias":
            entry.b_bias = name
        else:
            setattr(entry, p.role, name)
    for lora_module in found.modules.values():
        _shape(lora_module, index.tensors, index.uri)
    return found


def _shape(module: LoraModule, tensors: dict[str, TensorEntry], uri: str) -> None:
    """Fill in rank and features from the shapes; refuse a half or inconsistent module in one line."""
    for role in ("a", "b"):
        if not getattr(module, role):
            have = module.b or module.a or module.magnitude
            raise FormatError(f"{have}: lora_{role.upper()} of {module.name} is missing; the checkpoint is incomplete",
                              uri=uri, key=have)
    a, b = tensors[module.a].shape, tensors[module.b].shape
    if len(a) != 2 or len(b) != 2:
        raise FormatError(f"{module.a}: LoRA of shape {list(a)} x {list(b)} (a convolution?) is an unknown variant "
                          "here; only Linear and Embedding LoRA are exported", uri=uri, key=module.a)
    module.rank, module.in_features, module.out_features = a[0], a[1], b[0]  # an Embedding's in: its vocabulary
    if b[1] != module.rank:
        raise FormatError(f"{module.b}: rank mismatch, lora_A has rank {a[0]} and lora_B {b[1]}; the adapter is "
                          "damaged", uri=uri, key=module.b)
    if module.magnitude and module.kind == "embedding":
        raise FormatError(f"{module.magnitude}: DoRA on an embedding is an unknown variant here; export it with PEFT",
                          uri=uri, key=module.magnitude)
    if module.magnitude and tensors[module.magnitude].shape != (module.out_features,):
        raise FormatError(f"{module.magnitude}: DoRA magnitude of shape {list(tensors[module.magnitude].shape)}, "
                          f"expected [{module.out_features}]; the adapter is damaged", uri=uri, key=module.magnitude)
    if module.b_bias and tensors[module.b_bias].shape != (module.out_features,):
        raise FormatError(f"{module.b_bias}: lora_B bias of shape {list(tensors[module.b_bias].shape)}, expected "
                          f"[{module.out_features}]; the adapter is damaged", uri=uri, key=module.b_bias)
