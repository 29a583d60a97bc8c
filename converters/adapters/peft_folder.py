"""The adapter alone as PEFT saves it: `adapter_model.safetensors` under PEFT's saved names and
`adapter_config.json`, which `peft.PeftModel.from_pretrained` loads onto the base model."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from .detect import PEFT_PREFIX, Adapter
from .lora_settings import LoraSettings, pattern_key

#: PEFT's LoraConfig fields a loader reads, with PEFT's defaults (the rest it fills in itself)
_DEFAULTS: dict[str, Any] = {
    "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": None, "bias": "none",
    "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
    "layer_replication": None, "layers_pattern": None, "layers_to_transform": None, "loftq_config": {},
    "lora_alpha": 8, "lora_bias": False, "lora_dropout": 0.0, "megatron_config": None,
    "megatron_core": "megatron.core", "modules_to_save": None, "peft_type": "LORA", "r": 8, "rank_pattern": {},
    "revision": None, "target_modules": None, "task_type": None, "use_dora": False, "use_rslora": False,
}


def saved_names(adapter: Adapter) -> dict[str, str]:
    """Output name (as `save_pretrained` writes it) -> checkpoint name, for every adapter tensor."""
    out: dict[str, str] = {}
    for module in adapter.modules.values():
        at = f"{PEFT_PREFIX}{module.name}"
        if module.kind == "embedding":
            out[f"{at}.lora_embedding_A"], out[f"{at}.lora_embedding_B"] = module.a, module.b
        else:
            out[f"{at}.lora_A.weight"], out[f"{at}.lora_B.weight"] = module.a, module.b
        if module.b_bias:
            out[f"{at}.lora_B.bias"] = module.b_bias
        if module.magnitude:
            out[f"{at}.lora_magnitude_vector"] = module.magnitude
    for base, name in adapter.replaced.items():
        out[f"{PEFT_PREFIX}{base}"] = name
    return dict(sorted(out.items()))


def adapter_config(adapter: Adapter, settings: LoraSettings, source_doc: dict | None,
                   base_model: str | None) -> dict[str, Any]:
    """adapter_config.json: the source's own config (when there is one) with what the weights say set over it."""
    doc = dict(_DEFAULTS)
    doc.update(source_doc or {})
    ranks = Counter(m.rank for m in adapter.modules.values())
    r = settings.r if settings.r is not None and settings.r in ranks else ranks.most_common(1)[0][0]
    doc["r"] = r
    pattern = dict(settings.rank_pattern)
    for m in adapter.modules.values():  # a module whose rank neither r nor a pattern gives: a pattern of its own
        if int(pattern.get(pattern_key(list(pattern), m.name), r)) != m.rank:
            pattern[m.name] = m.rank
    doc["rank_pattern"] = pattern
    if settings.alpha is not None:
        doc["lora_alpha"] = settings.alpha
    doc["alpha_pattern"] = dict(settings.alpha_pattern)
    doc["use_rslora"] = settings.use_rslora
    doc["fan_in_fan_out"] = settings.fan_in_fan_out
    doc["use_dora"] = "dora" in adapter.variants
    doc["lora_bias"] = any(m.b_bias for m in adapter.modules.values())
    doc["peft_type"] = "LORA"
    doc["inference_mode"] = True
    if not settings.target_modules:
        doc["target_modules"] = sorted({m.name.rpartition(".")[2] for m in adapter.modules.values()})
    if adapter.replaced and not settings.modules_to_save:
        doc["modules_to_save"] = sorted({name.rpartition(".")[0] for name in adapter.replaced})
    if base_model:
        doc["base_model_name_or_path"] = base_model
    return doc


def config_bytes(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
