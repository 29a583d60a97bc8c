"""GGUF export proven by the consumer's own load: llama.cpp (through llama-cpp-python, built from source) reads the
file ckpt-service writes for tiny random Llama, Qwen3, Qwen3-MoE and Mixtral models with a tokenizer trained here,
tokenizes a prompt as transformers' tokenizer does, and its logits for that prompt match transformers' forward on
the original (float32) weights: F32 to float32 rounding, F16/BF16 to their rounding, Q8_0 within the bound below.

CI needs llama-cpp-python==0.3.36 built from the sdist in $CKPT_CI_CACHE (.ci/run builds the wheel once and keeps it
there); without it these tests skip with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from . import gguf_reference

gguf = pytest.importorskip("gguf")  # gguf-py, which converters.gguf_export writes with
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: .ci/run builds it from the "
                                                    "sdist in $CKPT_CI_CACHE (CMAKE_ARGS=-DGGML_NATIVE=OFF ...)")

from converters.gguf_export import export_gguf  # noqa: E402  (after the skip: it imports gguf)

PROMPT = "The quick brown fox jumps over the lazy dog. Llamas and qwens write 1234 tokens, don't they?"
FAMILIES = ("llama", "qwen3", "qwen3moe", "mixtral")
#: Bounds on llama.cpp's logits against transformers', relative to transformers' logits: (largest |difference| over
#: all positions and tokens / largest |logit|, root-mean-square difference / root-mean-square logit), per type; the
#: largest values measured on these four models (2 layers, hidden 64, 43 prompt tokens) are in the comments.
#: F32: both compute in float32 (the KV cache is set to F32 here), only the order of the sums differs.
#: F16/BF16: the weights are rounded to 11/8 significant bits, and llama.cpp also rounds the activations to the
#: weight type before each matrix product (its vec_dot_f16/bf16): a few units of the type's rounding.
#: Q8_0: weights in blocks of 32 as int8 times an f16 scale (error up to max|w|/254 per weight), and llama.cpp
#: quantizes the activations to Q8_0 as well (vec_dot_q8_0_q8_0); the root-mean-square error is that noise (1.8%),
#: while the largest comes from the MoE model at one token where its layer-0 router logits for the 2nd and 3rd
#: expert are 4e-4 apart (median gap 0.09), so llama.cpp may pick the other: 4.3% there, 1.9% for the dense models.
#: The bounds leave 2-20x margin.
BOUND = {"f32": (1e-5, 1e-5),     # measured 4.8e-7, 4.0e-7
         "f16": (3e-3, 2e-3),     # measured 8.1e-4, 6.3e-4
         "bf16": (2e-2, 1.5e-2),  # measured 5.7e-3, 5.0e-3
         "q8_0": (0.1, 0.04)}     # measured 0.043 (0.019 dense), 0.018


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-runtime")
    return {family: gguf_reference.tiny_model(family, root / family, torch.float32) for family in FAMILIES}


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> dict[str, tuple[list[int], torch.Tensor]]:
    """transformers' token ids for PROMPT and its float32 logits for them, per family."""
    out = {}
    for family, folder in models.items():
        ids = transformers.AutoTokenizer.from_pretrained(folder)(PROMPT, add_special_tokens=False)["input_ids"]
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            out[family] = (ids, model(torch.tensor([ids])).logits[0])
    return out


def _llama_cpp_logits(path: Path, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """llama.cpp's token ids for PROMPT and its logits for `ids` (every position), from the GGUF at `path`."""
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=128, n_batch=128, n_threads=2,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, verbose=False)
    try:
        tokens = llm.tokenize(PROMPT.encode(), add_bos=False, special=False)
        llm.eval(ids)
        return tokens, torch.from_numpy(llm.scores[: len(ids)].copy())
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_logits_match_transformers(models: dict[str, Path], reference: dict[str, tuple[list[int],
                                             torch.Tensor]], tmp_path: Path, family: str, outtype: str) -> None:
    path = tmp_path / f"{family}-{outtype}.gguf"
    export_gguf(str(models[family]), str(path), outtype)
    ids, expected = reference[family]
    tokens, logits = _llama_cpp_logits(path, ids)
    assert tokens == ids  # the tokenizer metadata: llama.cpp splits the prompt as transformers does
    assert logits.shape == expected.shape == (len(ids), 320)
    largest = (logits - expected).abs().max().item() / expected.abs().max().item()
    rms = ((logits - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt()).item()
    print(f"{family} {outtype}: relative logit error: largest {largest:.3g}, root-mean-square {rms:.3g}")
    assert largest <= BOUND[outtype][0] and rms <= BOUND[outtype][1], (family, outtype, largest, rms)
    if outtype == "f32":  # the same next token everywhere
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
