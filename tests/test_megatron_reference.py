"""Logits of `import`ed Gemma 2, Gemma 3 and DeepSeek-V3 checkpoints, from the Megatron tensors alone.

megatron-core 0.16 on CPU builds neither Gemma's post-norms nor MLA (both need Transformer Engine), so for these
families the Megatron side is checked against tests/megatron_reference.py: a plain-torch forward written from
megatron-core's layout and semantics, fed only what `import_hf` wrote (read back with our own reader). The oracle
is the transformers model the import came from (random weights, eval, fp32).

Tolerance: atol 1e-5 on logits of magnitude ~3 (fp32; what differs is only the order of the float operations:
observed max 0 for Gemma 2, ~1e-6 for Gemma 3 and DeepSeek-V3). A wrong layout or semantic (a row order, a norm,
a window one key too wide) moves the logits by 1e-2 or more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from converters.hf_families.importer import import_hf

from . import megatron_reference as reference
from .test_hf_families import COMMON, IDS, MODELS

ATOL = 1e-5
# DeepSeek-V3's q_a/kv_a layernorms have a fixed eps of 1e-6 in transformers, while megatron-core's MLA uses
# layernorm_epsilon for every norm: a model is expressible only with rms_norm_eps 1e-6 (as the released ones)
FIELDS = {"gemma2": {}, "gemma3": {}, "deepseek_v3": {"rms_norm_eps": 1e-6}}


def _hf_model(family: str, folder: Path) -> torch.Tensor:
    """A tiny model of the family's transformers class saved at `folder`; its logits on IDS."""
    import transformers

    config_class, fields = MODELS[family]
    torch.manual_seed(len(family))
    config = getattr(transformers, config_class)(**{**COMMON, **fields, **FIELDS[family]})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # untrained norms are zeros (Gemma) or ones: make every value distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(folder)
        return model(IDS).logits[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FIELDS))
def test_reference_forward_of_the_import_equals_transformers(tmp_path: Path, family: str) -> None:
    want = _hf_model(family, tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "megatron"))
    with torch.no_grad():
        got = reference.logits(str(tmp_path / "megatron"), IDS[0])
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=0, atol=ATOL), (got - want).abs().max()


@pytest.mark.slow
def test_the_reference_sees_a_window_one_key_too_wide(tmp_path: Path) -> None:
    """The check is not vacuous: Gemma 2's sliding window as (W, 0) instead of (W - 1, 0) (what `import` wrote
    before) changes every logit past the window (IDS is longer than it), by far more than ATOL."""
    want = _hf_model("gemma2", tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "megatron"))
    tensors, args = reference.read_megatron(str(tmp_path / "megatron"))
    assert args["window_size"] == [MODELS["gemma2"][1]["sliding_window"] - 1, 0]
    with torch.no_grad():
        wide = reference.gemma_logits(tensors, {**args, "window_size": [args["window_size"][0] + 1, 0]}, IDS[0])
    window = MODELS["gemma2"][1]["sliding_window"]
    assert torch.allclose(wide[:window], want[:window], rtol=0, atol=ATOL)
    assert (wide[window:] - want[window:]).abs().amax(-1).min() > 1e-2
