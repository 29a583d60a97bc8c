"""Benchmark the merged-adapter export (issue 32): a >= 2 GB base plus a rank-64 LoRA on every Linear layer.

    python benchmarks/merge_adapter.py --repeats 3 --out bench-out/merge_adapter.json

Makes (once, under --work-dir, default /tmp/merge-adapter-bench; deleted at the end unless --keep) a random
LlamaForCausalLM saved by transformers' save_pretrained (fp32, ~2.1 GB) and a PEFT LoRA on it
(get_peft_model(r=64, lora_alpha=128, target_modules="all-linear"), every lora_B random, as after training)
saved by save_pretrained. Cases, each its own process, interleaved, --repeats times:

- `cp`: `cp -r` of the base folder (the copy floor);
- `export`: `ckptctl export BASE OUT` (plain export of the base);
- `merged`: `ckptctl export ADAPTER OUT --merge-adapter --base BASE`;
- `merged-bf16`: the same with `--dtype bfloat16`;
- `peft`: the peer, PeftModel.from_pretrained + merge_and_unload() + save_pretrained (what users run today).

Wall time and peak RSS of the process tree are measured as benchmarks/bench_convert.py does (`run_once`: exit
plus sync, /proc polled every 20 ms). The merged output is compared with the peer's tensor by tensor (bit for
bit). Prints a table and writes JSON; the target is merged <= 1.3x export with peak RSS < 300 MB.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: ~2.14 GB in fp32: 8 layers of hidden 2048 / intermediate 5504, vocabulary 32000, untied head
BASE_CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
                   tie_word_embeddings=False)
LORA = dict(r=64, lora_alpha=128, target_modules="all-linear")
TARGET_RATIO, TARGET_RSS_MB = 1.3, 300.0


def load_bench_convert() -> ModuleType:
    """benchmarks/bench_convert.py (its process runner and RSS poller)."""
    spec = importlib.util.spec_from_file_location("bench_convert", ROOT / "benchmarks" / "bench_convert.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _no_torchao() -> None:
    """peft 0.21 refuses torchao < 0.16 when it creates LoRA layers (see tests/test_adapters.py)."""
    import peft.tuners.lora.torchao as peft_torchao

    peft_torchao.is_torchao_available = lambda: False


def make_data(work: Path, config: dict[str, Any] | None = None, base_name: str = "base") -> None:
    """The base (transformers, ``config`` or BASE_CONFIG) in ``work/base_name`` and the adapter (PEFT) in
    ``work/adapter``, both by save_pretrained."""
    import peft
    import torch
    import transformers

    _no_torchao()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(config or BASE_CONFIG)))
    model.save_pretrained(work / base_name)
    lora = peft.get_peft_model(model, peft.LoraConfig(**LORA))  # type: ignore[arg-type]
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    lora.save_pretrained(work / "adapter")


def peer(base: str, adapter: str, out: str) -> None:
    """What a user runs today: PEFT loads the base and the adapter, merges, and transformers saves."""
    import peft
    import torch
    import transformers

    _no_torchao()
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out)


def compare(got: Path, want: Path) -> str | None:
    """None when every tensor of the two HF folders is equal bit for bit, else what differs."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_writers import compare_safetensors

    return compare_safetensors(got, want)


def cases(work: Path) -> dict[str, list[str]]:
    ckptctl = [sys.executable, "-m", "ckptctl"]
    base, adapter = str(work / "base"), str(work / "adapter")
    return {
        "cp": ["cp", "-r", base, str(work / "out-cp")],
        "export": [*ckptctl, "export", base, str(work / "out-export"), "-q"],
        "merged": [*ckptctl, "export", adapter, str(work / "out-merged"), "--merge-adapter", "--base", base, "-q"],
        "merged-bf16": [*ckptctl, "export", adapter, str(work / "out-merged-bf16"), "--merge-adapter", "--base", base,
                        "--dtype", "bfloat16", "-q"],
        "peft": [sys.executable, str(Path(__file__).resolve()), "--peer", base, adapter, str(work / "out-peft")],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/merge-adapter-bench"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="cp,export,merged,merged-bf16,peft")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "merge_adapter.json")
    parser.add_argument("--keep", action="store_true", help="keep the base and adapter for the next run")
    parser.add_argument("--peer", nargs=3, metavar=("BASE", "ADAPTER", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--make", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        peer(*args.peer)
        return 0
    if args.make:
        make_data(args.make)
        return 0
    bench = load_bench_convert()
    work: Path = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "adapter" / "adapter_config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--make", str(work)], check=True)
    base_bytes = sum(p.stat().st_size for p in (work / "base").glob("*.safetensors"))
    adapter_bytes = (work / "adapter" / "adapter_model.safetensors").stat().st_size
    chosen = {k: v for k, v in cases(work).items() if k in args.cases.split(",")}
    runs: dict[str, list[Any]] = {name: [] for name in chosen}
    try:
        for _ in range(args.repeats):
            for name, argv in chosen.items():
                out = work / f"out-{name}"
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                for path in [*(work / "base").iterdir(), *(work / "adapter").iterdir()]:  # warm page cache
                    with open(path, "rb") as fh:
                        while fh.read(1 << 24):
                            pass
                runs[name].append(bench.run_once(argv, out, work / f"{name}.log", "all", 1800))
                if runs[name][-1].returncode:
                    print((work / f"{name}.log").read_text()[-3000:], file=sys.stderr)
        checks = {}
        if "merged" in chosen and "peft" in chosen:
            checks["merged"] = compare(work / "out-merged", work / "out-peft") or "equal to peft bit for bit"
        rows = []
        floor = statistics.median(r.wall_s for r in runs["export"]) if "export" in runs else None
        cp = statistics.median(r.wall_s for r in runs["cp"]) if "cp" in runs else None
        for name, results in runs.items():
            wall = statistics.median(r.wall_s for r in results)
            rows.append({"case": name, "median_s": round(wall, 3), "runs_s": [round(r.wall_s, 3) for r in results],
                         "vs_export": round(wall / floor, 3) if floor else None,
                         "vs_cp": round(wall / cp, 3) if cp else None,
                         "peak_rss_mb": round(max(r.peak_rss_mb for r in results), 1),
                         "cpu_s": round(statistics.median(r.cpu_s for r in results), 2),
                         "load1": [round(r.load1, 2) for r in results],
                         "ok": all(r.returncode == 0 for r in results), "check": checks.get(name)})
    finally:
        for name in chosen:
            shutil.rmtree(work / f"out-{name}", ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"base {base_bytes / 1e9:.2f} GB, adapter {adapter_bytes / 1e6:.1f} MB (r=64, all-linear), "
          f"{args.repeats} repeats, {os.cpu_count()} cores")
    print(f"{'case':<12} {'median s':>9} {'/export':>8} {'/cp':>6} {'peak RSS MB':>12} {'CPU s':>7}  runs / check")
    for row in rows:
        ratio = f"{row['vs_export']:.2f}" if row["vs_export"] else "-"
        to_cp = f"{row['vs_cp']:.2f}" if row["vs_cp"] else "-"
        print(f"{row['case']:<12} {row['median_s']:>9.2f} {ratio:>8} {to_cp:>6} {row['peak_rss_mb']:>12.0f} "
              f"{row['cpu_s']:>7.1f}  "
              f"{row['runs_s']}{' ' + row['check'] if row['check'] else ''}{'' if row['ok'] else ' FAILED'}")
    merged = next((r for r in rows if r["case"] == "merged"), None)
    met = None
    if merged and merged["vs_export"]:
        met = merged["vs_export"] <= TARGET_RATIO and merged["peak_rss_mb"] < TARGET_RSS_MB
        print(f"target (merged <= {TARGET_RATIO}x export, peak RSS < {TARGET_RSS_MB:g} MB): "
              f"{'met' if met else 'missed'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"base_bytes": base_bytes, "adapter_bytes": adapter_bytes, "lora": LORA,
                                    "base_config": BASE_CONFIG, "repeats": args.repeats, "cores": os.cpu_count(),
                                    "target": {"ratio": TARGET_RATIO, "rss_mb": TARGET_RSS_MB, "met": met},
                                    "rows": rows}, indent=2))
    ok = all(row["ok"] for row in rows) and all(v.startswith("equal") for v in checks.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
