"""The sample checkpoint generator: real FSDP jobs (gloo, CPU) at world size 2 on the tiny model.

Spawning costs a few seconds per job, so the outputs are made once per module: one job for all FSDP2
layouts, one for all FSDP1 layouts, one compiled/tied/bf16 job, then checks read them back.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader, HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from ckpt_service.sample import (
    ENGINE,
    LAYOUTS,
    SampleModel,
    config_for_size,
    load_and_step,
    make_sample,
    make_samples,
)
from ckpt_service.sample.launch import SampleJobError

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning")]

WS = 2
SIZE = "tiny"


# --- helpers -----------------------------------------------------------------------------------------


def load_ref(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def model_keys(tie: bool = False) -> list[str]:
    return list(SampleModel(config_for_size(SIZE, tie)).state_dict())


def param_keys(tie: bool = False) -> list[str]:
    return [name for name, _ in SampleModel(config_for_size(SIZE, tie)).named_parameters()]


def strip(key: str) -> str:
    return key.replace("_orig_mod.", "")


def assert_model_equal(got: dict[str, torch.Tensor], ref: dict[str, Any]) -> None:
    got = {strip(k): v for k, v in got.items()}
    assert sorted(got) == sorted(ref["model"])
    for key, tensor in got.items():
        assert torch.equal(tensor, ref["model"][key]), key


def assert_optim_equal(state: dict[str, dict[str, torch.Tensor]], ref: dict[str, Any]) -> None:
    state = {strip(k): v for k, v in state.items()}
    assert sorted(state) == sorted(ref["optim"]["state"])
    for fqn, entry in state.items():
        assert sorted(entry) == ["exp_avg", "exp_avg_sq", "step"]
        for name, tensor in entry.items():
            assert torch.equal(tensor, ref["optim"]["state"][fqn][name]), (fqn, name)


class _ShardedTensorStub(torch.Tensor):
    """Stands in for ShardedTensor when unpickling, which otherwise needs the saving job's process group."""

    ProcessGroupState = ShardedTensor.ProcessGroupState

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise NotImplementedError(func)

    def __setstate__(self, state: tuple) -> None:
        self.local_shards, self.st_metadata = state[0], state[1]


class _StubUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.distributed._shard.sharded_tensor.api", "ShardedTensor"):
            return _ShardedTensorStub
        return super().find_class(module, name)


class _stub_pickle:  # a pickle_module for torch.load
    Unpickler = _StubUnpickler
    load = pickle.load


def assemble_rank_files(files: list[Path]) -> dict[str, torch.Tensor]:
    """Full tensors from per-rank torch.save files of DTensor or ShardedTensor values."""
    from torch.distributed.tensor import DTensor

    full: dict[str, torch.Tensor] = {}
    for rank, f in enumerate(files):
        for key, value in torch.load(f, weights_only=False, pickle_module=_stub_pickle).items():
            if isinstance(value, DTensor):  # FSDP2: Shard(0) with torch.chunk sizes
                assert value.placements[0].is_shard(0)
                full.setdefault(key, torch.empty(value.shape, dtype=value.dtype))
                rows = value.to_local()
                offset = rank * -(-value.shape[0] // len(files))
                full[key][offset : offset + rows.shape[0]] = rows
            elif isinstance(value, _ShardedTensorStub):
                meta = value.st_metadata
                full.setdefault(key, torch.empty(meta.size, dtype=meta.tensor_properties.dtype))
                for shard in value.local_shards:
                    offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    full[key][tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = shard.tensor
            else:
                full[key] = value
    return full


# --- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def samples_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("samples")


def _make_group(samples_root: Path, engine: str, **kwargs: Any) -> Path:
    base = samples_root / engine
    outs = {layout: base / layout for layout in LAYOUTS if ENGINE[layout] == engine}
    make_samples(
        outs,
        world_size=WS,
        size=SIZE,
        reference=base / "ref.pt",
        extra_step_reference=base / "ref_step2.pt",
        **kwargs,
    )
    return base


@pytest.fixture(scope="module")
def fsdp2_out(samples_root: Path) -> Path:
    return _make_group(samples_root, "fsdp2")


@pytest.fixture(scope="module")
def fsdp1_out(samples_root: Path) -> Path:
    return _make_group(samples_root, "fsdp1")


@pytest.fixture(scope="module")
def compiled_out(samples_root: Path) -> Path:
    """Compiled wrapper + tied embeddings + bf16, for the two layouts that must support compile_prefix."""
    base = samples_root / "compiled"
    make_samples(
        {"fsdp2-dcp": base / "fsdp2-dcp", "torch-full": base / "torch-full"},
        world_size=WS,
        size=SIZE,
        dtype="bfloat16",
        tie_embeddings=True,
        compile_prefix=True,
        reference=base / "ref.pt",
    )
    return base


def layout_dir(fsdp1_out: Path, fsdp2_out: Path, layout: str) -> Path:
    return (fsdp1_out if ENGINE[layout] == "fsdp1" else fsdp2_out) / layout


# --- tests -------------------------------------------------------------------------------------------


def test_layouts_and_engines() -> None:
    assert LAYOUTS == ("fsdp2-dcp", "fsdp1-dcp", "accelerate", "rank-files-dtensor", "rank-files-sharded",
                       "accelerate-rank-files", "hf-dcp", "torch-full", "safetensors")
    assert {layout: ENGINE[layout] for layout in LAYOUTS} == {
        "fsdp2-dcp": "fsdp2", "fsdp1-dcp": "fsdp1", "accelerate": "fsdp1", "rank-files-dtensor": "fsdp2",
        "rank-files-sharded": "fsdp1", "accelerate-rank-files": "fsdp1", "hf-dcp": "fsdp2", "torch-full": "fsdp2",
        "safetensors": "fsdp2"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expected_files(fsdp1_out: Path, fsdp2_out: Path, layout: str) -> None:
    out = layout_dir(fsdp1_out, fsdp2_out, layout)
    names = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    expected = {
        "fsdp2-dcp": {".metadata", "__0_0.distcp", "__1_0.distcp"},
        "fsdp1-dcp": {".metadata", "__0_0.distcp", "__1_0.distcp"},
        "accelerate": {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"},
        "rank-files-dtensor": {"rank0.pt", "rank1.pt", "optim_rank0.pt", "optim_rank1.pt"},
        "rank-files-sharded": {"rank0.pt", "rank1.pt", "optim_rank0.pt", "optim_rank1.pt"},
        "accelerate-rank-files": {"pytorch_model_fsdp_0_rank0.bin", "pytorch_model_fsdp_0_rank1.bin"},
        "hf-dcp": {
            "shard-00001-model-00001-of-00001.safetensors",
            "shard-00002-model-00001-of-00001.safetensors",
        },
        "torch-full": {"model.pt"},
        "safetensors": {"model.safetensors.index.json", "model-00001-of-00003.safetensors"},
    }[layout]
    assert expected <= names, sorted(names)
    # Nothing half-written is left beside the output.
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("engine", ["fsdp1", "fsdp2"])
def test_reference_format(fsdp1_out: Path, fsdp2_out: Path, engine: str) -> None:
    base = fsdp1_out if engine == "fsdp1" else fsdp2_out
    for name in ("ref.pt", "ref_step2.pt"):
        ref = load_ref(base / name)
        assert sorted(ref) == ["model", "optim"]
        assert list(ref["model"]) == model_keys()
        assert all(type(t) is torch.Tensor and t.device.type == "cpu" for t in ref["model"].values())
        assert sorted(ref["optim"]["state"]) == sorted(param_keys())
        for entry in ref["optim"]["state"].values():
            assert sorted(entry) == ["exp_avg", "exp_avg_sq", "step"]
        (group,) = ref["optim"]["param_groups"]
        assert group["lr"] == 1e-2 and sorted(group["params"]) == sorted(param_keys())
    first, second = load_ref(base / "ref.pt"), load_ref(base / "ref_step2.pt")
    assert not torch.equal(first["model"]["tok_emb.weight"], second["model"]["tok_emb.weight"])
    assert first["optim"]["state"]["tok_emb.weight"]["step"].item() == 1
    assert second["optim"]["state"]["tok_emb.weight"]["step"].item() == 2


def test_fsdp1_and_fsdp2_train_alike(fsdp1_out: Path, fsdp2_out: Path) -> None:
    a, b = load_ref(fsdp1_out / "ref.pt"), load_ref(fsdp2_out / "ref.pt")
    for key in a["model"]:
        torch.testing.assert_close(a["model"][key], b["model"][key])


@pytest.mark.parametrize("layout", ["fsdp2-dcp", "fsdp1-dcp"])
def test_dcp_loads_back_exactly(fsdp1_out: Path, fsdp2_out: Path, layout: str) -> None:
    out = layout_dir(fsdp1_out, fsdp2_out, layout)
    ref = load_ref(out.parent / "ref.pt")
    keys = list(FileSystemReader(out).read_metadata().state_dict_metadata)
    assert "model.tok_emb.weight" in keys and "optim.state.tok_emb.weight.exp_avg" in keys
    assert "optim.param_groups.0.lr" in keys
    sd = _load_state_dict_from_keys(checkpoint_id=out)
    assert_model_equal(sd["model"], ref)
    assert_optim_equal(sd["optim"]["state"], ref)
    assert sd["optim"]["param_groups"][0]["lr"] == 1e-2


def test_accelerate_loads_back_exactly(fsdp1_out: Path) -> None:
    out = fsdp1_out / "accelerate"
    ref = load_ref(fsdp1_out / "ref.pt")
    model = _load_state_dict_from_keys(checkpoint_id=out / "pytorch_model_fsdp_0")
    assert list(model) == ["model"]
    assert_model_equal(model["model"], ref)
    optim = _load_state_dict_from_keys(checkpoint_id=out / "optimizer_0")
    assert list(optim) == ["optimizer"]
    assert_optim_equal(optim["optimizer"]["state"], ref)


def test_hf_dcp_loads_back_exactly(fsdp2_out: Path) -> None:
    sd = _load_state_dict_from_keys(storage_reader=HuggingFaceStorageReader(str(fsdp2_out / "hf-dcp")))
    assert_model_equal(sd, load_ref(fsdp2_out / "ref.pt"))


@pytest.mark.parametrize("layout", ["rank-files-dtensor", "rank-files-sharded", "accelerate-rank-files"])
def test_rank_files_assemble_exactly(fsdp1_out: Path, fsdp2_out: Path, layout: str) -> None:
    out = layout_dir(fsdp1_out, fsdp2_out, layout)
    prefix = "pytorch_model_fsdp_0_rank" if layout == "accelerate-rank-files" else "rank"
    suffix = ".bin" if layout == "accelerate-rank-files" else ".pt"
    files = [out / f"{prefix}{r}{suffix}" for r in range(WS)]
    assert_model_equal(assemble_rank_files(files), load_ref(out.parent / "ref.pt"))


def test_rank_files_optimizer_structure(fsdp1_out: Path, fsdp2_out: Path) -> None:
    from torch.distributed.tensor import DTensor

    osd = torch.load(fsdp2_out / "rank-files-dtensor" / "optim_rank0.pt", weights_only=False)
    assert sorted(osd) == ["param_groups", "state"] and sorted(osd["state"]) == list(range(len(param_keys())))
    assert isinstance(osd["state"][0]["exp_avg"], DTensor)
    path = fsdp1_out / "rank-files-sharded" / "optim_rank1.pt"
    osd = torch.load(path, weights_only=False, pickle_module=_stub_pickle)
    assert sorted(osd["state"]) == sorted(param_keys())
    assert isinstance(osd["state"]["tok_emb.weight"]["exp_avg"], _ShardedTensorStub)


def test_torch_full_and_safetensors_exact(fsdp2_out: Path) -> None:
    ref = load_ref(fsdp2_out / "ref.pt")
    assert_model_equal(torch.load(fsdp2_out / "torch-full" / "model.pt", weights_only=True), ref)
    out = fsdp2_out / "safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        part = load_file(out / name)
        assert all(index["weight_map"][k] == name for k in part)
        sd.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    assert_model_equal(sd, ref)


def test_compiled_tied_bf16(compiled_out: Path) -> None:
    keys = list(FileSystemReader(compiled_out / "fsdp2-dcp").read_metadata().state_dict_metadata)
    assert "model._orig_mod.tok_emb.weight" in keys and "model._orig_mod.lm_head.weight" in keys
    assert "optim.state.tok_emb.weight.exp_avg" in keys  # get_optimizer_state_dict strips _orig_mod.
    ref = load_ref(compiled_out / "ref.pt")
    assert list(ref["model"]) == model_keys(tie=True)  # clean FQNs, both tied names
    assert ref["model"]["tok_emb.weight"].dtype == torch.bfloat16
    assert sorted(ref["optim"]["state"]) == sorted(param_keys(tie=True))  # the tied parameter once
    sd = _load_state_dict_from_keys(checkpoint_id=compiled_out / "fsdp2-dcp")
    assert_model_equal(sd["model"], ref)

    full = torch.load(compiled_out / "torch-full" / "model.pt", weights_only=True)
    assert all(k.startswith("_orig_mod.") for k in full)
    emb, head = full["_orig_mod.tok_emb.weight"], full["_orig_mod.lm_head.weight"]
    assert emb.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()  # tie kept by torch.save
    assert_model_equal(full, ref)


def test_make_sample_model_only(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()  # an empty folder may exist already
    make_sample(
        out, world_size=WS, layout="fsdp1-dcp", size=SIZE, with_optim=False, reference=tmp_path / "r.pt"
    )
    keys = list(FileSystemReader(out).read_metadata().state_dict_metadata)
    assert sorted(keys) == sorted(model_keys())  # top-level clean FQNs
    ref = load_ref(tmp_path / "r.pt")
    assert_model_equal(_load_state_dict_from_keys(checkpoint_id=out), ref)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "r.pt"]


def test_load_and_step_is_world_size_independent(fsdp2_out: Path, tmp_path: Path) -> None:
    after_load, after_step = tmp_path / "load.pt", tmp_path / "step.pt"
    load_and_step(
        fsdp2_out / "fsdp2-dcp",
        world_size=3,
        size=SIZE,
        reference_after_load=after_load,
        reference_after_step=after_step,
    )
    ref, ref2 = load_ref(fsdp2_out / "ref.pt"), load_ref(fsdp2_out / "ref_step2.pt")
    loaded = load_ref(after_load)
    assert_model_equal(loaded["model"], ref)
    assert_optim_equal(loaded["optim"]["state"], ref)
    stepped = load_ref(after_step)
    assert list(stepped["model"]) == list(ref2["model"])
    for key, tensor in ref2["model"].items():
        torch.testing.assert_close(stepped["model"][key], tensor, rtol=1e-5, atol=1e-6)
        assert not torch.equal(stepped["model"][key], loaded["model"][key]) or key == "pos_scale"
    for fqn, entry in ref2["optim"]["state"].items():
        for name, tensor in entry.items():
            torch.testing.assert_close(stepped["optim"]["state"][fqn][name], tensor, rtol=1e-5, atol=1e-7)


def test_failed_job_leaves_nothing(fsdp2_out: Path, tmp_path: Path) -> None:
    # The checkpoint is "tiny"; loading it as "small" fails inside every rank.
    with pytest.raises(SampleJobError, match=r"size mismatch|Size mismatch|shape"):
        load_and_step(
            fsdp2_out / "fsdp2-dcp",
            world_size=WS,
            size="small",
            reference_after_load=tmp_path / "a.pt",
            reference_after_step=tmp_path / "b.pt",
        )
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"fsdp2-dcp.*safetensors"):
        make_sample(tmp_path / "x", layout="nope")
    with pytest.raises(ValueError, match="'tiny', 'small'"):
        make_sample(tmp_path / "x", size="huge")
    with pytest.raises(ValueError, match="float32"):
        make_sample(tmp_path / "x", dtype="float16")
    with pytest.raises(ValueError, match="share an FSDP flavour"):
        make_samples({"fsdp1-dcp": tmp_path / "a", "fsdp2-dcp": tmp_path / "b"})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").touch()
    with pytest.raises(FileExistsError):
        make_sample(tmp_path / "full", size=SIZE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]


def test_byte_size_presets() -> None:
    for size in ("500MB", "1GB", "3GB"):
        for tie in (False, True):
            cfg = config_for_size(size, tie)
            target = {"500MB": 5e8, "1GB": 1e9, "3GB": 3e9}[size]
            assert abs(cfg.num_params() * 4 - target) / target < 0.01
            for n in (cfg.vocab, cfg.dim, cfg.hidden):
                assert n % 2 and n % 3, cfg
    cfg = config_for_size("small")
    assert sum(p.numel() for p in SampleModel(cfg).parameters()) == cfg.num_params()


def test_untrained_sample_is_a_valid_fsdp2_checkpoint(tmp_path: Path) -> None:
    """`train=False` (`ckptctl sample --no-train`) initialises shards in place: a real DCP checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "untrained"
    make_sample(out, world_size=2, layout="fsdp2-dcp", size="tiny", with_optim=False, train=False)
    dcp_to_torch_save(str(out), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert "tok_emb.weight" in full and full["tok_emb.weight"].std() > 0
    with pytest.raises(ValueError, match="train=False"):
        make_sample(tmp_path / "bad", layout="fsdp2-dcp", size="tiny", train=False)


def test_sample_over_one_made_with_other_options_is_refused_or_remade(tmp_path: Path) -> None:
    """`ckptctl sample DIR --world-size 4` over a world-size-2 sample: refused in one line naming --overwrite
    (the folder untouched); with --overwrite it is remade; the same options again keep it."""
    from .conftest import ckptctl

    target = tmp_path / "demo"
    ckptctl("sample", target, "--world-size", "2", "--size", "tiny")
    again = ckptctl("sample", target, "--world-size", "2", "--size", "tiny")
    assert "keeping it" in again.stdout
    before = sorted(p.name for p in target.iterdir())
    other = ckptctl("sample", target, "--world-size", "4", "--size", "tiny", check=False)
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1
    assert "world size 2 (asked: 4)" in other.stderr and "--overwrite" in other.stderr
    assert sorted(p.name for p in target.iterdir()) == before
    ckptctl("sample", target, "--world-size", "4", "--size", "tiny", "--overwrite")
    info = json.loads(ckptctl("inspect", target, "--json").stdout)
    assert info["world_size"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]  # no staging folder left beside it
