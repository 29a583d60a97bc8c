"""Kept for `converters.storage` until it reads `config.current()`: build an `EngineConfig` instead
(`EngineConfig.from_env` reads the `CKPT_*` variables; nothing else in the engine reads the environment)."""

from __future__ import annotations

from .config import env_positive_int as positive_int

__all__ = ["positive_int"]
