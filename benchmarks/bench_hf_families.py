"""Benchmark (issue 30): export a Megatron-core torch_dist checkpoint of a MoE family (Mixtral) to Hugging Face
with `ckptctl export --to-hf auto`, against `cp -r` of the same checkpoint; and the way in, HF -> Megatron
(`converters.import_hf`), against `cp -r` of the HF folder.

    python benchmarks/bench_hf_families.py --sizes 1GB,2GB,4GB --out bench-out/hf_families.json

For each size: a Mixtral-shaped HF folder of random fp32 weights (hidden 1024, 8 experts of FFN 2048, 32000
vocabulary; layers added until the size is reached; two safetensors shards + index, cached under --work-dir) is
imported as a Megatron-LM torch_dist save folder (the import's output is what megatron-core's
dist_checkpointing.load reads, tests/test_hf_families.py), which is then exported back. Wall time runs to exit
plus fsync of the output; peak RSS is polled over the process tree (bench_convert's `run_once`). The export is
compared with the original HF tensors bit for bit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import run_once

from ckpt_service.units import parse_size

H, FFN, EXPERTS, VOCAB, HEADS, GROUPS = 1024, 2048, 8, 32000, 16, 4


def make_hf(work: Path, size: str) -> Path:
    """A Mixtral-shaped HF folder of about `size` bytes (cached by size)."""
    import torch
    from safetensors.torch import save_file

    folder = work / f"mixtral-{size}"
    if (folder / "config.json").is_file():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    d = H // HEADS
    per_layer = 4 * (HEADS * d * H + 2 * GROUPS * d * H + H * HEADS * d + 2 * H + EXPERTS * H + EXPERTS * 3 * FFN * H)
    layers = max(1, (parse_size(size) - 4 * (2 * VOCAB * H + H)) // per_layer)
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": H,
              "intermediate_size": FFN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
              "num_key_value_heads": GROUPS, "head_dim": d, "num_local_experts": EXPERTS, "num_experts_per_tok": 2,
              "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "hidden_act": "silu"}
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    weight_map: dict[str, str] = {}
    for shard, span in enumerate((range(0, layers // 2), range(layers // 2, layers))):
        tensors = {"model.embed_tokens.weight": r(VOCAB, H)} if shard == 0 else \
            {"model.norm.weight": r(H), "lm_head.weight": r(VOCAB, H)}
        for i in span:
            p = f"model.layers.{i}."
            tensors.update({p + "self_attn.q_proj.weight": r(HEADS * d, H),
                            p + "self_attn.k_proj.weight": r(GROUPS * d, H),
                            p + "self_attn.v_proj.weight": r(GROUPS * d, H),
                            p + "self_attn.o_proj.weight": r(H, HEADS * d), p + "input_layernorm.weight": r(H),
                            p + "post_attention_layernorm.weight": r(H),
                            p + "block_sparse_moe.gate.weight": r(EXPERTS, H)})
            for e in range(EXPERTS):
                q = f"{p}block_sparse_moe.experts.{e}."
                tensors.update({q + "w1.weight": r(FFN, H), q + "w3.weight": r(FFN, H), q + "w2.weight": r(H, FFN)})
        name = f"model-{shard + 1:05d}-of-00002.safetensors"
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def identical(hf: Path, export: Path) -> bool:
    import torch
    from safetensors import safe_open

    weight_map = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
    files = {p.name: p for p in export.glob("*.safetensors")}
    found: dict[str, Path] = {}
    for path in files.values():
        with safe_open(path, "pt") as f:
            found.update(dict.fromkeys(f.keys(), path))
    if sorted(found) != sorted(weight_map):
        return False
    for name, shard in weight_map.items():
        with safe_open(hf / shard, "pt") as a, safe_open(found[name], "pt") as b:
            if not torch.equal(a.get_tensor(name), b.get_tensor(name)):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1GB,2GB,4GB")
    parser.add_argument("--work-dir", type=Path, default=Path("bench-work/hf_families"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    rows = []
    for size in args.sizes.split(","):
        hf = make_hf(args.work_dir, size)
        megatron, back, copy = (args.work_dir / f"{k}-{size}" for k in ("megatron", "back", "cp"))
        for path in (megatron, back, copy):
            shutil.rmtree(path, ignore_errors=True)
        log = args.work_dir / f"log-{size}.txt"
        runs = {
            "cp -r (HF)": run_once(["cp", "-r", str(hf), str(copy)], copy, log, "files", args.timeout),
            "import (HF -> Megatron)": run_once(
                [sys.executable, "-c", "import sys, converters; converters.import_hf(sys.argv[1], sys.argv[2])",
                 str(hf), str(megatron)], megatron, log, "files", args.timeout),
        }
        shutil.rmtree(copy, ignore_errors=True)
        runs["cp -r (Megatron)"] = run_once(["cp", "-r", str(megatron), str(copy)], copy, log, "files", args.timeout)
        runs["export --to-hf auto"] = run_once([sys.executable, "-m", "ckptctl", "export", str(megatron), str(back),
                                                "--to-hf", "auto", "-q"], back, log, "files", args.timeout)
        bytes_ = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
        row = {"size": size, "bytes": bytes_, "identical": identical(hf, back),
               **{k: {"wall_s": round(v.wall_s, 2), "peak_rss_mb": round(v.peak_rss_mb, 1), "rc": v.returncode,
                      "load1": round(v.load1, 2)} for k, v in runs.items()}}
        row["export / cp"] = round(runs["export --to-hf auto"].wall_s / runs["cp -r (Megatron)"].wall_s, 2)
        row["import / cp"] = round(runs["import (HF -> Megatron)"].wall_s / runs["cp -r (HF)"].wall_s, 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
        for path in (megatron, back, copy):
            shutil.rmtree(path, ignore_errors=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
