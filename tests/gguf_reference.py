"""llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py` + its `conversion/` and `gguf-py/`), the oracle of
tests/test_gguf_export.py, taken from the llama-cpp-python source distribution (which vendors llama.cpp).

The sdist is downloaded once into $CKPT_CI_CACHE (default ~/.cache/ckpt-service) with
`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`, and the three parts are unpacked beside it.
`converter()` returns the folder holding convert_hf_to_gguf.py, or skips the test with the reason when the
download is impossible (offline without a cache).

Run as a script, this file runs the converter with one addition: a BPE tokenizer whose pre-tokenizer hash
llama.cpp does not know (its chkhsh: the sha256 of its token ids for llama.cpp's check text) is registered under the
pre-tokenizer name given, which is what llama.cpp's convert_hf_to_gguf_update.py does for every model it knows. A
tiny tokenizer trained for a test has ids of its own, so its hash is in no table; everything else runs as llama.cpp
wrote it.

`tiny_model()` makes the tiny random models (transformers' own classes) with a BPE tokenizer trained here that both
test_gguf_export (same file as the converter's) and test_gguf_runtime (llama.cpp's logits) export.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def cache_dir() -> Path:
    return Path(os.environ.get("CKPT_CI_CACHE") or Path.home() / ".cache" / "ckpt-service")


def _prepare() -> tuple[Path | None, str]:
    cache = cache_dir()
    root = cache / f"llama.cpp-{VERSION}"
    if (root / "convert_hf_to_gguf.py").is_file():
        return root, ""
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / SDIST
    if not sdist.is_file():
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               f"llama-cpp-python=={VERSION}", "-d", str(cache)], capture_output=True, text=True,
                              timeout=900)
        if done.returncode or not sdist.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return None, f"cannot download llama-cpp-python=={VERSION} (llama.cpp's converter): {tail[0]}"
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    staging = cache / f".llama.cpp-{VERSION}.partial"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefix)
                   and m.name[len(prefix):].startswith(_PARTS)]
        for member in members:
            member.name = member.name[len(prefix):]
        tar.extractall(staging, members=members, filter="data")
    os.replace(staging, root)
    return root, ""


def converter() -> Path:
    """The folder of llama.cpp's convert_hf_to_gguf.py; skips the calling test if it cannot be had."""
    import pytest

    root, why = _prepare()
    if root is None:
        pytest.skip(why)
    return root


def convert(model: Path, out: Path, outtype: str, pre: str | None = None) -> None:
    """Run llama.cpp's converter on the HF folder `model`, writing `out` (raises with its output on failure);
    `pre`: the pre-tokenizer name a BPE tokenizer whose hash llama.cpp does not know is registered under."""
    root = converter()
    args = [sys.executable, __file__, pre or "", str(model), "--outfile", str(out), "--outtype", outtype]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "gguf-py"), str(root)]), NO_LOCAL_GGUF="1")
    done = subprocess.run(args, capture_output=True, text=True, env=env, cwd=root, timeout=600)
    if done.returncode:
        raise AssertionError(f"convert_hf_to_gguf.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")


# ---------------------------------------------------------------- tiny models (test_gguf_export, test_gguf_runtime)

#: The pre-tokenizer regexes of Llama 3 and Qwen2 as their tokenizer.json files hold them.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
TEXT = ["The quick brown fox jumps over the lazy dog. " * 3, "Llamas and qwens write 1234 tokens, don't they?",
        "def main():\n    return 42\n", "Überall café naïve — 😀 emojis too."] * 20
#: llama.cpp's pre-tokenizer name for each family's tokenizer
PRE = {"llama": "llama-bpe", "mixtral": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "qwen3moe": "qwen2"}


def train_tokenizer(folder: Path, split: str, vocab: int = 300) -> None:
    """A byte-level BPE tokenizer trained here on TEXT, saved as tokenizer.json + tokenizer_config.json."""
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|im_end|>")
    fast.save_pretrained(folder)


def tiny_model(family: str, folder: Path, dtype: torch.dtype | None = None) -> Path:
    """A random tiny model of `family` (a key of PRE) saved by transformers itself (bfloat16 unless `dtype`), with
    a tokenizer trained here."""
    import torch
    import transformers

    torch.manual_seed(0)
    common: dict[str, Any] = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False, rms_norm_eps=1e-5)
    model: Any  # transformers' class for the family
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32))
    elif family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2))
    else:  # norm_topk_prob as every released Qwen3-MoE sets it (and llama.cpp's qwen3moe graph assumes)
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=32, moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
            norm_topk_prob=True))
    with torch.no_grad():  # norms away from 1.0 so that their bytes say something
        for param in model.parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5)
    model.to(dtype or torch.bfloat16).save_pretrained(folder)
    train_tokenizer(folder, LLAMA3_SPLIT if family in ("llama", "mixtral") else QWEN2_SPLIT)
    return folder


def _main(pre: str, args: list[str]) -> None:
    import runpy

    from conversion.base import TextModel  # llama.cpp's, from the PYTHONPATH `convert` sets

    known = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):  # type: ignore[no-untyped-def]
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # the test tokenizer's hash: registered as `pre`
            if not pre:
                raise
            return pre

    TextModel.get_vocab_base_pre = get_vocab_base_pre  # type: ignore[method-assign]
    sys.argv = ["convert_hf_to_gguf.py", *args]
    runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2:])
