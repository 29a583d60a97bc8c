"""The inputs, peers and output checks of bench_convert.py's rows for this round's writers (issues 30-32, 34, 36).

Sources (made once per size under WORK/samples/<size>/, reused after):

- ``megatron-moe``: a Mixtral-shaped HF folder (bench_hf_families.make_hf) imported as a Megatron-core torch_dist
  folder by ``converters.import_hf``; ``export --to-hf auto`` of it must give the HF tensors back bit for bit.
- ``llama-hf``: a random LlamaForCausalLM saved by transformers (fp32; hidden 2048 from 1 GB up, layers added
  until the size is reached) with a byte-level BPE tokenizer trained by tests/test_gguf_export.py's helper, and a
  PEFT LoRA on it (merge_adapter.make_data: r=64 on every Linear layer, lora_B random) in ``adapter/``.
- ``llama-dcp``: the same weights as a torch.distributed.checkpoint (what training leaves); config and tokenizer
  come from ``llama-hf`` (``--config-from``).
- ``archive-store``: the FSDP2 sample archived once (id ``bench``) for the restore row.

References the checks compare with are made once by the tools a user would otherwise run (llama.cpp's
convert_hf_to_gguf.py, llm-compressor's oneshot, PEFT's merge_and_unload) and cached beside the source.
"""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ARCHIVE_ID = "bench"
GGUF_PRE = "llama-bpe"  # the pre-tokenizer the trained tokenizer is registered under (tests/gguf_reference.py)


def _python(*code: str) -> list[str]:
    """``python -c CODE ARGS...`` with benchmarks/ and the repository on sys.path."""
    prelude = f"import sys; sys.path[:0] = [{str(HERE)!r}, {str(ROOT)!r}]; "
    return [sys.executable, "-c", prelude + code[0], *code[1:]]


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=7200)
    if done.returncode:
        raise RuntimeError(f"making {what} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def _made(folder: Path, make: str, what: str, *args: str) -> Path:
    """``folder``, made by ``python -c make`` (into ``folder.partial``, then renamed) unless it exists."""
    if folder.exists():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    print(f"making {what} in {folder} ...", flush=True)
    _run(_python(make, str(partial), *args), what)
    partial.rename(folder)
    return folder


# --- sources ---------------------------------------------------------------------------------------


def llama_config(size: int) -> dict[str, int | bool]:
    """A Llama config of about ``size`` fp32 bytes: merge_adapter's shape from 1 GB up, a narrow one below."""
    big = size >= 900_000_000
    hidden, vocab = (2048, 32000) if big else (256, 1024)
    ffn = hidden * 43 // 16
    per_layer = 4 * (4 * hidden * hidden + 3 * hidden * ffn + 2 * hidden)
    layers = max(1, (size - 4 * 2 * vocab * hidden) // per_layer)
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=int(layers),
                num_attention_heads=16 if big else 4, num_key_value_heads=16 if big else 4,
                max_position_embeddings=2048, tie_word_embeddings=False)


def make_llama(folder: Path, size: int) -> None:
    """``folder/hf`` (base + tokenizer), ``folder/adapter`` (PEFT LoRA) and ``folder/dcp`` (the base as DCP)."""
    import torch.distributed.checkpoint as dcp
    from merge_adapter import make_data
    from safetensors.torch import load_file

    from tests.test_gguf_export import LLAMA3_SPLIT, _tokenizer

    folder.mkdir(parents=True)
    make_data(folder, llama_config(size), base_name="hf")
    _tokenizer(folder / "hf", LLAMA3_SPLIT)
    state = {}
    for path in sorted((folder / "hf").glob("*.safetensors")):
        state.update(load_file(path))
    dcp.save({"model": state}, checkpoint_id=str(folder / "dcp"))


def llama(samples_dir: Path, size: int) -> Path:
    return _made(samples_dir / "llama", "import bench_writers as w, sys; w.make_llama(w.Path(sys.argv[1]), "
                 "int(sys.argv[2]))", "a Llama HF folder, its LoRA and its DCP copy", str(size))


def make_megatron(folder: Path, size: str) -> None:
    """``folder/hf`` (a Mixtral HF folder) and ``folder/megatron`` (it imported as Megatron torch_dist)."""
    from bench_hf_families import make_hf

    import converters

    hf = make_hf(folder, size)
    hf.rename(folder / "hf")
    converters.import_hf(str(folder / "hf"), str(folder / "megatron"))


def megatron(samples_dir: Path, size: str) -> Path:
    folder = _made(samples_dir / "megatron-moe", "import bench_writers as w, sys; w.make_megatron(w.Path(sys.argv[1]), "
                   "sys.argv[2])", "a Mixtral HF folder and its Megatron torch_dist import", size)
    return folder / "megatron"


def archive_store(samples_dir: Path, dcp: Path) -> Path:
    store = samples_dir / "archive-store"
    if not store.exists():
        partial = store.with_name(store.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        _run([sys.executable, "-m", "ckptctl", "archive", str(dcp), str(partial), "--id", ARCHIVE_ID], "the archive")
        partial.rename(store)
    return store


def source_path(kind: str, samples_dir: Path, size: str, size_bytes: int, dcp: Path) -> Path:
    """The input of a case whose source is ``kind`` (made if missing)."""
    if kind == "megatron-moe":
        return megatron(samples_dir, size)
    if kind in ("llama-hf", "llama-dcp", "lora"):
        return llama(samples_dir, size_bytes) / {"llama-hf": "hf", "llama-dcp": "dcp", "lora": "adapter"}[kind]
    if kind == "archive-store":
        return archive_store(samples_dir, dcp)
    raise ValueError(kind)


def also_read(kind: str, src: Path) -> list[Path]:
    """Folders besides ``src`` a case reads (warmed in the page cache with it)."""
    return [src.parent / "hf"] if kind in ("lora", "llama-dcp") else []


# --- peers: the tools a user would otherwise run (each `bench_convert.py --peer NAME SRC OUT`) -------------------


def _ckptctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "ckptctl", *args]


def peer_gguf(src: str, out: str) -> None:
    """Two steps: our export of the DCP checkpoint to an HF folder, then llama.cpp's convert_hf_to_gguf.py."""
    from tests import gguf_reference

    hf = Path(out).with_name("hf")
    subprocess.run(_ckptctl("export", src, str(hf), "-q", "--config-from", str(Path(src).parent / "hf")), check=True)
    gguf_reference.convert(hf, Path(out), "f16", pre=GGUF_PRE)


def peer_fp8(src: str, out: str) -> None:
    """Two steps: our export of the DCP checkpoint to an HF folder, then llm-compressor's oneshot (FP8_BLOCK)."""
    hf = Path(out).with_name("hf")
    subprocess.run(_ckptctl("export", src, str(hf), "-q", "--config-from", str(Path(src).parent / "hf")), check=True)
    subprocess.run(_python("import bench_writers as w, sys; w.oneshot_fp8(sys.argv[1], sys.argv[2])", str(hf), out),
                   check=True, cwd=ROOT)


def oneshot_fp8(hf: str, out: str) -> None:
    """llm-compressor without calibration data, then save_pretrained(save_compressed=True) (tests/test_fp8.py)."""
    import llmcompressor
    from llmcompressor.modifiers.quantization import QuantizationModifier

    recipe = QuantizationModifier(targets="Linear", scheme="FP8_BLOCK", ignore=["lm_head"])
    model = llmcompressor.oneshot(model=hf, recipe=recipe)
    model.save_pretrained(out, save_compressed=True)


def peer_merge(src: str, out: str) -> None:
    """PEFT's merge_and_unload, saved by transformers (merge_adapter.peer)."""
    from merge_adapter import peer

    peer(str(Path(src).parent / "hf"), src, out)


PEERS = {"gguf-peer": peer_gguf, "fp8-peer": peer_fp8, "merged-peer": peer_merge}


# --- checks --------------------------------------------------------------------------------------


def compare_safetensors(got: Path, want: Path) -> str | None:
    """None when the two folders' safetensors files hold the same names, dtypes, shapes and bits, else what differs."""
    import torch
    from safetensors import safe_open

    def names(folder: Path) -> dict[str, Path]:
        found = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(path, "pt") as f:
                found.update({k: path for k in f.keys()})  # noqa: SIM118 (safe_open has no __iter__)
        return found

    left, right = names(got), names(want)
    if sorted(left) != sorted(right):
        return f"names differ: {sorted(set(left) ^ set(right))[:5]}"
    for name in sorted(left):
        with safe_open(left[name], "pt") as f, safe_open(right[name], "pt") as g:
            x, y = f.get_tensor(name), g.get_tensor(name)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            return f"{name} differs"
    return None


def _reference(folder: Path, make: str, what: str, *args: str) -> Path:
    return _made(folder, make, what, *args)


def _gguf_tensors(path: Path) -> dict[str, tuple[int, list[int], bytes]]:
    from gguf import GGUFReader

    return {t.name: (int(t.tensor_type), [int(d) for d in t.shape], bytes(t.data.tobytes()))
            for t in GGUFReader(path).tensors}


def check_gguf(out: Path, src: Path) -> tuple[bool, str]:
    """Tensors (names, types, shapes, bytes) equal to llama.cpp's converter run on the HF folder (cached)."""
    ref = _reference(src.parent / "ref-gguf", "from tests import gguf_reference as g; p = g.Path(sys.argv[1]); "
                     "p.mkdir(); g.convert(g.Path(sys.argv[2]), p / 'model.gguf', 'f16', pre=sys.argv[3])",
                     "llama.cpp's GGUF of the HF folder", str(src.parent / "hf"), GGUF_PRE)
    mine, theirs = _gguf_tensors(out), _gguf_tensors(ref / "model.gguf")
    if list(mine) != list(theirs):
        return False, f"tensor names differ from llama.cpp's: {sorted(set(mine) ^ set(theirs))[:3]}"
    wrong = [name for name in mine if mine[name] != theirs[name]]
    if wrong:
        return False, f"{len(wrong)} tensors differ from llama.cpp's, first {wrong[0]}"
    return True, f"{len(mine)} tensors equal to llama.cpp's convert_hf_to_gguf.py"


def check_fp8(out: Path, src: Path) -> tuple[bool, str]:
    ref = _reference(src.parent / "ref-fp8", "import bench_writers as w, sys; w.oneshot_fp8(sys.argv[2], sys.argv[1])",
                     "llm-compressor's FP8_BLOCK of the HF folder", str(src.parent / "hf"))
    problem = compare_safetensors(out, ref)
    return problem is None, problem or "every tensor equal to llm-compressor's oneshot FP8_BLOCK"


def check_merged(out: Path, src: Path) -> tuple[bool, str]:
    ref = _reference(src.parent / "ref-merged", "import bench_writers as w; w.peer_merge(sys.argv[2], sys.argv[1])",
                     "PEFT's merge_and_unload of the LoRA", str(src))
    problem = compare_safetensors(out, ref)
    return problem is None, problem or "every tensor equal to PEFT's merge_and_unload bit for bit"


def same_tree(a: Path, b: Path) -> str | None:
    """None when the two folders hold the same files with the same bytes, else the first difference."""
    cmp = filecmp.dircmp(a, b)
    if cmp.left_only or cmp.right_only:
        return f"files differ: {sorted(cmp.left_only + cmp.right_only)[:3]}"
    for name in cmp.common_files:
        if not filecmp.cmp(a / name, b / name, shallow=False):
            return f"{name} differs"
    for name in cmp.common_dirs:
        if problem := same_tree(a / name, b / name):
            return problem
    return None


def check(kind: str, out: Path, src: Path, dcp: Path) -> tuple[bool, str]:
    """The check ``kind`` of a new writer's output ``out`` made from ``src`` (``dcp``: the FSDP2 sample)."""
    if kind == "hf-families":
        from bench_hf_families import identical

        ok = identical(src.parent / "hf", out)
        return ok, "every tensor equal to the Mixtral HF folder imported" if ok else "differs from the HF folder"
    if kind == "gguf":
        return check_gguf(out, src)
    if kind == "fp8":
        return check_fp8(out, src)
    if kind == "merged":
        return check_merged(out, src)
    if kind == "hf-copy":
        problem = compare_safetensors(out, src)
        return problem is None, problem or "every tensor equal to the source"
    if kind == "archive":
        listed = subprocess.run(_ckptctl("archives", str(out)), capture_output=True, text=True, cwd=ROOT)
        ok = listed.returncode == 0 and ARCHIVE_ID in listed.stdout
        return ok, "the store lists the archive" if ok else f"the store does not list it: {listed.stdout[-200:]}"
    if kind == "restore":
        problem = same_tree(out, dcp)
        return problem is None, problem or "every file equal to the source byte for byte"
    raise ValueError(kind)


if __name__ == "__main__":
    sys.exit(f"{__file__} is a module of bench_convert.py")
