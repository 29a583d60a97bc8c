"""DeepSpeed ZeRO 1/2/3: checkpoints made by DeepSpeed itself on CPU, checked against its own zero_to_fp32."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from converters.formats import detect, load_index
from converters.formats.flatparts import flat_boxes

from .conftest import ckptctl
from .deepspeed_job import Net, adamw, shared_batch, step_on

# "+aligned": per-parameter alignment paddings and round-robin parameter order in the flat groups
CASES = [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (2, "fp16"),
         (2, "fp32+aligned")]


class DeepSpeedRuns:
    """Checkpoints made once per session by `tests.deepspeed_job` (DeepSpeed on CPU, gloo, world size 2)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[tuple[int, str], Path] = {}

    def get(self, stage: int, dtype: str) -> Path:
        key = (stage, dtype)
        if key not in self.made:
            out = self.root / f"zero{stage}-{dtype}"
            dtype, _, variant = dtype.partition("+")
            proc = subprocess.run([sys.executable, "-m", "tests.deepspeed_job", str(out), "--stage", str(stage),
                                   "--dtype", dtype, "--world-size", "2", *(["--aligned"] if variant else [])],
                                  capture_output=True, text=True,
                                  timeout=600, env={**os.environ, "DS_ACCELERATOR": "cpu"})
            if not (out / "engine.pt").is_file() and dtype == "fp16" and "fp16 is not supported" in proc.stderr:
                pytest.skip("DeepSpeed cannot train in fp16 on this CPU")
            if not (out / "engine.pt").is_file():
                raise AssertionError(f"DeepSpeed run failed:\n{proc.stderr[-4000:]}")
            self.made[key] = out
        return self.made[key]


@pytest.fixture(scope="session")
def ds_runs(tmp_path_factory: pytest.TempPathFactory) -> DeepSpeedRuns:
    return DeepSpeedRuns(tmp_path_factory.mktemp("deepspeed"))


def zero_to_fp32(folder: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The oracle: DeepSpeed's own consolidation."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


# ---------------------------------------------------------------------------------------------- fast


@pytest.mark.parametrize("shape", [(7,), (5, 3), (2, 3, 4), (3, 1, 5), (1, 1), (4, 2, 3, 2)])
def test_flat_boxes_cover_each_run_of_elements_in_order(shape: tuple[int, ...]) -> None:
    numbers = torch.arange(torch.Size(shape).numel()).view(shape)
    for start in range(numbers.numel()):
        for stop in range(start + 1, numbers.numel() + 1):
            seen = []
            for offsets, sizes in flat_boxes(shape, start, stop):
                box = numbers[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                values = box.flatten().tolist()
                assert values == list(range(values[0], values[0] + len(values))), (start, stop, offsets, sizes)
                seen += values
            assert seen == list(range(start, stop)), (shape, start, stop)


def _fake_save(folder: Path, names: list[str], latest: str | None = None) -> Path:
    folder.mkdir(parents=True)
    for name in names:
        torch.save({"optimizer_state_dict": {}}, folder / name)
    if latest is not None:
        (folder.parent / "latest").write_text(latest)
    return folder.parent


def test_tensor_parallel_and_incomplete_saves_are_refused_by_name(tmp_path: Path) -> None:
    tp = _fake_save(tmp_path / "tp" / "global_step1", ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
                                                       "zero_pp_rank_0_mp_rank_01_optim_states.pt"], "global_step1")
    assert detect(str(tp)) == "deepspeed"
    proc = ckptctl("inspect", tp, check=False)
    assert proc.returncode == 2
    assert "mp_rank_01" in proc.stderr and "tensor-parallel" in proc.stderr, proc.stderr
    gap = _fake_save(tmp_path / "gap" / "global_step1", ["mp_rank_00_model_states.pt",
                                                         "zero_pp_rank_1_mp_rank_00_optim_states.pt"], "global_step1")
    proc = ckptctl("export", gap, tmp_path / "out", check=False)
    assert proc.returncode == 2
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt is missing" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tag", ["../../etc", "global_step9", ""])
def test_latest_naming_no_usable_tag_folder_is_refused(tmp_path: Path, tag: str) -> None:
    root = _fake_save(tmp_path / "run" / "global_step1", ["mp_rank_00_model_states.pt",
                                                          "zero_pp_rank_0_mp_rank_00_optim_states.pt"], tag)
    proc = ckptctl("inspect", root, "--from", "deepspeed", check=False)
    assert proc.returncode == 2
    assert "tag" in proc.stderr and str(root) in proc.stderr, proc.stderr
    proc = ckptctl("inspect", root, "--tag", tag or "/", check=False)
    assert proc.returncode == 2 and f"--tag {tag or '/'}" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------- real runs


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "dtype"), CASES)
def test_export_equals_zero_to_fp32_bit_for_bit(ds_runs: DeepSpeedRuns, stage: int, dtype: str,
                                                tmp_path: Path) -> None:
    run = ds_runs.get(stage, dtype)
    ckptctl("export", run / "ckpt", tmp_path / "out", "--memory-limit", "1MiB", "--verify")
    got = read_safetensors(tmp_path / "out")
    assert_bits(got, zero_to_fp32(run / "ckpt"))
    engine = torch.load(run / "engine.pt", weights_only=True)
    for name, tensor in engine["fp32"].items():  # the engine's own master weights, gathered by DeepSpeed
        assert torch.equal(got[name], tensor), name
    assert torch.equal(got["head.weight"], got["emb.weight"])  # tied
    index = load_index(str(run / "ckpt"))
    assert index.format == "deepspeed" and index.world_size == 2
    assert index.producer.startswith("DeepSpeed 0.") and index.producer.endswith(f" ZeRO-{stage}")


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "dtype"), CASES)
def test_adam_state_equals_the_engines_per_parameter_state(ds_runs: DeepSpeedRuns, stage: int, dtype: str,
                                                           tmp_path: Path) -> None:
    run = ds_runs.get(stage, dtype)
    ckptctl("convert", run / "ckpt", tmp_path / "all.pt", "--to", "torch", "--only", "all")
    saved = torch.load(tmp_path / "all.pt", weights_only=True)
    engine = torch.load(run / "engine.pt", weights_only=True)
    state = saved["optim"]["state"]
    assert sorted(state) == sorted(engine["exp_avg"])
    for name in engine["exp_avg"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name][key], engine[key][name]), (name, key)
        assert state[name]["step"].item() == 2
    assert engine["step"] == {2}
    groups = saved["optim"]["param_groups"]
    assert len(groups) == len(engine["param_groups"]) == 2  # weight decay for matrices, none for vectors
    for i, (group, want) in enumerate(zip(groups, engine["param_groups"])):
        assert sorted(group.pop("params")) == sorted(n for n, t in engine["fp32"].items() if (t.dim() > 1) == (i == 0))
        assert group == want


@pytest.mark.slow
def test_older_tag_and_the_tag_folder_itself(ds_runs: DeepSpeedRuns, tmp_path: Path) -> None:
    run = ds_runs.get(3, "fp32")
    ckptctl("export", run / "ckpt" / "global_step1", tmp_path / "step1")
    assert_bits(read_safetensors(tmp_path / "step1"), zero_to_fp32(run / "ckpt", tag="global_step1"))
    ckptctl("export", run / "ckpt", tmp_path / "tag1", "--tag", "global_step1")
    assert_bits(read_safetensors(tmp_path / "tag1"), zero_to_fp32(run / "ckpt", tag="global_step1"))
    ckptctl("export", run / "ckpt" / "global_step2", tmp_path / "step2")
    assert_bits(read_safetensors(tmp_path / "step2"), zero_to_fp32(run / "ckpt"))
    assert not torch.equal(read_safetensors(tmp_path / "step1")["emb.weight"],
                           read_safetensors(tmp_path / "step2")["emb.weight"])


@pytest.mark.slow
def test_module_weights_are_the_16_bit_weights(ds_runs: DeepSpeedRuns, tmp_path: Path) -> None:
    run = ds_runs.get(2, "bf16")
    ckptctl("export", run / "ckpt", tmp_path / "module", "--weights", "module")
    engine = torch.load(run / "engine.pt", weights_only=True)
    assert_bits(read_safetensors(tmp_path / "module"), engine["module"])
    assert engine["module"]["emb.weight"].dtype == torch.bfloat16
    proc = ckptctl("export", ds_runs.get(3, "bf16") / "ckpt", tmp_path / "z3", "--from", "deepspeed-module",
                   check=False)
    assert proc.returncode == 2 and "ZeRO-3 save keeps no 16-bit module weights" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "dtype"), [(2, "fp32+aligned"), (3, "fp32")])
def test_reshard_to_fsdp2_resumes_like_unsharded_adamw(ds_runs: DeepSpeedRuns, stage: int, dtype: str,
                                                      tmp_path: Path) -> None:
    run = ds_runs.get(stage, dtype)
    kept = ckptctl("reshard", run / "ckpt", tmp_path / "kept", "--world-size", "2", check=False)
    assert kept.returncode == 2 and "DeepSpeed tag folders" in kept.stderr and "--output-layout flat" in kept.stderr
    ckptctl("reshard", run / "ckpt", tmp_path / "dcp", "--world-size", "2", "--only", "all", "--verify",
            "--output-layout", "flat")  # DeepSpeed's own layout cannot be kept at a new size: one DCP folder
    subprocess.run([sys.executable, "-m", "tests.deepspeed_job", str(tmp_path / "dcp"), "--resume",
                    "--world-size", "2"], check=True, capture_output=True, timeout=600)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)

    # the reference: the unsharded model and torch's AdamW, from zero_to_fp32's weights and the engine's state
    weights = zero_to_fp32(run / "ckpt")
    engine = torch.load(run / "engine.pt", weights_only=True)
    model = Net()
    model.load_state_dict(weights)
    optim = adamw(model)
    names = {p: n for n, p in model.named_parameters()}
    state = optim.state_dict()
    ordered = [p for group in optim.param_groups for p in group["params"]]  # torch numbers them across groups
    state["state"] = {i: {"step": torch.tensor(2.0), "exp_avg": engine["exp_avg"][names[p]].clone(),
                          "exp_avg_sq": engine["exp_avg_sq"][names[p]].clone()} for i, p in enumerate(ordered)}
    optim.load_state_dict(state)
    step_on(model, optim, shared_batch(model.emb.num_embeddings))
    after = model.state_dict()
    assert sorted(resumed["model"]) == sorted(after)
    for name, tensor in after.items():
        torch.testing.assert_close(resumed["model"][name], tensor, rtol=1e-5, atol=1e-7)
    moved = [n for n in engine["fp32"] if not torch.equal(after[n], weights[n])]
    assert sorted(moved) == sorted(engine["fp32"])  # the step changed every trainable parameter
    assert torch.equal(resumed["model"]["frozen.weight"], weights["frozen.weight"])
    for name in engine["exp_avg"]:
        torch.testing.assert_close(resumed["optim"]["state"][name]["exp_avg"],
                                   optim.state[dict(model.named_parameters())[name]]["exp_avg"])


@pytest.mark.slow
def test_benchmark_runs_and_both_outputs_agree(tmp_path: Path) -> None:
    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_deepspeed.py"
    proc = subprocess.run([sys.executable, str(bench), "--size", "4MB", "--work-dir", str(tmp_path),
                           "--out", str(tmp_path / "result.json")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["outputs"].startswith("identical (")
    assert [row["case"] for row in result["rows"]] == ["ckptctl export", "zero_to_fp32"]
    assert all(row["returncode"] == 0 and row["peak_rss_mb"] > 0 for row in result["rows"])
