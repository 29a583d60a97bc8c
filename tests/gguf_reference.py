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
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

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
