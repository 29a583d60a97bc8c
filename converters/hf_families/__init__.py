"""Megatron GPT checkpoints as Hugging Face models, family by family, from one declarative table (`table.py`)."""

from __future__ import annotations

from .config import megatron_args, read_megatron
from .mapping import AUTO, CHOICES, detect, to_hf
from .table import FAMILIES, Family, Rule

__all__ = ["AUTO", "CHOICES", "FAMILIES", "Family", "Rule", "detect", "megatron_args", "read_megatron", "to_hf"]
