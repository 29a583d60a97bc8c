"""Fidelity on checkpoints made with torch's own APIs (FSDP1 saves, torchtitan's layouts), not our sample
generator: exports hold exactly the model, a whole training state keeps every key through reshard and
convert, and `--verify` reads outputs back with the consumer's own loader."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ckpt_service.sample.model import build_model, config_for_size, next_token_loss
from converters.errors import VerifyError

from .conftest import assert_same_tensors, ckptctl
from .test_export import load_export

LR = 1e-2
CFG = config_for_size("tiny")


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (2, 9), generator=torch.Generator().manual_seed(seed))


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    optim.zero_grad(set_to_none=True)
    next_token_loss(model, tokens).backward()
    optim.step()


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(CFG, seed, torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=LR)
    train_step(model, optim, batch(1 + seed))
    return model, optim


def titan_state(model: torch.nn.Module, optim: torch.optim.Optimizer, layout: str) -> dict[str, Any]:
    """torchtitan's checkpoint state: `nested` keeps the model under `model` (optimizer by FQN), `flat` puts
    the model at the top level with flatten_optimizer_state_dict (`optimizer.state.<fqn>.exp_avg`)."""
    flat = layout == "flat"
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    rest = {"lr_scheduler": {"last_epoch": 1, "_step_count": 2}, "dataloader": {"position": torch.tensor(17)},
            "train_state": {"step": torch.tensor(1, dtype=torch.int32)}}
    return {**msd, "optimizer": osd, **rest} if flat else {"model": msd, "optimizer": osd, **rest}


def save_titan(path: Path, layout: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    model, optim = trained()
    state = titan_state(model, optim, layout)
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return model, optim, state


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_tree(got: Any, want: Any, where: str = "") -> None:
    """Same nested keys, bit-identical tensors, equal plain values."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert sorted(map(str, got)) == sorted(map(str, want)), where
        for key, value in want.items():
            assert_same_tree(got[key], value, f"{where}.{key}")
    else:
        assert got == want, where


def dcp_full(folder: Path, tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / f"{folder.name}.full.pt"
    dcp_to_torch_save(str(folder), str(out))
    return torch.load(out, weights_only=True)


# --- FSDP1 saves --------------------------------------------------------------------------------------


@contextmanager
def gloo_world_1(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # real FSDP jobs, consumer loads or a subprocess: the full suite
@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_fsdp1_saves_export_exactly(kind: str, tmp_path: Path) -> None:
    """A rank-0 torch.save under FULL_STATE_DICT, and a SHARDED_STATE_DICT rank file at world size 1
    (FSDP1 switches to NO_SHARD): tensors pickled through _rebuild_from_type_v2 with torch.Tensor."""
    from torch.distributed.fsdp import FullStateDictConfig, ShardedStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model, _ = trained()
    want = model_tensors(model)
    src = tmp_path / ("full.pt" if kind == "full" else "sharded")
    with gloo_world_1(tmp_path):
        fsdp = FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))
        if kind == "full":  # offload_to_cpu=True segfaults on CPU (FORMATS.md)
            with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT,
                                      FullStateDictConfig(offload_to_cpu=False, rank0_only=True)):
                torch.save(fsdp.state_dict(), src)
        else:
            src.mkdir()
            with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
                torch.save(fsdp.state_dict(), src / "rank0.pt")
    ckptctl("export", src, tmp_path / "export", "--verify")
    assert_same_tensors(load_export(tmp_path / "export"), want)


# --- torchtitan layouts -------------------------------------------------------------------------------


@pytest.mark.slow  # real FSDP jobs, consumer loads or a subprocess: the full suite
@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_titan_export_holds_the_model_and_reshard_keeps_every_key(layout: str, tmp_path: Path) -> None:
    src = tmp_path / "titan"
    model, _, state = save_titan(src, layout)
    info = json.loads(ckptctl("inspect", src, "--json").stdout)
    assert info["has_optimizer"] is True

    export = ckptctl("export", src, tmp_path / "export", "--verify")
    assert_same_tensors(load_export(tmp_path / "export"), model_tensors(model))
    optim_entries = sum(1 for name in dcp.FileSystemReader(str(src)).read_metadata().state_dict_metadata
                        if name.startswith("optimizer."))
    assert f"left out {optim_entries} optimizer state entries" in export.stderr
    assert "dataloader, lr_scheduler, train_state" in export.stderr
    assert "safetensors.safe_open loads it" in export.stdout

    out = tmp_path / "ws2"
    proc = ckptctl("reshard", src, out, "--world-size", "2", "--only", "all", "--verify", "--memory-limit", "1MiB")
    assert "loads it" in proc.stdout and "a sample of" in proc.stdout  # dcp.load of a sample within the budget
    before = dcp.FileSystemReader(str(src)).read_metadata()
    after = dcp.FileSystemReader(str(out)).read_metadata()
    assert sorted(after.state_dict_metadata) == sorted(before.state_dict_metadata)
    assert after.planner_data == before.planner_data  # the same nesting, so dcp_to_torch_save rebuilds the same
    assert sorted({p.relative_path for p in after.storage_data.values()}) == ["__0_0.distcp", "__1_0.distcp"]
    assert_same_tree(dcp_full(out, tmp_path), dcp_full(src, tmp_path))
    # the training job's own call: dcp.load into the state it saved, every key found
    fresh = titan_state(*trained(seed=7), layout)  # other values everywhere: all of them come from the load
    fresh["dataloader"]["position"] = torch.tensor(0)
    fresh["train_state"]["step"] = torch.tensor(0, dtype=torch.int32)
    dcp.load(fresh, checkpoint_id=str(out), no_dist=True)
    assert_same_tree(fresh, state)

    # convert keeps every key too (its default is --only all)
    ckptctl("convert", src, tmp_path / "full.pt", "--to", "torch", "--verify")
    assert_same_tree(torch.load(tmp_path / "full.pt", weights_only=True), dcp_full(src, tmp_path))


@pytest.mark.slow  # real FSDP jobs, consumer loads or a subprocess: the full suite
def test_titan_train_state_bytesio_survives_reshard(tmp_path: Path) -> None:
    """torchtitan's TrainState keeps a torch.save of its losses in an io.BytesIO: carried byte for byte."""
    model, optim = trained()
    state = titan_state(model, optim, "nested")
    losses = io.BytesIO()
    torch.save([2.5, 2.25], losses)
    state["train_state"]["global_avg_losses"] = losses
    src, out = tmp_path / "titan", tmp_path / "ws2"
    dcp.save(state, checkpoint_id=str(src), no_dist=True)
    ckptctl("export", src, tmp_path / "export")
    assert_same_tensors(load_export(tmp_path / "export"), model_tensors(model))
    ckptctl("reshard", src, out, "--world-size", "2", "--only", "all", "--verify")
    before = dcp.FileSystemReader(str(src)).read_metadata()
    assert sorted(dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata) == \
        sorted(before.state_dict_metadata)
    target = {"train_state": {"global_avg_losses": io.BytesIO()}}
    dcp.load(target, checkpoint_id=str(out), no_dist=True)
    assert target["train_state"]["global_avg_losses"].getvalue() == losses.getvalue()


@pytest.mark.slow  # real FSDP jobs, consumer loads or a subprocess: the full suite
def test_optimizer_found_by_structure_under_any_name(tmp_path: Path) -> None:
    """An optimizer state dict (ids, state + param_groups) under a container no list names; an entry named
    like an optimizer without its structure is reported by name, never exported as a weight."""
    model, optim = trained()
    src = tmp_path / "ckpt.pt"
    torch.save({"net": model.state_dict(), "opt": optim.state_dict(), "optimizer": {"scale": torch.tensor(2.0)}},
               src)
    info = json.loads(ckptctl("inspect", src, "--json").stdout)
    assert info["has_optimizer"] is True and info["unclassified"] == ["optimizer.scale"]
    proc = ckptctl("export", src, tmp_path / "export", "--keep-keys")
    assert_same_tensors(load_export(tmp_path / "export"), {f"net.{k}": v for k, v in model_tensors(model).items()})
    assert "optimizer.scale" in proc.stderr and "neither model weights nor optimizer state" in proc.stderr
    refused = ckptctl("export", src, tmp_path / "x", "--only", "all", check=False)
    assert refused.returncode == 2 and "model weights alone" in refused.stderr and not (tmp_path / "x").exists()


# --- FSDP2 resumes from a reshard ------------------------------------------------------------------------


def _resume_rank(rank: int, world_size: int, port: int, jobs: list[tuple[str, str, str]]) -> None:
    """One FSDP2 rank: for each (checkpoint, layout, output), load the resharded state into FSDP2 and take
    one AdamW step on the shared batch; rank 0 saves the full state after it."""
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        for ckpt, layout, out in jobs:
            model = build_model(CFG, 5, torch.float32)  # other initial values: everything comes from the load
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optim = torch.optim.AdamW(model.parameters(), lr=LR)
            opts = StateDictOptions(flatten_optimizer_state_dict=layout == "flat")
            msd, osd = get_state_dict(model, optim, options=opts)
            state = {**msd, "optimizer": osd} if layout == "flat" else {"model": msd, "optimizer": osd}
            dcp.load(state, checkpoint_id=ckpt)
            set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=state["optimizer"], options=opts)
            train_step(model, optim, batch(2))
            full = StateDictOptions(full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True)
            msd, osd = get_state_dict(model, optim, options=full)
            if rank == 0:
                torch.save({"model": msd, "optimizer": osd}, out)
            dist.barrier()
    except (KeyboardInterrupt, SystemExit, Exception):
        raise
    except BaseException as exc:  # DCP's CheckpointException: not reported to the parent unless an Exception
        raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_resumes_from_a_titan_reshard_like_the_unsharded_run(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from ckpt_service.helpers import free_port

    jobs, refs = [], {}
    for layout in ("flat", "nested"):
        model, optim, _ = save_titan(tmp_path / layout, layout)
        ckptctl("reshard", tmp_path / layout, tmp_path / f"{layout}-ws2", "--world-size", "2", "--only", "all")
        train_step(model, optim, batch(2))  # the unsharded reference continues from the same state
        refs[layout] = get_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
        jobs.append((str(tmp_path / f"{layout}-ws2"), layout, str(tmp_path / f"{layout}-after.pt")))
    # gloo sometimes aborts at exit after the work is done (FORMATS.md): the outputs are checked below
    with contextlib.suppress(mp.ProcessExitedException):
        mp.start_processes(_resume_rank, args=(2, free_port(), jobs), nprocs=2, join=True, start_method="spawn")
    for (_, layout, out) in jobs:
        got = torch.load(out, weights_only=True)
        want_model, want_optim = refs[layout]
        assert sorted(got["model"]) == sorted(want_model) and sorted(got["optimizer"]) == sorted(want_optim)
        for name, tensor in [*want_model.items(), *want_optim.items()]:
            value = got["model"].get(name, got["optimizer"].get(name))
            if isinstance(tensor, torch.Tensor):
                torch.testing.assert_close(value, tensor, rtol=1e-5, atol=1e-6, msg=f"{layout}: {name}")
            else:
                assert value == tensor, (layout, name)


# --- verify with the consumer's own loader ----------------------------------------------------------------


def patch_member(path: Path, suffix: str, old: bytes, new: bytes) -> int:
    """Replace the contents `old` of every stored zip member named `*suffix` by `new` (same length), with
    CRC-32s fixed in local and central headers: a well-formed zip, as our reader reads it."""
    raw = bytearray(path.read_bytes())
    old_crc, new_crc = struct.pack("<I", zlib.crc32(old)), struct.pack("<I", zlib.crc32(new))
    patched = 0
    for sig, crc_at, name_len_at, name_at in ((b"PK\x03\x04", 14, 26, 30), (b"PK\x01\x02", 16, 28, 46)):
        at = raw.find(sig)
        while at != -1:
            n = struct.unpack("<H", raw[at + name_len_at:at + name_len_at + 2])[0]
            if raw[at + name_at:at + name_at + n].decode(errors="replace").endswith(suffix):
                crc_fields = [at + crc_at]
                if sig == b"PK\x03\x04":
                    extra = struct.unpack("<H", raw[at + 28:at + 30])[0]
                    data = at + 30 + n + extra
                    assert raw[data:data + len(old)] == old
                    raw[data:data + len(old)] = new
                    end = data + len(old)  # a data descriptor (streamed member) holds the CRC after the data
                    crc_fields.append(end + 4 if raw[end:end + 4] == b"PK\x07\x08" else end)
                    patched += 1
                for field in crc_fields:
                    if raw[field:field + 4] == old_crc:
                        raw[field:field + 4] = new_crc
            at = raw.find(sig, at + 4)
    path.write_bytes(bytes(raw))
    return patched


def spoil(target: Path, fmt: str) -> None:
    """Damage an output so that our reader still reads the same values but the consumer refuses it."""
    if fmt == "safetensors":  # a UTF-8 byte-order mark before the header JSON: Python's json reads it, safe_open
        path = target / "model.safetensors"  # refuses it ("invalid JSON in header")
        raw = path.read_bytes()
        length = int.from_bytes(raw[:8], "little")
        header = b"\xef\xbb\xbf" + raw[8:8 + length].rstrip(b" ")
        header += b" " * (-len(header) % 8)
        path.write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + length:])
        return
    # a byte order torch does not know: torch.load refuses the archive ("Unknown endianness type")
    files = [target] if fmt == "torch" else sorted(target.glob("*.distcp"))
    assert sum(patch_member(f, "byteorder", b"little", b"middle") for f in files) > 0


@pytest.mark.slow  # real FSDP jobs, consumer loads or a subprocess: the full suite
@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_verify_fails_when_the_consumer_cannot_load_the_output(fmt: str, tmp_path: Path) -> None:
    from converters import storage
    from converters.formats import load_index
    from converters.transforms import KeyOptions, apply
    from converters.verification import verify_output

    src = tmp_path / "titan"
    save_titan(src, "flat")
    target = tmp_path / {"safetensors": "export", "torch": "full.pt", "dcp": "ws2"}[fmt]
    args = {"safetensors": ("export", src, target), "torch": ("convert", src, target, "--to", "torch"),
            "dcp": ("reshard", src, target, "--world-size", "2", "--only", "all")}[fmt]
    ckptctl(*args)
    only = "model" if fmt == "safetensors" else "all"
    assert ckptctl("verify", src, target, "--only", only).stdout.startswith("OK")
    spoil(target, fmt)

    proc = ckptctl("verify", src, target, "--only", only, check=False)
    assert proc.returncode == 1 and proc.stdout.startswith("DIFFERENT"), proc.stdout + proc.stderr
    assert "cannot load" in proc.stdout and target.name in proc.stdout.replace("\n", "")

    # --verify runs the same check on what a conversion has just written (and removes the output)
    reader = storage.RangeReader()
    try:
        view = apply(load_index(str(src), reader=reader), KeyOptions(only=only)).index
        with pytest.raises(VerifyError, match="cannot load"):
            verify_output(view, str(target), "torch" if fmt == "torch" else fmt, reader, cast_ok=False,
                          memory_limit=256 << 20, target=str(target))
    finally:
        reader.close()
    shutil.rmtree(tmp_path / "titan")


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_rename_of_a_training_state_renames_the_parameter_everywhere(layout: str, tmp_path: Path) -> None:
    """--rename changes the FQN in model keys, optimizer state, param_groups keys and `params` lists alike,
    and nothing else: every other key, and the nesting of every key, stays as stored."""
    src, out = tmp_path / "titan", tmp_path / "renamed"
    save_titan(src, layout)
    ckptctl("reshard", src, out, "--world-size", "2", "--only", "all", "--rename", r"^tok_emb\.=embed.")
    before = dcp.FileSystemReader(str(src)).read_metadata().planner_data
    after = dcp.FileSystemReader(str(out)).read_metadata().planner_data

    def renamed(path: tuple) -> tuple:
        return tuple(p.replace("tok_emb.", "embed.") if isinstance(p, str) else p for p in path)

    assert sum("tok_emb." in ".".join(map(str, p)) for p in before.values()) > 3
    assert after == {".".join(map(str, renamed(p))): renamed(p) for p in before.values()}
    if layout == "nested":
        full = dcp_full(out, tmp_path)
        assert "embed.weight" in full["optimizer"]["param_groups"][0]["params"]
        assert "tok_emb.weight" not in full["optimizer"]["param_groups"][0]["params"]
