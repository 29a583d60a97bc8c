"""What `inspect` shows of a LoRA adapter: rank, alpha (when known), target modules, variant, modules_to_save,
size in bytes and parameters. Reads names, shapes and the adapter_config.json beside the checkpoint; no tensor
data, no torch."""

from __future__ import annotations

from typing import Any

from .. import dtypes
from ..errors import CkptError
from ..index import CheckpointIndex, TensorEntry
from ..transforms import KeyOptions, apply
from .detect import Adapter, find_adapter
from .lora_settings import ADAPTER_WEIGHTS, LoraSettings, settings_for


def describe(adapter: Adapter, settings: LoraSettings, tensors: dict[str, TensorEntry]) -> dict[str, Any]:
    """The adapter as `inspect` and the exports' results show it."""
    modules = adapter.modules.values()
    names = [n for m in modules for n in (m.a, m.b, m.b_bias, m.magnitude) if n] + list(adapter.replaced.values())
    variant = [v for v, on in (("rslora", settings.use_rslora), ("dora", "dora" in adapter.variants)) if on]
    return {"name": adapter.name, "variant": "+".join(variant) or "lora", "modules": len(adapter.modules),
            "ranks": sorted({m.rank for m in modules}), "alpha": settings.alpha,
            "alpha_pattern": dict(settings.alpha_pattern), "use_rslora": settings.use_rslora,
            "variants": sorted(adapter.variants),
            "target_modules": sorted({m.name.rpartition(".")[2] for m in modules}),
            "modules_to_save": sorted(adapter.replaced),
            "bytes": sum(tensors[n].nbytes for n in names),
            "parameters": sum(dtypes.numel(tensors[n].shape) for n in names),
            "other_adapters": adapter.other_adapters, "config": settings.found_in}


def adapter_info(index: CheckpointIndex) -> dict[str, Any] | None:
    """The adapter in `index` (as read, before any key clean-up) described, None when it holds none; an adapter
    the engine cannot export is {"error": the one-line reason} (inspect still shows the rest)."""
    if not any("lora_" in name for name in index.tensors):
        return None
    try:
        model = apply(index, KeyOptions(only="model")).index
        saved_file = any(f.rpartition("/")[2] == ADAPTER_WEIGHTS for f in index.files) or \
            index.uri.rstrip("/").endswith(ADAPTER_WEIGHTS)
        found = find_adapter(model, saved_file=saved_file)
        if found is None:
            return None
        return describe(found, settings_for(index.uri), model.tensors)
    except CkptError as exc:
        return {"error": str(exc)}
