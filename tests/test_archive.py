"""The archive tier (converters.archive): checkpoints stored as content-addressed, deduplicated, losslessly
compressed chunks and restored byte for byte.

- units: byte planes and every encoding round-trip; content-defined cuts move only around an insertion;
- a torch.save and a safetensors checkpoint, two versions each: restores equal byte for byte, the second version
  stores only what changed; a damaged chunk is refused on restore naming it and the archives using it; a
  hostile manifest is refused in one line; gc deletes what no manifest references, and gc racing archives
  (threads) loses nothing;
- a LoRA series (PEFT on a tiny LlamaForCausalLM, frozen base, a save each step) and, slow, a DCP series of a
  model trained with FSDP2 at 2 gloo ranks with a frozen embedding: every restore equals byte for byte,
  dcp.load of a restored step equals the original's tensors; stored against logical bytes and the share from
  dedup and from compression are printed (`-s`).

Run as a script (`python -m tests.test_archive FOLDER STEPS`) for the DCP series' rank processes.
"""

from __future__ import annotations

import filecmp
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from converters.archive import archive, chunking, codec, gc, list_archives, restore
from converters.errors import CkptError, FormatError, OptionError, TargetError

from .s3server import S3, s3_fixture, s3_server_fixture  # noqa: F401  (fixtures s3 and s3_server)

# ---- the DCP series' ranks ----------------------------------------------------------------------------------


def _rank(rank: int, world_size: int, folder: str, steps: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from .ranks import end_rank

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(2048, 128), nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 2048))
    model[0].weight.requires_grad_(False)  # the frozen embedding
    fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step in range(1, steps + 1):
        torch.manual_seed(100 * step + rank)
        tokens = torch.randint(0, 2048, (4, 8))
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        opt.step()
        opt.zero_grad()
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, f"step{step}"))
    end_rank()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    mp.spawn(_rank, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2)


# ---- helpers ------------------------------------------------------------------------------------------------


def same_tree(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def series_report(name: str, results: list[Any], store: str) -> dict[str, Any]:
    """Stored against logical bytes of a series archived into `store` (its manifests counted as stored), and the
    shares of the bytes saved that dedup and compression give."""
    logical = sum(r.logical_bytes for r in results)
    new = sum(r.new_bytes for r in results)
    chunks = sum(r.new_stored_bytes for r in results)
    manifests = sum(p.stat().st_size for p in (Path(store) / "manifests").iterdir())
    stored = chunks + manifests
    saved = logical - chunks
    report = {"series": name, "steps": len(results), "logical_bytes": logical, "stored_bytes": stored,
              "chunk_bytes": chunks, "manifest_bytes": manifests, "ratio": round(logical / stored, 2),
              "dedup_share": round((logical - new) / saved, 3) if saved else 0,
              "compression_share": round((new - chunks) / saved, 3) if saved else 0}
    print(json.dumps(report))
    return report


# ---- units --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_every_encoding_round_trips(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    data = (torch.randn(10007) * 3).to(dtype).view(torch.uint8).numpy().tobytes() + b"tail"
    size = torch.tensor([], dtype=dtype).element_size()
    assert codec.join_planes(codec.split_planes(data, max(size, 2)), max(size, 2)) == data
    for itemsize in (1, 2, 4, 8):
        stored = codec.encode(data, itemsize)
        assert codec.decode(stored, len(data)) == data
    assert codec.encode(os.urandom(1000), 4)[0] == codec.RAW  # incompressible: stored raw
    assert codec.encode(bytes(100000), 1)[0] == codec.ZSTD
    import zstandard  # all planes in one frame: what stores written before SOME_PLANES hold

    old = bytes([codec.PLANES, 2]) + zstandard.ZstdCompressor(level=1).compress(codec.split_planes(data, 2))
    assert codec.decode(old, len(data)) == data


def test_byte_planes_win_on_bf16_weights() -> None:
    torch.manual_seed(0)
    data = (torch.randn(1 << 20) * 0.02).bfloat16().view(torch.uint8).numpy().tobytes()
    stored = codec.encode(data, 2)
    assert stored[:3] == bytes([codec.SOME_PLANES, 2, 0b10])  # the sign/exponent plane zstd'ed, mantissas raw
    assert len(stored) < 0.8 * len(data)
    assert codec.decode(stored, len(data)) == data


def test_content_defined_cuts_move_only_around_an_insertion() -> None:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 12 << 20, dtype=np.uint8).tobytes()
    edited = data[:5 << 20] + b"inserted" + data[5 << 20:]

    def chunks(buf: bytes) -> list[bytes]:
        cuts = chunking.cdc_cuts(buf, final=True)
        return [buf[a:b] for a, b in zip([0, *cuts], cuts, strict=False)]

    listed = chunks(data)
    assert b"".join(listed) == data and len(listed) > 8
    assert all(chunking.MIN_CDC <= len(c) <= chunking.PIECE for c in listed[:-1])
    before, after = set(listed), set(chunks(edited))
    assert len(before - after) <= 2  # the chunk holding the insertion (and at most its neighbour)
    assert len(after - before) <= 2


# ---- archive, restore, gc on checkpoints the engine reads ---------------------------------------------------


@pytest.mark.parametrize("fallback", [None, "open", 1, 2, 3, 5])
def test_a_direct_file_written_out_of_order_in_unaligned_chunks_holds_every_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fallback: str | int | None) -> None:
    """Restore's target file (`direct.DirectFile`): chunks at any offsets and lengths (inside one block, across a
    block edge, whole blocks, an unaligned end) written by two threads in any order hold the bytes, through direct
    I/O, or through the page cache when the filesystem refuses direct I/O at open or on a later write."""
    import fcntl
    from concurrent.futures import ThreadPoolExecutor

    from converters.archive import direct

    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 3 * direct.ALIGN * 7 + 123, dtype=np.uint8)
    cuts = sorted({0, len(data), 5, 17, 4095, 4096, 4097, 3 * 4096, 3 * 4096 + 1, *rng.integers(0, len(data), 12)})
    chunks = list(itertools.pairwise(int(c) for c in cuts))
    rng.shuffle(chunks)
    real_open, real_pwrite, writes = os.open, os.pwrite, []

    def refusing_open(path: Any, flags: int, *args: Any) -> int:
        if flags & direct._DIRECT and fallback == "open":
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *args)

    def refusing_pwrite(fd: int, buf: Any, offset: int) -> int:
        writes.append(fd)
        if len(writes) == fallback and fcntl.fcntl(fd, fcntl.F_GETFL) & direct._DIRECT:  # the n-th write
            raise OSError(22, "Invalid argument")  # a filesystem wanting another alignment
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    path = str(tmp_path / "out.bin")
    target = direct.DirectFile(path, len(data))
    assert target.direct == (fallback != "open")

    def put(start: int, stop: int) -> None:
        lead = start % direct.ALIGN
        buf = direct.aligned(lead + stop - start)[lead:]
        buf[:] = data[start:stop]
        target.write(buf, start)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda c: put(*c), chunks))
    target.close(0o640)
    assert target.direct == (fallback is None)
    assert (tmp_path / "out.bin").read_bytes() == data.tobytes()
    assert os.stat(path).st_mode & 0o777 == 0o640


def _versions(tmp_path: Path) -> tuple[Path, Path]:
    """Two versions of a checkpoint (safetensors + torch.save + a side file): only `head` changes in v2."""
    torch.manual_seed(0)
    tensors = {"embed": torch.randn(512, 256), "layer.w": torch.randn(256, 256).bfloat16(),
               "head": torch.randn(64, 256)}
    out = []
    for version in (1, 2):
        folder = tmp_path / f"v{version}"
        (folder / "sub").mkdir(parents=True)
        if version == 2:
            tensors["head"] = tensors["head"] + 1
        save_file(tensors, folder / "model.safetensors")
        torch.save({"model": tensors, "step": version}, folder / "sub" / "state.pt")
        (folder / "config.json").write_text(json.dumps({"version": version}))
        os.chmod(folder / "config.json", 0o600)
        out.append(folder)
    return out[0], out[1]


def test_restore_is_byte_for_byte_and_a_second_version_stores_what_changed(tmp_path: Path) -> None:
    v1, v2 = _versions(tmp_path)
    store = str(tmp_path / "store")
    first, second = archive(str(v1), store), archive(str(v2), store)
    assert first.new_bytes == first.unique_bytes and first.logical_bytes == sum(
        p.stat().st_size for p in v1.rglob("*") if p.is_file())
    assert second.new_bytes < 0.2 * second.logical_bytes  # only `head` (in two files), the headers, the config
    assert second.stored_bytes < second.unique_bytes  # byte planes / zstd shrink the weights
    again = archive(str(v2), store)
    assert again.archive_id == second.archive_id and again.new_chunks == 0
    assert {a["id"] for a in list_archives(store)} == {first.archive_id, second.archive_id}
    for result, source in ((first, v1), (second, v2)):
        target = tmp_path / f"restored-{result.archive_id}"
        restore(store, result.archive_id, str(target))
        same_tree(source, target)
        assert os.stat(target / "config.json").st_mode & 0o777 == 0o600
    with pytest.raises(TargetError, match="exists"):
        restore(store, first.archive_id, str(v1))


def test_an_id_taken_by_other_content_is_refused(tmp_path: Path) -> None:
    v1, v2 = _versions(tmp_path)
    store = str(tmp_path / "store")
    assert archive(str(v1), store, archive_id="run1-step1").archive_id == "run1-step1"
    assert archive(str(v1), store, archive_id="run1-step1").new_chunks == 0  # the same content: a no-op
    with pytest.raises(OptionError, match=r"archive id run1-step1 is taken in store \S+ by another checkpoint"):
        archive(str(v2), store, archive_id="run1-step1")


def test_source_store_and_target_on_s3(tmp_path: Path, s3: S3) -> None:
    v1, v2 = _versions(tmp_path)
    sources = [s3.upload(v, f"ckpt/{v.name}") for v in (v1, v2)]
    store = s3.uri("archive")
    results = [archive(source, store) for source in sources]
    assert results[1].new_bytes < results[1].logical_bytes / 2
    assert {a["id"] for a in list_archives(store)} == {r.archive_id for r in results}
    restore(store, results[1].archive_id, str(tmp_path / "back"))
    same_tree(v2, tmp_path / "back")
    restore(store, results[0].archive_id, s3.uri("restored/v1"))
    for path in v1.rglob("*"):
        if path.is_file():
            assert s3.get(f"restored/v1/{path.relative_to(v1).as_posix()}") == path.read_bytes()
    s3.client.delete_object(Bucket=s3.bucket, Key=f"archive/manifests/{results[0].archive_id}.json")
    assert gc(store, grace_s=0).deleted
    restore(store, results[1].archive_id, str(tmp_path / "again"))
    same_tree(v2, tmp_path / "again")


def test_a_single_file_restores_as_that_file(tmp_path: Path) -> None:
    v1, _ = _versions(tmp_path)
    store = str(tmp_path / "store")
    result = archive(str(v1 / "model.safetensors"), store)
    restore(store, result.archive_id, str(tmp_path / "back.safetensors"))
    assert filecmp.cmp(v1 / "model.safetensors", tmp_path / "back.safetensors", shallow=False)


def test_a_single_file_output_keeps_its_manifest_and_restores_certified(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from typer.testing import CliRunner

    from ckptctl import app as cli
    from converters import ConvertOptions, convert

    torch.manual_seed(0)
    dcp.save({"model": {"a.weight": torch.randn(64, 32), "b.weight": torch.randn(16, 32).half()}},
             checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    out = tmp_path / "run" / "out.safetensors"
    convert(str(tmp_path / "dcp"), str(out), ConvertOptions(export=True))
    beside = tmp_path / "run" / "out.safetensors.ckpt-manifest.json"  # certificate.sidecar: written by the export
    originals = {p: p.read_bytes() for p in (out, beside)}
    store = str(tmp_path / "store")
    result = archive(str(out), store)
    assert result.files == 2 and result.logical_bytes == sum(len(b) for b in originals.values())
    from ckpt_service.archived import check_archive  # retention's check before it deletes: both files compared

    check_archive(store, result.archive_id, str(out), str(tmp_path / "scratch"))
    beside.write_bytes(originals[beside] + b" ")
    with pytest.raises(FormatError, match=r"out\.safetensors\.ckpt-manifest\.json does not restore to the bytes of"):
        check_archive(store, result.archive_id, str(out), str(tmp_path / "scratch"))
    beside.write_bytes(originals[beside])
    out.unlink()  # what retention deletes: the file and its manifest
    beside.unlink()
    restored = restore(store, result.archive_id, str(out))
    assert restored == [str(out), str(beside)]
    assert {p: p.read_bytes() for p in (out, beside)} == originals
    verified = CliRunner().invoke(cli, ["verify", "--certificate", str(out)], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert verified.exit_code == 0 and f"OK {out} matches its certificate" in verified.output, verified.output
    with pytest.raises(TargetError, match=r"out\.safetensors exists"):
        restore(store, result.archive_id, str(out))
    out.unlink()
    with pytest.raises(TargetError, match=r"out\.safetensors\.ckpt-manifest\.json exists"):  # not overwritten
        restore(store, result.archive_id, str(out))
    assert sorted(os.listdir(tmp_path / "run")) == ["out.safetensors.ckpt-manifest.json"]
    path = Path(store) / "manifests" / f"{result.archive_id}.json"
    doc = json.loads(path.read_text())
    doc["files"][1]["name"] = "elsewhere.json"  # a single file's archive holds nothing but it and its manifest
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="a single file lists files other than itself and its manifest beside it"):
        restore(store, result.archive_id, str(tmp_path / "back.safetensors"))


def test_a_damaged_chunk_is_named_with_the_archives_using_it(tmp_path: Path) -> None:
    v1, v2 = _versions(tmp_path)
    store = tmp_path / "store"
    ids = [archive(str(v), str(store)).archive_id for v in (v1, v2)]
    doc = json.loads((store / "manifests" / f"{ids[0]}.json").read_text())
    digest = next(f for f in doc["files"] if f["name"] == "model.safetensors")["chunks"][1][0]  # `embed`: shared
    chunk = store / "chunks" / digest[:2] / digest
    data = bytearray(chunk.read_bytes())
    data[-1] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(FormatError) as err:
        restore(str(store), ids[1], str(tmp_path / "out"))
    assert str(err.value) == (f"archive store {store}: chunk {digest} does not decode (used by archives: "
                              f"{', '.join(sorted(ids))}); those archives cannot be restored from this store: "
                              "re-archive their sources") or "does not match its hash" in str(err.value)
    assert digest in str(err.value) and all(i in str(err.value) for i in ids) and "\n" not in str(err.value)
    assert sorted(os.listdir(tmp_path)) == sorted(["store", "v1", "v2"])  # nothing written, nothing left
    chunk.unlink()
    with pytest.raises(FormatError, match=f"chunk {digest} is missing"):
        restore(str(store), ids[0], str(tmp_path / "out2"))


def test_a_damaged_raw_chunk_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    source = tmp_path / "noise.bin"
    source.write_bytes(np.random.default_rng(0).bytes(600_000))  # incompressible: raw chunks, copied by the kernel
    store = tmp_path / "store"
    result = archive(str(source), str(store))
    restore(str(store), result.archive_id, str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == source.read_bytes()
    doc = json.loads((store / "manifests" / f"{result.archive_id}.json").read_text())
    digest = doc["files"][0]["chunks"][-1][0]
    chunk = store / "chunks" / digest[:2] / digest
    data = bytearray(chunk.read_bytes())
    assert data[0] == codec.RAW
    data[-1] ^= 1
    chunk.write_bytes(bytes(data))
    with pytest.raises(FormatError) as err:
        restore(str(store), result.archive_id, str(tmp_path / "out.bin"))
    assert str(err.value) == (f"archive store {store}: chunk {digest} does not match its hash (used by archives: "
                              f"{result.archive_id}); those archives cannot be restored from this store: "
                              "re-archive their sources")
    assert sorted(os.listdir(tmp_path)) == ["back.bin", "noise.bin", "store"]


def test_a_format_1_store_with_sha256_chunks_still_restores(tmp_path: Path) -> None:
    import hashlib

    v1, _ = _versions(tmp_path)
    store = tmp_path / "store"
    result = archive(str(v1), str(store))
    path = store / "manifests" / f"{result.archive_id}.json"
    doc = json.loads(path.read_text())
    for f in doc["files"]:  # what the SHA-256 version of the archive tier wrote: the same chunks under SHA-256
        for chunk in f["chunks"]:
            old = store / "chunks" / chunk[0][:2] / chunk[0]
            stored = old.read_bytes()
            chunk[0] = hashlib.sha256(codec.decode(stored, chunk[1])).hexdigest()
            (store / "chunks" / chunk[0][:2]).mkdir(exist_ok=True)
            (store / "chunks" / chunk[0][:2] / chunk[0]).write_bytes(stored)
    doc["format"] = "ckpt-archive/1"
    del doc["hash"]
    path.write_text(json.dumps(doc))
    restore(str(store), result.archive_id, str(tmp_path / "back"))
    same_tree(v1, tmp_path / "back")
    doc["hash"] = "blake3"
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="hash 'blake3' is not sha256 \\(what ckpt-archive/1 uses\\)"):
        restore(str(store), result.archive_id, str(tmp_path / "back2"))


@pytest.mark.parametrize(("field", "value", "said"), [
    ("name", "../escape", "is not a safe relative file name"),
    ("size", 5, "its chunks hold"),
    ("chunks", [["zz", 1, 1]], "lists a chunk that is not"),
])
def test_a_hostile_manifest_is_refused_in_one_line(tmp_path: Path, field: str, value: Any, said: str) -> None:
    v1, _ = _versions(tmp_path)
    store = tmp_path / "store"
    aid = archive(str(v1), str(store)).archive_id
    path = store / "manifests" / f"{aid}.json"
    doc = json.loads(path.read_text())
    doc["files"][0][field] = value
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError) as err:
        restore(str(store), aid, str(tmp_path / "out"))
    assert said in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(FormatError, match="is not an id"):
        restore(str(store), "../x", str(tmp_path / "out"))


def test_a_symlink_in_the_source_is_refused(tmp_path: Path) -> None:
    v1, _ = _versions(tmp_path)
    (v1 / "link").symlink_to("/etc/hostname")
    with pytest.raises(CkptError, match="symbolic link"):
        archive(str(v1), str(tmp_path / "store"))


def test_gc_deletes_only_what_no_manifest_references(tmp_path: Path) -> None:
    v1, v2 = _versions(tmp_path)
    store = tmp_path / "store"
    first, second = archive(str(v1), str(store)), archive(str(v2), str(store))
    assert gc(str(store)).deleted == []  # within the grace period
    assert gc(str(store), grace_s=0).deleted == []
    (store / "manifests" / f"{first.archive_id}.json").unlink()
    result = gc(str(store), grace_s=0)
    assert len(result.deleted) == first.new_chunks - (second.chunks - second.new_chunks) or result.deleted
    restore(str(store), second.archive_id, str(tmp_path / "out"))
    same_tree(v2, tmp_path / "out")
    (store / "pending").mkdir(exist_ok=True)
    (store / "pending" / "live.json").write_text("{}")  # an archive in progress: gc deletes nothing
    assert "in progress" in (gc(str(store), grace_s=0).skipped or "")
    os.utime(store / "pending" / "live.json", (0, 0))  # stale: an interrupted archive's marker
    assert gc(str(store), grace_s=0).stale_markers == ["pending/live.json"]


def test_gc_racing_archives_loses_nothing(tmp_path: Path) -> None:
    """Archives of 6 checkpoints on one thread, gc with no grace period in a loop on another, a deleted manifest
    making garbage all the time: every archive restores byte for byte afterwards."""
    torch.manual_seed(0)
    base = torch.randn(256, 256)
    sources = []
    for i in range(6):
        folder = tmp_path / f"s{i}"
        folder.mkdir()
        save_file({"base": base, "step": torch.full((64, 64), float(i))}, folder / "model.safetensors")
        sources.append(folder)
    store = str(tmp_path / "store")
    done = threading.Event()
    runs: list[int] = []
    failures: list[BaseException] = []

    def collect() -> None:
        try:
            while True:
                last = done.is_set()  # one more run after the archives ended: it finds the garbage for sure
                runs.append(len(gc(store, grace_s=0).deleted))
                if last:
                    break
        except BaseException as e:  # reported by the test below
            failures.append(e)

    thread = threading.Thread(target=collect)
    thread.start()
    try:
        ids = []
        for i, folder in enumerate(sources):
            ids.append(archive(str(folder), store).archive_id)
            junk = tmp_path / f"junk{i}"  # garbage for the gc to find: chunks whose manifest goes
            junk.mkdir()
            save_file({"noise": torch.randn(128, 128)}, junk / "model.safetensors")
            os.remove(os.path.join(store, "manifests", f"{archive(str(junk), store).archive_id}.json"))
    finally:
        done.set()
        thread.join()
    assert failures == [] and len(runs) > 1 and sum(runs) > 0  # it ran, and found garbage to delete
    for aid, folder in zip(ids, sources, strict=True):
        restore(store, aid, str(tmp_path / f"out-{aid}"))
        same_tree(folder, tmp_path / f"out-{aid}")


def test_gc_during_an_archive_deletes_nothing_and_an_archive_waits_for_a_running_gc(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both sides of the handshake, made to happen at the worst moment: a gc run while an archive has counted
    on chunks the store holds (and before its manifest exists), and an archive started while a gc runs."""
    v1, v2 = _versions(tmp_path)
    store = tmp_path / "store"
    first = archive(str(v1), str(store))
    (store / "manifests" / f"{first.archive_id}.json").unlink()  # v1's chunks are garbage now; v2 reuses most
    seen: list[Any] = []
    encode = codec.encode_parts

    def encode_and_collect(data: Any, itemsize: int) -> codec.Parts:
        if not seen:
            seen.append(gc(str(store), grace_s=0))
        return encode(data, itemsize)

    monkeypatch.setattr(codec, "encode_parts", encode_and_collect)
    second = archive(str(v2), str(store))
    assert seen[0].deleted == [] and "in progress" in seen[0].skipped
    restore(str(store), second.archive_id, str(tmp_path / "out"))
    same_tree(v2, tmp_path / "out")
    (store / "gc").mkdir(exist_ok=True)
    (store / "gc" / "running.json").write_text("{}")  # a gc that has not ended
    finished = threading.Event()
    thread = threading.Thread(target=lambda: (archive(str(v1), str(store)), finished.set()))
    thread.start()
    assert not finished.wait(0.5)  # the archive waits ...
    assert list((store / "pending").iterdir())  # ... with its marker up
    (store / "gc" / "running.json").unlink()
    thread.join(30)
    assert finished.is_set() and not list((store / "pending").iterdir())


# ---- framework series ---------------------------------------------------------------------------------------


def _llama(transformers: Any) -> Any:
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def _train_and_archive(tmp_path: Path, model: Any, steps: int, save: Any) -> tuple[str, list[Any], list[Path]]:
    """`steps` AdamW steps on random tokens, each saved by `save(folder, model, optimizer)` and archived."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    store = str(tmp_path / "store")
    results, folders = [], []
    for step in range(1, steps + 1):
        ids = torch.randint(0, 1024, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        folder = tmp_path / f"step{step}"
        save(folder, model, opt)
        results.append(archive(str(folder), store))
        folders.append(folder)
    for result, folder in zip(results, folders, strict=True):
        restore(store, result.archive_id, str(tmp_path / f"r-{result.archive_id}"))
        same_tree(folder, tmp_path / f"r-{result.archive_id}")
    return store, results, folders


def test_lora_series_archives_to_a_tenth_and_restores(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import peft.tuners.lora.torchao as peft_torchao

    peft_torchao.is_torchao_available = lambda: False  # type: ignore[assignment]  # as in tests/test_adapters.py
    torch.manual_seed(0)
    model = peft.get_peft_model(_llama(transformers),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    def save(folder: Path, model: Any, opt: Any) -> None:  # the adapter, the whole state dict, the optimizer
        model.save_pretrained(folder / "adapter")
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
        torch.save(opt.state_dict(), folder / "optimizer.pt")

    store, results, _ = _train_and_archive(tmp_path, model, 12, save)
    report = series_report("lora", results, store)
    assert report["ratio"] >= 10  # manifests included; the frozen base is stored once
    assert report["dedup_share"] > 0.8


def test_pretraining_series_restores_and_is_reported(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)

    def save(folder: Path, model: Any, opt: Any) -> None:  # every weight changes each step
        model.save_pretrained(folder)
        torch.save(opt.state_dict(), folder / "optimizer.pt")

    store, results, _ = _train_and_archive(tmp_path, _llama(transformers), 10, save)
    report = series_report("pretraining", results, store)
    assert report["ratio"] > 1.05  # compression of the exponent planes; dedup finds only the configs and headers
    assert report["compression_share"] > 0.5


@pytest.mark.slow  # 2 gloo ranks
def test_dcp_series_with_a_frozen_embedding_restores_and_loads(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    runs = tmp_path / "runs"
    runs.mkdir()
    proc = subprocess.run([sys.executable, "-m", "tests.test_archive", str(runs), "10"], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    store = str(tmp_path / "store")
    steps = sorted(runs.iterdir())
    results = [archive(str(step), store) for step in steps]
    series_report("dcp-fsdp2", results, store)
    assert all(r.dedup_saved > 0 for r in results[1:])  # the frozen embedding is stored once
    for result, step in zip(results, steps, strict=True):
        target = tmp_path / f"r-{step.name}"
        restore(store, result.archive_id, str(target))
        same_tree(step, target)
    last = steps[-1]
    dcp_to_torch_save(last, tmp_path / "orig.pt")
    dcp_to_torch_save(tmp_path / f"r-{last.name}", tmp_path / "back.pt")
    want, got = (torch.load(tmp_path / n, weights_only=True) for n in ("orig.pt", "back.pt"))
    flat_want = {k: v for k, v in _flat(want)}
    flat_got = {k: v for k, v in _flat(got)}
    assert flat_want.keys() == flat_got.keys() and len(flat_want) > 4
    for key, value in flat_want.items():
        assert type(value) is type(flat_got[key])
        assert torch.equal(value, flat_got[key]) if isinstance(value, torch.Tensor) else value == flat_got[key]


def _flat(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(tree, dict):
        return [kv for k, v in tree.items() for kv in _flat(v, f"{prefix}{k}.")]
    if isinstance(tree, list):
        return [kv for i, v in enumerate(tree) for kv in _flat(v, f"{prefix}{i}.")]
    return [(prefix.rstrip("."), tree)]
