"""reshard: real FSDP2 jobs at the target world size load the output and train on identically."""

from __future__ import annotations

import io
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from ckpt_service.sample import load_and_step, make_samples
from converters import ReshardOptions, reshard
from converters.layouts import chunk_bounds
from converters.transforms import KeyOptions

from .conftest import Sample, Samples, assert_same_tensors, ckptctl

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop


def fsdp2_ws4(samples: Samples) -> Sample:
    key = "fsdp2-ws4"
    if key not in samples.made:
        base = samples.root / key
        base.mkdir()
        make_samples({"fsdp2-dcp": base / "dcp"}, world_size=4, size="tiny", reference=base / "reference.pt",
                     extra_step_reference=base / "step.pt")
        samples.made[key] = Sample(base / "dcp", base / "reference.pt")
    return samples.made[key]


def assert_same_state(got: dict, want: dict) -> None:
    assert_same_tensors(got["model"], want["model"])
    assert sorted(got["optim"]["state"]) == sorted(want["optim"]["state"])
    for fqn, state in want["optim"]["state"].items():
        assert_same_tensors(got["optim"]["state"][fqn], state)


def check_rank_files(folder: Path, world_size: int) -> None:
    """Rank R's file holds exactly FSDP2's rank-R dim-0 slice of every tensor, and nothing else."""
    md = pickle.loads((folder / ".metadata").read_bytes())  # our own output, written by this test run
    for index, info in md.storage_data.items():
        meta = md.state_dict_metadata[index.fqn]
        if not hasattr(meta, "chunks"):
            assert info.relative_path == "__0_0.distcp"
            continue
        if len(meta.size) == 0:
            assert info.relative_path == "__0_0.distcp"
            continue
        rank = int(info.relative_path.split("_")[2])
        start, length = chunk_bounds(meta.size[0], world_size, rank)
        chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset))
        assert (chunk.offsets[0], chunk.sizes[0]) == (start, length), (index.fqn, rank)
        assert tuple(chunk.sizes[1:]) == tuple(meta.size[1:])
    assert sorted(p.name for p in folder.glob("*.distcp")) == sorted(f"__{r}_0.distcp" for r in range(world_size))
    # every record is a valid zip whose CRC-32s match its bytes (written in the kernel or streamed)
    for info in md.storage_data.values():
        with (folder / info.relative_path).open("rb") as fh:
            fh.seek(info.offset)
            record = zipfile.ZipFile(io.BytesIO(fh.read(info.length)))
        assert record.testzip() is None


def load_at(folder: Path, world_size: int, tmp_path: Path, **kwargs: object) -> tuple[dict, dict]:
    after_load, after_step = tmp_path / f"load{world_size}.pt", tmp_path / f"step{world_size}.pt"
    load_and_step(folder, world_size=world_size, size="tiny", reference_after_load=after_load,
                  reference_after_step=after_step, **kwargs)
    return torch.load(after_load, weights_only=True), torch.load(after_step, weights_only=True)


def test_fsdp2_4_to_3_loads_and_steps_like_the_original(samples: Samples, tmp_path: Path) -> None:
    src = fsdp2_ws4(samples)
    out = tmp_path / "ws3"
    ckptctl("reshard", src.path, out, "--world-size", "3", "--only", "all", "--verify")
    check_rank_files(out, 3)
    loaded, stepped = load_at(out, 3, tmp_path)
    assert_same_state(loaded, src.ref())
    original_step = torch.load(src.reference.parent / "step.pt", weights_only=True)
    for name, tensor in original_step["model"].items():
        torch.testing.assert_close(stepped["model"][name], tensor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("key", "target_ws"), [("fsdp2-ws2", 4), ("fsdp2-ws4", 1), ("fsdp1-ws2", 3)])
def test_reshard_matrix(key: str, target_ws: int, samples: Samples, fsdp1: dict[str, Sample],
                        fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    src = {"fsdp2-ws2": fsdp2["fsdp2-dcp"], "fsdp1-ws2": fsdp1["fsdp1-dcp"]}.get(key) or fsdp2_ws4(samples)
    out = tmp_path / "out"
    reshard(str(src.path), str(out), ReshardOptions(world_size=target_ws, keys=KeyOptions(only="all")))
    check_rank_files(out, target_ws)
    loaded, _ = load_at(out, target_ws, tmp_path)
    assert_same_state(loaded, src.ref())


@pytest.mark.parametrize("layout", ["rank-files-dtensor", "rank-files-sharded", "safetensors", "accelerate"])
def test_other_inputs_reshard_into_fsdp2(layout: str, fsdp1: dict[str, Sample], fsdp2: dict[str, Sample],
                                         tmp_path: Path) -> None:
    src = {**fsdp1, **fsdp2}[layout]
    # per-rank DTensor optimizer files key state by parameter id, so those reshard the model alone
    only = "model" if layout in ("rank-files-dtensor", "safetensors") else "all"
    out = tmp_path / "out"
    # --only all keeps keys as stored (Accelerate's `optimizer.`, rank files' top-level model): --clean-keys
    # asks for the `model.` / `optim.` containers the FSDP2 job here loads, in one flat DCP folder (an Accelerate
    # source otherwise keeps its own layout, which resumes only under its stored names)
    flat = ["--clean-keys", "--output-layout", "flat"] if only == "all" else []
    ckptctl("reshard", src.path, out, "--world-size", "3", "--only", only, *flat)
    loaded, _ = load_at(out, 3, tmp_path)
    if only == "all":
        assert_same_state(loaded, src.ref())
    else:
        assert_same_tensors(loaded["model"], src.ref()["model"])


def test_export_then_reshard_to_2(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    src = fsdp2["fsdp2-dcp"]
    ckptctl("export", src.path, tmp_path / "hf", "--max-shard-size", "100KB")
    ckptctl("reshard", tmp_path / "hf", tmp_path / "ws2", "--world-size", "2", "--only", "model")
    loaded, _ = load_at(tmp_path / "ws2", 2, tmp_path)
    assert_same_tensors(loaded["model"], src.ref()["model"])


def test_reshard_defaults_to_the_whole_training_state(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    """A reshard is for resuming training: without --only it keeps model and optimizer state as stored."""
    src = fsdp2["fsdp2-dcp"]
    out = tmp_path / "ws3"
    proc = ckptctl("reshard", src.path, out, "--world-size", "3")
    assert "left out" not in proc.stderr
    loaded, _ = load_at(out, 3, tmp_path)
    assert_same_state(loaded, src.ref())
    model_only = ckptctl("reshard", src.path, tmp_path / "model", "--world-size", "3", "--only", "model")
    assert "optimizer state" in model_only.stderr  # asked for: the optimizer is left out, and said so


def test_reshard_job_progress_counts_tensors_and_a_missing_source_is_refused(fsdp2: dict[str, Sample],
                                                                             tmp_path: Path) -> None:
    """REST: progress counts each tensor once (not once per rank piece); a source that is not there is a 4xx
    at submit naming `source`, not a failure later in the queue."""
    from converters import inspect

    from .service_harness import Tokens, job_spec, make_server

    src = fsdp2["fsdp2-dcp"].path
    tokens, out = Tokens.make(), tmp_path / "out"
    out.mkdir()
    server = make_server(tmp_path / "data", read_roots=[src.parent], write_roots=[out], workers=1,
                         tokens=tokens.entries).start()
    try:
        with server.http(tokens.write) as http:
            missing = http.post("/v1/jobs", json=job_spec("reshard", src.parent / "nope", out / "a", world_size=4))
            assert missing.status_code in (404, 409, 422), missing.text
            error = missing.json()["error"]
            assert [f["field"] for f in error["fields"]] == ["source"] and "does not exist" in error["message"]
            assert http.get("/v1/jobs").json()["items"] == []  # nothing was queued
            job = http.post("/v1/jobs", json=job_spec("reshard", src, out / "ws4", world_size=4)).json()
        final = server.wait_job(job["id"], ("succeeded", "failed"), token=tokens.read)
        assert final["state"] == "succeeded", final["error"]
        progress = final["progress"]
        assert progress["done_tensors"] == progress["total_tensors"] == len(inspect(str(src)).tensors)
        assert progress["done_bytes"] == progress["total_bytes"] > 0
    finally:
        server.stop()


def test_round_trip_4_3_4_is_identical(samples: Samples, tmp_path: Path) -> None:
    src = fsdp2_ws4(samples)
    ckptctl("reshard", src.path, tmp_path / "ws3", "--world-size", "3", "--only", "all")
    ckptctl("reshard", tmp_path / "ws3", tmp_path / "ws4", "--world-size", "4", "--only", "all")
    proc = ckptctl("verify", src.path, tmp_path / "ws4")
    assert proc.stdout.startswith("OK")


def test_more_ranks_than_rows_and_dtype_rules(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    src = fsdp2["fsdp2-dcp"]
    out = tmp_path / "ws64"
    proc = ckptctl("reshard", src.path, out, "--world-size", "64", "--only", "all", "--dtype", "bfloat16",
                   "--verify")
    assert "fewer rows than 64 ranks" in proc.stderr
    check_rank_files(out, 64)
    from converters import verify

    report = verify(str(src.path), str(out), keys=KeyOptions(only="optim", nest=False))
    assert report.ok  # optimizer state is not cast without --dtype-optim
    from converters.formats import load_index

    index = load_index(str(out))
    assert {t.dtype for n, t in index.tensors.items() if n.startswith("model.")} == {"bfloat16"}
    assert {t.dtype for n, t in index.tensors.items() if n.startswith("optim.")} == {"float32"}


def test_shard_dim_rule(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    src = fsdp2["fsdp2-dcp"]
    out = tmp_path / "cols"
    ckptctl("reshard", src.path, out, "--world-size", "2", "--only", "model", "--shard-dim-rule", r"lm_head\.weight$=1")
    md = pickle.loads((out / ".metadata").read_bytes())
    chunks = md.state_dict_metadata["lm_head.weight"].chunks
    width = md.state_dict_metadata["lm_head.weight"].size[1]
    assert [(tuple(c.offsets), tuple(c.sizes)[1]) for c in chunks] == [((0, 0), -(-width // 2)),
                                                                       ((0, -(-width // 2)), width // 2)]
    proc = ckptctl("verify", src.path, out, "--only", "model")  # raises unless it exits 0
    assert proc.stdout.startswith("OK identical")


def test_bad_reshard_input(fsdp2: dict[str, Sample], tmp_path: Path) -> None:
    src = fsdp2["fsdp2-dcp"]
    proc = ckptctl("reshard", src.path, tmp_path / "a", "--world-size", "0", check=False)
    assert proc.returncode == 2 and "--world-size" in proc.stderr
    (tmp_path / "exists").mkdir()
    proc = ckptctl("reshard", src.path, tmp_path / "exists", "--world-size", "2", check=False)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    # an optimizer whose state names a parameter the model does not have
    bad = tmp_path / "bad.pt"
    torch.save({"model": {"w": torch.ones(4, 2)},
                "optim": {"state": {"w": {"exp_avg": torch.ones(4, 2)}, "ghost.weight": {"exp_avg": torch.ones(3)}},
                          "param_groups": [{"lr": 0.1, "params": ["w", "ghost.weight"]}]}}, bad)
    proc = ckptctl("reshard", bad, tmp_path / "b", "--world-size", "2", "--only", "all", check=False)
    assert proc.returncode == 2 and "ghost.weight" in proc.stderr
    assert not (tmp_path / "b").exists()
    shutil.rmtree(tmp_path / "exists")


def test_training_state_beside_the_model_is_kept_by_name(tmp_path: Path) -> None:
    """torchtitan-style DCP: flat model keys plus optimizer, dataloader, lr_scheduler and train_state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = {"tok.weight": torch.randn(7, 3), "out.weight": torch.randn(5, 3),
             "optimizer": {"state": {"tok.weight": {"exp_avg": torch.randn(7, 3), "step": torch.tensor(3.0)}},
                           "param_groups": [{"lr": 0.1, "params": ["tok.weight"]}]},
             "dataloader": {"position": torch.tensor(17), "shard": "s-3"}, "lr_scheduler": {"last_epoch": 3},
             "train_state": {"step": 200}}
    src = tmp_path / "titan"
    dcp.save(state, checkpoint_id=str(src), no_dist=True)
    export = ckptctl("export", src, tmp_path / "export")
    assert "dataloader, lr_scheduler, train_state" in export.stderr  # left out of a model export, by name
    out = tmp_path / "ws3"
    ckptctl("reshard", src, out, "--world-size", "3", "--only", "all")
    dcp_to_torch_save(str(out), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert sorted(full) == sorted(state)  # every key kept where it was
    assert torch.equal(full["tok.weight"], state["tok.weight"])
    want = state["optimizer"]["state"]["tok.weight"]["exp_avg"]
    assert torch.equal(full["optimizer"]["state"]["tok.weight"]["exp_avg"], want)
    assert torch.equal(full["dataloader"]["position"], state["dataloader"]["position"])
    assert full["dataloader"]["shard"] == "s-3"
    assert full["lr_scheduler"] == {"last_epoch": 3} and full["train_state"] == {"step": 200}
