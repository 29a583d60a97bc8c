"""LoRA adapters (LoRA, rsLoRA, DoRA; modules_to_save): found by structure in any checkpoint the engine reads,
exported alone as a PEFT folder (`export_adapter`) or merged into their base as PEFT's `merge_and_unload()`
(`export_merged`)."""

from .detect import Adapter, LoraModule, find_adapter
from .export import AdapterResult, describe, export_adapter, export_merged
from .lora_settings import LoraSettings, settings_for

__all__ = ["Adapter", "AdapterResult", "LoraModule", "LoraSettings", "describe", "export_adapter", "export_merged",
           "find_adapter", "settings_for"]
