"""LoRA adapters (LoRA, rsLoRA, DoRA; modules_to_save): found by structure in any checkpoint the engine reads,
described for `inspect` (`adapter_info`, no torch), exported alone as a PEFT folder (`export_adapter`) or merged
into their base as PEFT's `merge_and_unload()` (`export_merged`). The exports load on first use (PEP 562), so
that inspect imports no torch."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .detect import Adapter, LoraModule, find_adapter
from .inspection import adapter_info, describe
from .lora_settings import LoraSettings, settings_for

if TYPE_CHECKING:
    from .export import AdapterResult, export_adapter, export_merged

_LAZY = {"AdapterResult": "export", "export_adapter": "export", "export_merged": "export"}

__all__ = ["Adapter", "AdapterResult", "LoraModule", "LoraSettings", "adapter_info", "describe", "export_adapter",
           "export_merged", "find_adapter", "settings_for"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
