"""What the weights do not say: alpha (so the scaling), rsLoRA, fan_in_fan_out, per-module rank/alpha patterns.

They come from an `adapter_config.json` beside the source (PEFT's own, or one a training run saved), or from the
caller; the caller's values win. Alpha is never guessed: without it the scaling is unknown and the export is
refused in one line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from .. import storage
from ..errors import FormatError, OptionError
from ..jsonsafe import read_json

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass
class LoraSettings:
    alpha: float | None = None
    r: int | None = None
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_modules: list[str] | str | None = None
    modules_to_save: list[str] | None = None
    base_model_name_or_path: str | None = None
    task_type: str | None = None
    found_in: str | None = None  # the adapter_config.json read, if any

    def rank(self, module: str, default: int) -> int:
        key = pattern_key(list(self.rank_pattern), module)
        return int(self.rank_pattern.get(key, self.r if self.r is not None else default))

    def module_alpha(self, module: str) -> float:
        key = pattern_key(list(self.alpha_pattern), module)
        alpha = self.alpha_pattern.get(key, self.alpha)
        if alpha is None:
            raise OptionError(f"{module}: LoRA alpha is unknown (it is not in the weights and there is no "
                              f"{ADAPTER_CONFIG} beside the checkpoint); pass alpha=NUMBER (--lora-alpha) as the "
                              "training run set it", field="alpha")
        return alpha

    def scaling(self, module: str, rank: int) -> float:
        """PEFT's `LoraLayer.update_layer`: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA (a Python float)."""
        r, alpha = self.rank(module, rank), self.module_alpha(module)
        if r != rank:
            raise FormatError(f"{module}: rank mismatch, the adapter config says r={r} and its weights have rank "
                              f"{rank}; fix r / rank_pattern in {self.found_in or ADAPTER_CONFIG}", key=module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def pattern_key(patterns: list[str], module: str) -> str:
    """PEFT's `get_pattern_key`: the first pattern matching the end of the module name, else the name."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def config_beside(source: str) -> str | None:
    """The adapter_config.json in the source folder, or beside the source file; None if there is none."""
    source = source.rstrip("/")
    folder = source if storage.isdir(source) else storage.parent(source)
    uri = storage.join(folder, ADAPTER_CONFIG)
    return uri if storage.exists(uri) else None


def _typed(doc: dict, key: str, kinds: tuple[type, ...], where: str) -> Any:
    value = doc.get(key)
    if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
        raise FormatError(f"{where}: {key} must be {' or '.join(k.__name__ for k in kinds)}; fix the adapter config",
                          uri=where, key=key)
    return value


def _pattern(doc: dict, key: str, where: str) -> dict:
    value = doc.get(key) or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, int | float)
                                              and not isinstance(v, bool) for k, v in value.items()):
        raise FormatError(f"{where}: {key} must map module patterns to numbers; fix the adapter config", uri=where,
                          key=key)
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error:
            raise FormatError(f"{where}: {key} holds a bad regular expression; fix the adapter config", uri=where,
                              key=key) from None
    return value


def read_settings(uri: str) -> LoraSettings:
    doc = read_json(uri)
    if not isinstance(doc, dict):
        raise FormatError(f"{uri}: not a JSON object; fix the adapter config", uri=uri)
    kind = doc.get("peft_type", "LORA")
    if kind != "LORA":
        raise FormatError(f"{uri}: peft_type {kind!r} is an unknown adapter variant here (LoRA, rsLoRA and DoRA are "
                          "exported); export it with PEFT", uri=uri, key="peft_type")
    for flag in ("use_qalora", "use_bdlora"):
        if doc.get(flag):
            raise FormatError(f"{uri}: {flag} is an unknown LoRA variant here; export it with PEFT", uri=uri, key=flag)
    targets = doc.get("target_modules")
    if targets is not None and not (isinstance(targets, str) or (isinstance(targets, list)
                                    and all(isinstance(t, str) for t in targets))):
        raise FormatError(f"{uri}: target_modules must be a string or a list of strings", uri=uri,
                          key="target_modules")
    saved = doc.get("modules_to_save")
    if saved is not None and not (isinstance(saved, list) and all(isinstance(t, str) for t in saved)):
        raise FormatError(f"{uri}: modules_to_save must be a list of strings", uri=uri, key="modules_to_save")
    return LoraSettings(
        alpha=_typed(doc, "lora_alpha", (int, float), uri), r=_typed(doc, "r", (int,), uri),
        use_rslora=bool(_typed(doc, "use_rslora", (bool,), uri)),
        fan_in_fan_out=bool(_typed(doc, "fan_in_fan_out", (bool,), uri)),
        rank_pattern=_pattern(doc, "rank_pattern", uri), alpha_pattern=_pattern(doc, "alpha_pattern", uri),
        target_modules=targets, modules_to_save=saved,
        base_model_name_or_path=_typed(doc, "base_model_name_or_path", (str,), uri),
        task_type=_typed(doc, "task_type", (str,), uri), found_in=uri)


def settings_for(source: str, alpha: float | None = None, use_rslora: bool | None = None,
                 fan_in_fan_out: bool | None = None, config: str | None = None) -> LoraSettings:
    """The settings of the adapter at `source`: its adapter_config.json (or `config`), the caller's values over it."""
    where = config or config_beside(source)
    found = read_settings(where) if where else LoraSettings()
    if alpha is not None:
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
            raise OptionError(f"alpha={alpha!r}: LoRA alpha must be a positive number", field="alpha")
        found.alpha, found.alpha_pattern = alpha, {}
    if use_rslora is not None:
        found.use_rslora = use_rslora
    if fan_in_fan_out is not None:
        found.fan_in_fan_out = fan_in_fan_out
    return found
