"""Megatron-core dist checkpoints (Megatron-LM iter folders, NeMo 2): read, unstack, export to HF Llama.

Fast tests build stacked DCP checkpoints with torch's own `dcp.save`; the slow ones use real
checkpoints that Megatron-core writes at TP=2 x PP=2 (tests/megatron_tool.py) and compare with
Megatron's own `dist_checkpointing.load`.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from converters.formats import detect, load_index
from converters.transforms import KeyOptions, apply

from .conftest import assert_same_tensors, ckptctl

TOOL = Path(__file__).with_name("megatron_tool.py")
BACKEND = json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                      "common_backend_version": 1})


def _stacked_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A dist-checkpoint-shaped folder written by torch itself: stacked layers, extra state, common.pt."""
    torch.manual_seed(0)
    state = {"decoder.layers.mlp.linear_fc2.weight": torch.randn(3, 4, 6),
             "decoder.layers.self_attention.linear_qkv.layer_norm_weight": torch.randn(3, 6),
             "decoder.final_layernorm.weight": torch.randn(6),
             "decoder.layers.mlp.linear_fc2._extra_state/shard_0_3": None}
    dcp.save(state, checkpoint_id=str(path))
    (path / "metadata.json").write_text(BACKEND)
    torch.save({"args": argparse.Namespace(num_layers=3, params_dtype=torch.bfloat16, exit_signal=signal.SIGTERM),
                "iteration": 5}, path / "common.pt")
    return {k: v for k, v in state.items() if v is not None}


def test_unstacked_views_equal_the_stacked_slices(tmp_path: Path) -> None:
    ckpt = tmp_path / "iter_0000005"
    ckpt.mkdir()
    state = _stacked_checkpoint(ckpt)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5\n")
    assert detect(str(tmp_path)) == detect(str(ckpt)) == "megatron"
    index = load_index(str(tmp_path))
    assert index.producer == "Megatron-LM (iter_0000005)"
    assert index.objects["args.exit_signal"].value == "Signals(15)"
    assert index.objects["args.params_dtype"].value == "bfloat16"
    assert index.training_state == {"args.num_layers", "args.params_dtype", "args.exit_signal", "iteration"}
    view, report, _ = apply(index, KeyOptions())
    assert report[0] == "unstacked 2 layer-stacked tensors into per-layer names (decoder.layers.0..2)"
    assert "left out 1 _extra_state entries" in report[1]
    assert not view.objects
    # every per-layer tensor is a byte range inside the stacked tensor's record: nothing is copied
    layer1 = view.tensors["decoder.layers.1.mlp.linear_fc2.weight"]
    stacked = index.tensors["decoder.layers.mlp.linear_fc2.weight"].chunks[0].data
    assert layer1.shape == (4, 6) and layer1.chunks[0].data.offset == stacked.offset + 4 * 6 * 4
    out = tmp_path / "out"
    ckptctl("export", tmp_path, out, "-q", "--verify")
    got = load_file(out / "model.safetensors")
    want = {f"decoder.layers.{i}.{k.split('layers.', 1)[1]}": v[i] for k, v in state.items() if v.dim() > 1
            for i in range(3)} | {"decoder.final_layernorm.weight": state["decoder.final_layernorm.weight"]}
    assert_same_tensors(got, {k: v.contiguous() for k, v in want.items()})
    kept = tmp_path / "kept.safetensors"
    ckptctl("convert", tmp_path, kept, "-q")  # names as stored
    assert_same_tensors(load_file(kept), state)


def test_hostile_megatron_folders(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    _stacked_checkpoint(ckpt)
    (ckpt / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    proc = ckptctl("inspect", ckpt, check=False)
    assert proc.returncode == 2 and "sharded_backend 'zarr' is not supported (only torch_dist)" in proc.stderr
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("9")
    proc = ckptctl("inspect", tmp_path, check=False)
    assert proc.returncode == 2 and "names iteration '9' but there is no iter_0000009 folder" in proc.stderr
    (ckpt / "metadata.json").write_text(BACKEND)
    torch.save({"args": {"f": print}}, ckpt / "common.pt")
    proc = ckptctl("inspect", ckpt, check=False)
    assert proc.returncode == 2 and "builtins.print, which is not on the allow-list" in proc.stderr
    torch.save({"args": argparse.Namespace(num_layers=3)}, ckpt / "common.pt")
    proc = ckptctl("export", ckpt, tmp_path / "hf", "--to-hf", "llama", check=False)
    assert proc.returncode == 2 and "normalization 'LayerNorm' (the table's families use RMSNorm)" in proc.stderr
    assert not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------------- real Megatron


def _run(*args: str) -> None:
    proc = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="session")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("megatron")
    _run("save", str(root), "29711")
    _run("load", str(root / "megatron" / "iter_0000007"), "", str(root / "ref.pt"), "29712")
    return root


def _unstacked(ref: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Megatron's loaded tensors ({stored key}@{layer}) under per-layer names."""
    out = {}
    for key, value in ref.items():
        name, _, layer = key.partition("@")
        name = name[len(prefix):]
        out[name.replace("layers.", f"layers.{layer}.", 1) if layer else name] = value
    return out


@pytest.mark.slow
def test_export_equals_megatron_load(megatron: Path, tmp_path: Path) -> None:
    ref = torch.load(megatron / "ref.pt", weights_only=True)
    index = load_index(str(megatron / "megatron"))
    assert (index.world_size, index.producer) == (4, "Megatron-LM (iter_0000007)")
    assert index.objects["args.attention_backend"].value == "AttnBackend(5)"
    for source in ("megatron", "nemo"):
        out = tmp_path / source
        ckptctl("export", megatron / source, out, "-q", "--verify")
        assert_same_tensors(load_file(out / "model.safetensors"), _unstacked(ref))
    # names as stored, and the training state beside them, with --keep-keys / --only all
    kept = tmp_path / "kept.pt"
    ckptctl("convert", megatron / "megatron", kept, "--to", "torch", "-q")
    got = torch.load(kept, weights_only=True)
    assert got["args"]["num_query_groups"] == 2 and got["iteration"] == 7
    stacked = {}
    for key, value in ref.items():
        stacked.setdefault(key.partition("@")[0], []).append(value)
    for name, values in stacked.items():
        assert torch.equal(got[name], torch.stack(values) if len(values) > 1 and "layers" in name else values[0])


def _reference_forward(w: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Megatron GPT forward written out by hand on its own layout (fused per-group QKV, fused gate/up)."""
    from megatron_tool import EPS, FFN, GROUPS, HEADS, HIDDEN, LAYERS, ROPE_BASE

    d, per_group, seq = HIDDEN // HEADS, HEADS // GROUPS, ids.shape[1]

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight

    inv = 1.0 / ROPE_BASE ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()

    def rope(x: torch.Tensor) -> torch.Tensor:  # Megatron's default: rotate halves, not interleaved
        half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * cos[:, None] + half * sin[:, None]

    x = w["embedding.word_embeddings.weight"][ids[0]]
    mask = torch.full((seq, seq), -math.inf).triu(1)
    for i in range(LAYERS):
        at = f"decoder.layers.{{}}@{i}"
        h = norm(x, w[at.format("self_attention.linear_qkv.layer_norm_weight")])
        qkv = (h @ w[at.format("self_attention.linear_qkv.weight")].T).view(seq, GROUPS, per_group + 2, d)
        q = rope(qkv[:, :, :per_group].reshape(seq, HEADS, d))
        k = rope(qkv[:, :, per_group]).repeat_interleave(per_group, 1)
        v = qkv[:, :, per_group + 1].repeat_interleave(per_group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d) + mask
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, HEADS * d)
        x = x + attn @ w[at.format("self_attention.linear_proj.weight")].T
        h = norm(x, w[at.format("mlp.linear_fc1.layer_norm_weight")])
        gate, up = (h @ w[at.format("mlp.linear_fc1.weight")].T).split(FFN, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w[at.format("mlp.linear_fc2.weight")].T
    return (norm(x, w["decoder.final_layernorm.weight"]) @ w["output_layer.weight"].T)[None]


@pytest.mark.slow
def test_to_hf_llama_logits_match_the_megatron_layout(megatron: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(TOOL.parent))
    ref = torch.load(megatron / "ref.pt", weights_only=True)
    ids = torch.tensor([[3, 17, 99, 42, 5, 127, 0, 64, 8, 33, 71, 12]])
    want = _reference_forward(ref, ids)
    exported = {}
    for source in ("megatron", "nemo"):
        out = tmp_path / source
        proc = ckptctl("export", megatron / source, out, "--to-hf", "llama", "-q", "--verify")
        assert "mapped to LlamaForCausalLM: 4 layers, 8 heads in 2 query groups, vocab 128" in proc.stderr
        config = json.loads((out / "config.json").read_text())
        assert (config["num_key_value_heads"], config["intermediate_size"], config["tie_word_embeddings"]) == (
            2, 96, False)
        model = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            got = model(ids).logits
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        exported[source] = load_file(out / "model.safetensors")
    assert_same_tensors(exported["nemo"], exported["megatron"])  # NeMo's context/ and Megatron-LM's args agree
    # the q/k/v split is per query group: group 1's k rows follow its 4 query heads in the fused weight
    fused = ref["decoder.layers.self_attention.linear_qkv.weight@2"]
    assert torch.equal(exported["megatron"]["model.layers.2.self_attn.k_proj.weight"][8:], fused[80:88])


@pytest.mark.slow
def test_reshard_keeps_the_megatron_layout_that_megatron_loads(megatron: Path, tmp_path: Path) -> None:
    """Saved at TP=2 x PP=2, resharded to 3 ranks keeping Megatron-LM's layout (`latest_checkpointed_iteration.txt`,
    `iter_0000007/`): Megatron's own `dist_checkpointing.load` (at TP=1 x PP=1) reads the same tensors, bit for bit,
    as from the original."""
    out = tmp_path / "ws3"
    ckptctl("reshard", megatron / "megatron", out, "--world-size", "3", "--verify", "-q")
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    _run("load", str(out / "iter_0000007"), "", str(tmp_path / "ref.pt"), "29713")
    got, want = (torch.load(p, weights_only=True) for p in (tmp_path / "ref.pt", megatron / "ref.pt"))
    assert_same_tensors(got, want)
