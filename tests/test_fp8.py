"""FP8 export in the compressed-tensors layout (converters.quantize), proven against its consumers:

- llm-compressor (`oneshot` + QuantizationModifier, no calibration data) writes the same `weight` /
  `weight_scale` bytes and the same config.json from the same tiny transformers models (slow);
- compressed-tensors, through transformers' loader (`dequantize=True`), decompresses ours to within FP8 rounding
  of the original, and transformers loads ours as FP8 with logits close to the original's (slow);
- the math on hand-made values, which tensors stay high precision, shards, and one-line refusals (fast).

CI needs: pip install compressed-tensors==0.20.1 && pip install --no-deps llmcompressor==0.14.0.1
(llmcompressor 0.14 pins compressed-tensors 0.19 and transformers<=5.17; without --no-deps pip would downgrade both).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from converters.errors import FormatError, OptionError
from converters.quantize import export_fp8
from converters.quantize.fp8 import quantize
from converters.quantize.select import select

transformers = pytest.importorskip("transformers")
E4M3 = torch.float8_e4m3fn


def _tiny(family: str, dtype: torch.dtype, folder: Path, odd: bool = False) -> Path:
    """A random tiny model saved by transformers itself (odd: sizes that are not multiples of 128)."""
    torch.manual_seed(0)
    hidden, inter = (192, 200) if odd else (128, 256)
    common = dict(vocab_size=300, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, head_dim=32, moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2))
    model.to(dtype).save_pretrained(folder)
    return folder


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(folder / name, "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})  # noqa: SIM118 (safe_open is no dict)
    return out


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


# ---------------------------------------------------------------- the math, by hand (fast)

def test_channel_scales_and_values_exact():
    w = torch.tensor([[448.0, -224.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [-8.0, 2.0, 0.5, 0.25]])
    q, scale = quantize(w, "channel")
    assert scale.dtype == torch.float32 and scale.shape == (3, 1)
    third = (torch.tensor(8.0) / 448).item()  # float32 division
    assert scale[:, 0].tolist() == [1.0, torch.finfo(torch.float32).eps, third]  # a zero row: eps
    assert q.dtype == E4M3
    assert q[0].float().tolist() == [448.0, -224.0, 1.0, 0.0]
    assert q[1].float().tolist() == [0.0] * 4
    assert q[2].float().tolist() == (w[2] / third).to(E4M3).float().tolist()
    assert q[2, 0].item() == -448.0


def _edge_float32s() -> np.ndarray:
    """float32 patterns around every FP8 rounding edge (each FP8 value and each midpoint between neighbours, 1 ulp
    either side, both signs), subnormals, zeros, 448 to 480, inf and NaNs with small and large payloads, and 4M
    random patterns over all 2^32."""
    codes = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    points = np.concatenate([codes, (codes[:-1] + codes[1:]) / 2, [448, 456, 464, 472, 480, 1e30, 2.0 ** -10,
                                                                    2.0 ** -9 * 1.5, 1e-45, 1e-38]])
    exact = points.astype(np.float32).view(np.uint32).astype(np.int64)
    near = np.concatenate([exact + d for d in (-2, -1, 0, 1, 2, 0x8000, 0x18000, -0x8000, -0x18000, 0x7FFF, 0x8001)])
    near = near.clip(0, 0x7F800000).astype(np.uint32)
    special = np.array([0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FBFFFFF, 0x7F808000, 0x7FFF8000],
                       dtype=np.uint32)
    rng = np.random.default_rng(7)
    spread = rng.integers(0, 1 << 32, 1 << 22, dtype=np.uint64).astype(np.uint32)
    positive = np.concatenate([near, special, spread & 0x7FFFFFFF])
    return np.concatenate([positive, positive | 0x80000000]).view(np.float32)


def test_fp8_tables_and_rounding_equal_ml_dtypes():
    """The numpy casts (tables of every bfloat16 and float16 pattern, bfloat16 rounding by bit arithmetic, a float32
    looked up by its upper half with the lower half's "anything set" ORed in) give ml_dtypes' bytes: every 16-bit
    pattern, float32 edges and random patterns, through the very path `Slab.quantize` takes."""
    from converters.quantize import fp8

    fp8_dtype = ml_dtypes.float8_e4m3fn
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    assert np.array_equal(fp8.FROM_BF16, patterns.view(ml_dtypes.bfloat16).astype(fp8_dtype).view(np.uint8))
    assert np.array_equal(fp8.FROM_F16, patterns.view(np.float16).astype(fp8_dtype).view(np.uint8))
    values = _edge_float32s()
    with np.errstate(all="ignore"):
        assert np.array_equal(fp8.fp8_codes(values.view(np.uint32)), values.astype(fp8_dtype).view(np.uint8))
        assert np.array_equal(fp8.bf16_bits(values), values.astype(ml_dtypes.bfloat16).view(np.uint16))
    # Slab.quantize with unit scales: its own division, clamp, rounding to the dtype and cast, slab by slab
    finite = values[np.abs(values) <= 448]
    cols = 512
    finite = finite[: finite.size // cols * cols].reshape(-1, cols)
    kinds = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
    for dtype, kind in kinds.items():
        slab = fp8.Slab()
        rows = finite  # the quotients, rounded to `dtype` first and then to FP8
        ones = np.ones((rows.shape[0], 1), dtype=np.float32)
        for at in range(0, rows.shape[0], 1024):
            part = rows[at: at + 1024]
            with np.errstate(all="ignore"):
                want = part.astype(kind).astype(fp8_dtype).view(np.uint8)
            assert np.array_equal(slab.quantize(part, ones[at: at + 1024], dtype, "channel"), want), dtype
    # NaN and inf quotients (a weight holding them) stay NaN with their sign, as ml_dtypes keeps it
    odd = np.array([[np.nan, -np.nan, np.inf, -np.inf] * 32], dtype=np.float32)
    for dtype, kind in kinds.items():
        got = fp8.Slab().quantize(odd, np.ones((1, 1), np.float32), dtype, "channel")
        assert np.array_equal(got, odd.clip(-448, 448).astype(kind).astype(fp8_dtype).view(np.uint8)), dtype
    # scales: rounded to the dtype (bfloat16 NaN as 0x7FC0 with its sign), zero as the dtype's eps, their bytes
    amax = np.concatenate([np.abs(values[:4096]), np.zeros(3, np.float32)])
    for dtype, kind in kinds.items():
        with np.errstate(all="ignore"):
            want = (amax / np.float32(448)).astype(kind)
        want[want == 0] = ml_dtypes.finfo(kind).eps
        with np.errstate(all="ignore"):
            assert fp8.scale_bytes(fp8.scale_of(amax, dtype), dtype) == want.tobytes(), dtype


def test_block_scales_pad_with_ceil_and_tensor_scale():
    w = torch.zeros(200, 130, dtype=torch.bfloat16)
    w[0, 0], w[199, 129], w[150, 3] = 4.0, -896.0, 1.0
    q, scale = quantize(w, "block")
    assert scale.shape == (2, 2) and scale.dtype == torch.bfloat16
    eps = torch.finfo(torch.bfloat16).eps
    assert scale.float().tolist() == [[(torch.tensor(4.0, dtype=torch.bfloat16) / 448).item(), eps],
                                      [(torch.tensor(1.0, dtype=torch.bfloat16) / 448).item(), 2.0]]
    assert q.shape == (200, 130) and q[199, 129].item() == -448.0 and q[0, 0].item() == 448.0
    q, scale = quantize(w, "tensor")
    assert scale.tolist() == [2.0] and q[0, 0].item() == 2.0 and q[150, 3].item() == 0.5


def test_selection_keeps_embeddings_norms_routers_and_ignored():
    shapes = {"model.embed_tokens.weight": (300, 64), "model.norm.weight": (64,), "lm_head.weight": (300, 64),
              "model.layers.1.mlp.gate.weight": (4, 64), "model.layers.0.mlp.gate.weight": (4, 64),
              "model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.q_proj.bias": (64,),
              "model.layers.0.mlp.experts.0.up_proj.weight": (32, 64),
              "model.layers.10.self_attn.q_proj.weight": (64, 64),
              "model.layers.0.self_attn.q_norm.weight": (16,)}
    chosen = select(shapes, ["lm_head", "re:.*layers\\.10\\."], tied_head=False)
    assert chosen.quantized == ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.0.up_proj"]
    assert chosen.ignored == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "model.layers.10.self_attn.q_proj",
                              "lm_head"]


# ---------------------------------------------------------------- the engine on a real tiny model (fast)

@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory) -> Path:
    return _tiny("llama", torch.bfloat16, tmp_path_factory.mktemp("fp8") / "llama")


def test_export_layout_shards_and_side_files(llama_bf16, tmp_path):
    out = tmp_path / "q"
    result = export_fp8(str(llama_bf16), str(out), "FP8_BLOCK", ignore=["lm_head"], max_shard_size=200_000)
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in names and "config.json" in names and "generation_config.json" in names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    source, ours = _tensors(llama_bf16), _tensors(out)
    linear = [k for k in source if k.endswith("_proj.weight")]
    assert set(ours) == set(source) | {f"{k}_scale" for k in linear}
    for name, tensor in source.items():
        if name in linear:
            assert ours[name].dtype == E4M3 and ours[name].shape == tensor.shape
            assert ours[f"{name}_scale"].dtype == torch.bfloat16
            assert ours[f"{name}_scale"].shape == (-(-tensor.shape[0] // 128), -(-tensor.shape[1] // 128))
            q, scale = quantize(tensor, "block")
            assert torch.equal(ours[name].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(ours[f"{name}_scale"], scale)
        else:
            assert torch.equal(ours[name], tensor), name
    config = _config(out)
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["block_structure"] == [128, 128]
    assert {k: v for k, v in config.items() if k != "quantization_config"} == _config(llama_bf16)
    assert len(result.quantized) == 14 and result.ignored == ["lm_head"]


def test_streams_in_slabs_below_the_tensor_size(llama_bf16, tmp_path):
    """A memory limit far below one weight still writes the same bytes (scales built slab by slab)."""
    whole = export_fp8(str(llama_bf16), str(tmp_path / "a"), "FP8_DYNAMIC")
    slabbed = export_fp8(str(llama_bf16), str(tmp_path / "b"), "FP8_DYNAMIC", memory_limit=1024 * 1024)
    assert whole.outputs and slabbed.outputs
    a, b = _tensors(tmp_path / "a"), _tensors(tmp_path / "b")
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def _hostile_weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights over several 1 MiB slabs, with sizes not multiples of 128, magnitudes over many decades, subnormal
    rows, a zero block, and one weight holding inf and NaN."""
    torch.manual_seed(3)
    rows = 1100 if dtype != torch.float32 else 700
    wide = torch.randn(rows, 520) * torch.exp(torch.randn(rows, 1) * 4)
    wide[:128, :128] = 0
    tiny = torch.randn(rows, 520) * (1e-41 if dtype == torch.float32 else 1e-38 if dtype == torch.bfloat16 else 1e-7)
    odd = torch.randn(rows, 520)
    odd[5, 7], odd[300, 3], odd[600, 519] = float("inf"), float("nan"), -float("inf")
    return {"model.layers.0.mlp.up_proj.weight": wide.to(dtype), "model.layers.0.mlp.down_proj.weight": tiny.to(dtype),
            "model.layers.0.mlp.gate_proj.weight": odd.to(dtype), "model.norm.weight": torch.ones(520, dtype=dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scheme,strategy", [("FP8_DYNAMIC", "channel"), ("FP8_BLOCK", "block"),
                                             ("FP8_TENSOR", "tensor")])
def test_streamed_numpy_path_equals_torch(tmp_path, dtype, scheme, strategy):
    """The export's numpy slabs give torch's bytes (the oracle llm-compressor matches) in every dtype and scheme,
    whatever the slab boundaries; NaN where torch has NaN."""
    weights = _hostile_weights(dtype)
    src = _folder(tmp_path, weights, {"model_type": "llama"})
    export_fp8(str(src), str(tmp_path / "q"), scheme, memory_limit=1024 * 1024)
    out = _tensors(tmp_path / "q")
    for name, weight in weights.items():
        if name == "model.norm.weight":
            assert torch.equal(out[name], weight)
            continue
        q, scale = quantize(weight, strategy)
        assert out[f"{name}_scale"].dtype == scale.dtype and out[f"{name}_scale"].shape == scale.shape
        for ours, theirs in ((out[name], q), (out[f"{name}_scale"], scale)):
            nan = theirs.float().isnan()  # only a NaN's sign bit may differ (fp8.py says why)
            assert torch.equal(ours.float().isnan(), nan), name
            assert torch.equal(ours.view(torch.uint8).reshape(nan.numel(), -1)[~nan.reshape(-1)],
                               theirs.view(torch.uint8).reshape(nan.numel(), -1)[~nan.reshape(-1)]), name
        assert name != "model.layers.0.mlp.gate_proj.weight" or bool(q.float().isnan().any())


@pytest.mark.parametrize("scheme,memory_limit,reads", [("FP8_DYNAMIC", 1 << 20, 1), ("FP8_BLOCK", 1 << 20, 1),
                                                       ("FP8_TENSOR", 1 << 20, 2), ("FP8_TENSOR", 128 << 20, 1)])
def test_reads_each_weight_once_and_streams_the_same_file(tmp_path, monkeypatch, scheme, memory_limit, reads):
    """A local file is written at offsets: each quantized weight is read once, its scales taken from the same
    slabs (a per-tensor scale over several slabs needs a pass of its own); streamed to object storage (scales first,
    the weights read again) the files are the same bytes."""
    import fsspec

    from converters.quantize import export

    weights = _hostile_weights(torch.bfloat16)  # 1100 rows: two slabs of a 1 MiB limit, one of a 128 MiB one
    src = _folder(tmp_path, weights, {"model_type": "llama"})
    read: dict[str, int] = {}
    real = export.read_box

    def counted(reader, entry, box, out):
        read[entry.name] = read.get(entry.name, 0) + len(out)
        return real(reader, entry, box, out)

    monkeypatch.setattr(export, "read_box", counted)
    export_fp8(str(src), str(tmp_path / "q"), scheme, memory_limit=memory_limit)
    assert read == {name: reads * w.numel() * w.element_size() for name, w in weights.items()
                    if name.endswith("_proj.weight")}  # the norm is the copier's (in the kernel)
    target = f"memory://fp8-stream-{scheme}-{memory_limit}"
    try:
        export_fp8(str(src), target, scheme, memory_limit=memory_limit)
        fs = fsspec.filesystem("memory")
        for name in ("model.safetensors", "config.json"):
            assert fs.cat_file(f"{target}/{name}") == (tmp_path / "q" / name).read_bytes(), name
    finally:
        fsspec.filesystem("memory").rm(target, recursive=True)


@pytest.mark.parametrize("scheme", ["FP8_BLOCK", "FP8_TENSOR"])
def test_certificate_crcs_taken_as_written(tmp_path, monkeypatch, scheme):
    """Every byte of a local shard is checksummed as it is written (copies as they land, FP8 slabs and scales from
    memory, out of file order): no safetensors file is read back, yet the manifest's file and 16 MiB block CRC-32s
    and each tensor's CRC-32 are zlib's of the files on disk, over shards and blocks cut at odd places."""
    import zlib

    from converters import certificate as cert_mod
    from converters import check_certificate
    from converters.names import MANIFEST

    torch.manual_seed(5)
    weights = {"model.embed_tokens.weight": torch.randn(2500, 2001),  # 20 MB float32, kept: the copier's
               "model.layers.0.mlp.up_proj.weight": torch.randn(3001, 4100),  # over a 16 MiB block in FP8
               "model.layers.0.mlp.down_proj.weight": torch.randn(1000, 2999).to(torch.bfloat16),
               "model.layers.0.input_layernorm.weight": torch.ones(2001)}
    src = _folder(tmp_path, weights, {"model_type": "llama"})
    read_back: list[str] = []
    real = cert_mod.mapped_crcs

    def spy(path, *args, **kwargs):
        read_back.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(cert_mod, "mapped_crcs", spy)
    out = tmp_path / "q"
    export_fp8(str(src), str(out), scheme, memory_limit=1 << 20, max_shard_size=24 << 20)
    doc = json.loads((out / MANIFEST).read_text())
    shards = sorted(n for n in doc["files"] if n.endswith(".safetensors"))
    assert len(shards) > 1 and not [n for n in read_back if n.endswith(".safetensors")], read_back
    assert any(doc["files"][n]["bytes"] > 16 << 20 for n in shards)
    tensors = doc["certificate"]["tensors"]
    for name in shards:
        data = (out / name).read_bytes()
        assert doc["files"][name]["crc32"] == zlib.crc32(data)
        assert doc["files"][name]["blocks"] == [zlib.crc32(data[i:i + (16 << 20)])
                                                for i in range(0, len(data), 16 << 20)]
        (n,) = struct.unpack("<Q", data[:8])
        for tensor, info in json.loads(data[8:8 + n]).items():
            if tensor != "__metadata__":
                low, high = (8 + n + int(o) for o in info["data_offsets"])
                assert tensors[tensor] == [{"box": None, "crc32": zlib.crc32(data[low:high]), "file": name}], tensor
    assert len(tensors) == len(weights) + 2
    assert check_certificate(str(out)).ok


def test_export_imports_no_torch(llama_bf16, tmp_path):
    """Importing torch alone costs ~1 CPU-s and ~190 MB of RSS: a finite checkpoint is quantized without it."""
    code = ("import sys; from converters.quantize import export_fp8; "
            f"export_fp8({str(llama_bf16)!r}, {str(tmp_path / 'q')!r}, 'FP8_BLOCK'); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("scheme,message", [("FP9", "scheme FP9: unknown; choose FP8_DYNAMIC, FP8_BLOCK, FP8_TENSOR"),
                                            ("FP8", "static FP8 needs input scales calibrated on data")])
def test_refuses_unknown_and_static_scheme(llama_bf16, tmp_path, scheme, message):
    with pytest.raises(OptionError, match=message) as err:
        export_fp8(str(llama_bf16), str(tmp_path / "q"), scheme)
    assert "\n" not in str(err.value) and not (tmp_path / "q").exists()


def test_refuses_bad_ignore_pattern(llama_bf16, tmp_path):
    with pytest.raises(OptionError, match=r"ignore re:\(\: bad regular expression"):
        export_fp8(str(llama_bf16), str(tmp_path / "q"), ignore=["re:("])
    assert list(tmp_path.iterdir()) == []


def _folder(tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict | None) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    save_file(tensors, str(src / "model.safetensors"))
    if config is not None:
        (src / "config.json").write_text(json.dumps(config))
    return src


def test_refuses_non_float_weight(tmp_path):
    src = _folder(tmp_path, {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4, dtype=torch.int8),
                             "model.norm.weight": torch.ones(4)}, {"model_type": "llama"})
    with pytest.raises(FormatError, match=r"^model.layers.0.mlp.up_proj.weight: int8 cannot be quantized to FP8 "
                                          r"\(the source must hold float32, bfloat16 or float16 weights\)"):
        export_fp8(str(src), str(tmp_path / "q"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_refuses_quantized_source(tmp_path):
    src = _folder(tmp_path, {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4)},
                  {"model_type": "llama", "quantization_config": {"quant_method": "compressed-tensors"}})
    with pytest.raises(FormatError, match=r"config.json\): the model is quantized already"):
        export_fp8(str(src), str(tmp_path / "q"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_refuses_missing_config(tmp_path):
    src = _folder(tmp_path, {"model.layers.0.mlp.up_proj.weight": torch.ones(4, 4)}, None)
    with pytest.raises(OptionError, match=r"no config.json beside the checkpoint; .* pass config_from=DIR"):
        export_fp8(str(src), str(tmp_path / "q"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_refuses_when_nothing_is_left_to_quantize(llama_bf16, tmp_path):
    with pytest.raises(OptionError, match=r"no Linear weight is left to quantize \(ignore: re:\.\*\)"):
        export_fp8(str(llama_bf16), str(tmp_path / "q"), ignore=["re:.*"])


# ---------------------------------------------------------------- against llm-compressor and transformers (slow)

def _oracle(src: Path, out: Path, scheme: str, ignore: list[str]) -> Path:
    """What llm-compressor writes: oneshot without calibration data, then save_pretrained(save_compressed=True)."""
    pytest.importorskip("compressed_tensors")
    llmcompressor = pytest.importorskip("llmcompressor")
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if scheme == "FP8_TENSOR":  # weight-only per-tensor FP8 (W8A16): a config group, not a preset
        weights = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
        recipe = QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                                      ignore=ignore)
    else:
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore)
    model = llmcompressor.oneshot(model=str(src), recipe=recipe)
    model.save_pretrained(out, save_compressed=True)
    return out


CASES = [("llama", torch.bfloat16, "FP8_DYNAMIC", False), ("llama", torch.float32, "FP8_BLOCK", True),
         ("llama", torch.bfloat16, "FP8_TENSOR", True), ("qwen3", torch.bfloat16, "FP8_BLOCK", False),
         ("qwen3", torch.float32, "FP8_DYNAMIC", True), ("qwen3", torch.float32, "FP8_TENSOR", False),
         ("qwen3moe", torch.bfloat16, "FP8_DYNAMIC", False), ("qwen3moe", torch.bfloat16, "FP8_BLOCK", False)]


@pytest.mark.slow
@pytest.mark.parametrize("family,dtype,scheme,odd", CASES,
                         ids=[f"{f}-{str(d)[6:]}-{s}{'-odd' if o else ''}" for f, d, s, o in CASES])
def test_equals_llm_compressor(tmp_path, family, dtype, scheme, odd):
    src = _tiny(family, dtype, tmp_path / "src", odd)
    # llm-compressor quantizes routers unless told; ours keeps them always, so its MoE runs name them
    ignore = ["lm_head", "re:.*mlp.gate$"] if family == "qwen3moe" else ["lm_head"]
    theirs = _oracle(src, tmp_path / "theirs", scheme, ignore)
    result = export_fp8(str(src), str(tmp_path / "ours"), scheme)  # default ignore: lm_head
    assert _config(tmp_path / "ours") == _config(theirs)  # the whole config.json, quantization_config included
    a, b = _tensors(tmp_path / "ours"), _tensors(theirs)
    assert sorted(a) == sorted(b)
    for name in b:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert len(result.quantized) == sum(1 for k in b if k.endswith(".weight_scale"))
    if family == "qwen3moe":
        assert result.ignored == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]


def _full(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A channel [out, 1], block [ceil(out/128), ceil(in/128)] or tensor [1] scale, one value per element."""
    scale = scale.float()
    if scale.dim() == 2 and tuple(scale.shape) != (shape[0], 1):  # block
        scale = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    return scale.expand(shape)


def _elementwise_scale(saved: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The FP8 scale of each element of the in-memory parameter `name`; None when it is not quantized.
    transformers 5 holds MoE experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) where the file has
    them per expert (experts.N.gate_proj/up_proj/down_proj)."""
    if f"{name}_scale" in saved:
        return _full(saved[f"{name}_scale"], shape)
    base, _, param = name.rpartition(".")
    if not base.endswith(".experts") or param not in ("gate_up_proj", "down_proj"):
        return None
    parts = ("gate_proj", "up_proj") if param == "gate_up_proj" else ("down_proj",)
    per = []
    for e in range(shape[0]):
        pieces = [saved[f"{base}.{e}.{part}.weight_scale"] for part in parts]
        rows = shape[1] // len(parts)
        per.append(torch.cat([_full(p, (rows, shape[2])) for p in pieces]))
    return torch.stack(per)


LOADS = [("llama", torch.bfloat16, "FP8_DYNAMIC"), ("qwen3", torch.float32, "FP8_BLOCK"),
         ("qwen3moe", torch.bfloat16, "FP8_TENSOR")]


@pytest.mark.slow
@pytest.mark.parametrize("family,dtype,scheme", LOADS, ids=[f"{f}-{str(d)[6:]}-{s}" for f, d, s in LOADS])
def test_compressed_tensors_decompresses_and_transformers_loads(tmp_path, family, dtype, scheme):
    """Decompressed by compressed-tensors, every Linear weight is within FP8 rounding of the original: at most
    2^-4 of its magnitude (E4M3's 3 mantissa bits, round to nearest) plus 2^-9 of its scale (the subnormal step),
    plus one rounding of the model dtype; every other tensor is unchanged. Loaded as FP8 (transformers runs the
    compressed-tensors forward: FP8 weights, FP8 dynamic activations for DYNAMIC/BLOCK), the logits of a prompt
    differ from the original's by at most 10% of the largest original logit on these random tiny models."""
    pytest.importorskip("compressed_tensors")
    from transformers.utils.quantization_config import CompressedTensorsConfig

    src = _tiny(family, dtype, tmp_path / "src")
    export_fp8(str(src), str(tmp_path / "ours"), scheme)
    original = transformers.AutoModelForCausalLM.from_pretrained(src)
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", quantization_config=CompressedTensorsConfig(dequantize=True))
    saved = _tensors(tmp_path / "ours")
    before, after = original.state_dict(), plain.state_dict()
    assert set(before) == set(after)
    step = torch.finfo(dtype).eps
    checked = 0
    for name, w in before.items():
        got = after[name]
        assert got.dtype == w.dtype, name
        scale = _elementwise_scale(saved, name, tuple(w.shape))
        if scale is None:
            assert torch.equal(got, w), name
            continue
        bound = w.float().abs() * (2**-4 + 2 * step) + scale * 2**-9 * (1 + step)
        assert ((got.float() - w.float()).abs() <= bound).all(), name
        checked += 1
    scales = [k for k in saved if k.endswith("_scale")]
    fused = {k.split(".experts.")[0] for k in scales if ".experts." in k}  # gate_up_proj and down_proj each
    assert checked == len(scales) - sum(".experts." in k for k in scales) + 2 * len(fused)
    fp8 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    assert fp8.model.layers[0].self_attn.q_proj.weight.dtype == E4M3
    ids = torch.tensor([[1, 5, 9, 33, 100, 7, 250, 3]])
    with torch.no_grad():
        want, got = original(ids).logits.float(), fp8(ids).logits.float()
    assert (want - got).abs().max() <= 0.1 * want.abs().max()
    assert not torch.equal(want, got)  # it really ran quantized
