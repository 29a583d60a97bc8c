"""Which tensors of an HF checkpoint become FP8, judged by name and shape (there are no modules to look at):
the 2-D `<module>.weight` of every Linear layer, as llm-compressor's `targets=["Linear"]` picks them.

Kept in their source dtype: embeddings (not Linear layers), norms and every other 1-D tensor or bias, MoE
routers (always: `ROUTERS`), and each module the `ignore` list names, with llm-compressor's syntax (an exact
module name, or `re:<regex>` matched from the start of the name, compressed_tensors.utils.match.match_name).
The Linear layers kept are listed in the config's `ignore`, in model order, as llm-compressor lists them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import OptionError

#: MoE routers/gates, kept in high precision whatever `ignore` says (llm-compressor's MoE examples ignore them)
ROUTERS = ("re:.*mlp\\.gate$", "re:.*mlp\\.shared_expert_gate$", "re:.*block_sparse_moe\\.gate$",
           "re:.*\\.router$", "re:.*mlp\\.router\\.gate$")
_EMBEDDINGS = re.compile(r"(^|\.)(embed_tokens|wte|wpe|word_embeddings|embed_positions|embeddings|embed_in|"
                         r"position_embeddings|token_type_embeddings|tok_embeddings)$")
_NORM = re.compile(r"norm[^.]*$|(^|\.)ln_[^.]*$")


def compile_ignore(ignore: Iterable[str]) -> list[str]:
    """The `ignore` entries checked: strings, and `re:` patterns that compile."""
    checked = []
    for item in ignore:
        if not isinstance(item, str) or not item:
            raise OptionError(f"ignore {item!r}: give module names (lm_head) or re:<regex> patterns", field="ignore")
        if item.startswith("re:"):
            try:
                re.compile(item[3:])
            except re.error as exc:
                raise OptionError(f"ignore {item}: bad regular expression ({exc})", field="ignore") from None
        checked.append(item)
    return checked


def match_name(name: str, target: str) -> bool:
    """compressed-tensors' rule: `re:` patterns with re.match, anything else by equality."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether `name` is the weight of a Linear layer (2-D, `.weight`, not an embedding or a norm)."""
    module, _, param = name.rpartition(".")
    return (param == "weight" and len(shape) == 2 and bool(module) and not _EMBEDDINGS.search(module)
            and not _NORM.search(module))


def _model_order(name: str) -> tuple:
    """Roughly `model.named_modules()` order: the body by layer number, then heads such as lm_head."""
    parts = [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split(".")]
    return (name.startswith("lm_head"), parts)


@dataclass
class Selection:
    quantized: list[str] = field(default_factory=list)  # module names whose weight becomes FP8
    ignored: list[str] = field(default_factory=list)  # Linear modules kept (the config's `ignore`)


def select(tensors: dict[str, tuple[int, ...]], ignore: list[str], tied_head: bool) -> Selection:
    """Split the Linear weights among `tensors` (name -> shape) into quantized and ignored modules. With
    `tied_head` (tie_word_embeddings and no lm_head.weight stored) lm_head shares the embedding, which stays in
    high precision, so it is listed as ignored like llm-compressor lists an ignored lm_head."""
    chosen = Selection()
    for name, shape in tensors.items():
        if not is_linear_weight(name, shape):
            continue
        module = name.rpartition(".")[0]
        if any(match_name(module, target) for target in (*ignore, *ROUTERS)):
            chosen.ignored.append(module)
        else:
            chosen.quantized.append(module)
    if tied_head and "lm_head.weight" not in tensors:
        chosen.ignored.append("lm_head")
    chosen.ignored.sort(key=_model_order)
    return chosen
