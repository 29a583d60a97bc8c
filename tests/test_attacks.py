"""Hostile checkpoints of every class, for every reader, against the real `ckptctl` under resource limits.

Each case copies an honest checkpoint (built with torch.save / dcp.save / safetensors' save_file) and breaks it
the way an attacker would: names that leave the checkpoint, members that are FIFOs or /dev/zero, symlinks out of
the read roots, sizes and offsets that lie, headers of the wrong shape, truncation. Every command must answer
with exit code 2 and one line naming the file, in bounded time (30 s) and memory (1 GiB of address space),
create no target, write nothing anywhere, and import nothing the checkpoint names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from . import attack_kit as kit

ADDRESS_SPACE = 1 << 30  # a normal run of any command on these checkpoints needs < 0.5 GiB
TIMEOUT = 30
COMMANDS = ("inspect", "export", "convert", "verify", "reshard")


@dataclass(frozen=True)
class Attack:
    reader: str
    name: str
    breaker: Callable[[Path, Path], None]  # (checkpoint copy, case folder)
    expect: str  # the one-line error must contain this (the file, or the refused name)
    env: dict[str, str] = field(default_factory=dict)
    full: bool = False  # every command in the fast suite (a representative per class and reader); else `export`
    #                     (and `inspect` for truncations), the other commands marked slow
    secret: bool = False  # the error must not reveal the outside target's path or size

    @property
    def id(self) -> str:
        return f"{self.reader}-{self.name}"


def _dcp_folder(reader: str) -> str:
    return "pytorch_model_fsdp_0/" if reader == "accelerate" else ""


def _outside_copy(ckpt: Path, case: Path, rel: str) -> Path:
    """A real, readable copy of a member outside the checkpoint: what an escape would read."""
    target = case / "outside" / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ckpt / rel, target)
    return target


def _relpath_escape(name: str) -> Callable[[Path, Path], None]:
    def brk(ckpt: Path, case: Path) -> None:
        folder = ckpt / "pytorch_model_fsdp_0" if (ckpt / "pytorch_model_fsdp_0").exists() else ckpt
        shutil.copy(folder / "__0_0.distcp", case / "outside.distcp")
        (case / "outside").mkdir(exist_ok=True)
        shutil.move(case / "outside.distcp", case / "outside" / "__0_0.distcp")
        up = "../" * len(folder.relative_to(case).parts)
        kit.edit_dcp_metadata(folder, kit.set_storage("relative_path", name.replace("UP/", up)))
    return brk


def _weight_map_escape(name: str) -> Callable[[Path, Path], None]:
    def brk(ckpt: Path, case: Path) -> None:
        index = next(ckpt.glob("*.index.json"))
        doc = json.loads(index.read_text())
        first = sorted(set(doc["weight_map"].values()))[0]
        _outside_copy(ckpt, case, first)
        doc["weight_map"] = {k: name.replace("FILE", first) if v == first else v for k, v in doc["weight_map"].items()}
        index.write_text(json.dumps(doc))
    return brk


def _roots_symlink(rel: str) -> Callable[[Path, Path], None]:
    """Member `rel` becomes a symlink to a copy outside the checkpoint; the read roots hold only the checkpoint."""
    def brk(ckpt: Path, case: Path) -> None:
        target = _outside_copy(ckpt, case, rel)
        kit.replace_with_link(ckpt / rel, target)
    return brk


def _dir_symlink(rel: str) -> Callable[[Path, Path], None]:
    def brk(ckpt: Path, case: Path) -> None:
        shutil.copytree(ckpt / rel, case / "outside" / rel)
        shutil.rmtree(ckpt / rel)
        (ckpt / rel).symlink_to(case / "outside" / rel)
    return brk


def _on(rel: Callable[[Path], Path] | str, action: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    def brk(ckpt: Path, case: Path) -> None:
        action(ckpt / rel if isinstance(rel, str) else rel(ckpt))
    return brk


def _header(rel: str, edit: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    return _on(rel, lambda p: kit.edit_header(p, edit))


def _entry(edit: Callable[[dict], object]) -> Callable[[dict], None]:
    def apply(header: dict) -> None:
        edit(header[kit.first_tensor(header)])
    return apply


def _length(value: int) -> Callable[[Path], None]:
    def act(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[:8] = value.to_bytes(8, "little")
        path.write_bytes(bytes(raw))
    return act


def _canary_pickle(ckpt: Path, case: Path) -> None:
    """rank0.pt names a module `ckpt_canary` that exists on the subprocess's sys.path and would leave a marker."""
    fake = types.ModuleType("ckpt_canary")

    def boom() -> None: ...

    boom.__module__, boom.__qualname__ = "ckpt_canary", "boom"
    fake.boom = boom  # type: ignore[attr-defined]

    class Payload:
        def __reduce__(self) -> tuple:
            return (boom, ())

    sys.modules["ckpt_canary"] = fake
    try:
        torch.save({"w": torch.ones(2), "x": Payload()}, ckpt / "rank0.pt")
    finally:
        del sys.modules["ckpt_canary"]


def _sharding(value: object) -> Callable[[dict], None]:
    def edit(header: dict) -> None:
        header["__metadata__"]["DCP_SHARDING_INFO"] = value if isinstance(value, str) else json.dumps(value)
    return edit


def _overlapping_chunks(offset: int) -> Callable[[Any], None]:
    """`w` [6, 4] becomes rows [0, 6) and [offset, offset + 6) of a [12, 4] tensor, both backed by its one record:
    the sizes add up (48 elements), but rows overlap and others are covered by nothing."""
    def edit(md: Any) -> None:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

        fqn = next(k for k in md.state_dict_metadata if k.endswith("w"))
        meta = md.state_dict_metadata[fqn]
        meta.size = torch.Size([12, 4])
        meta.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([6, 4])),
                       ChunkStorageMetadata(torch.Size([offset, 0]), torch.Size([6, 4]))]
        info = md.storage_data[MetadataIndex(fqn, torch.Size([0, 0]))]
        md.storage_data[MetadataIndex(fqn, torch.Size([offset, 0]))] = info
    return edit


def _rename_dcp_entry(new: str) -> Callable[[Any], None]:
    """Entry `b` of a DCP checkpoint is renamed `new` in both tables of `.metadata`."""
    def edit(md: Any) -> None:
        md.state_dict_metadata[new] = md.state_dict_metadata.pop("b")
        for key in [k for k in md.storage_data if k.fqn == "b"]:
            md.storage_data[dataclasses.replace(key, fqn=new)] = md.storage_data.pop(key)
    return edit


def _torch_save(rel: str, state: Callable[[], dict]) -> Callable[[Path, Path], None]:
    def brk(ckpt: Path, case: Path) -> None:
        torch.save(state(), ckpt / rel)
    return brk


def _json_doc(rel: str, edit: Callable[[dict], object]) -> Callable[[Path, Path], None]:
    def brk(ckpt: Path, case: Path) -> None:
        doc = json.loads((ckpt / rel).read_text())
        result = edit(doc)
        (ckpt / rel).write_text(json.dumps(doc if result is None else result))
    return brk


def _raw_header(text: str) -> bytes:
    return len(text).to_bytes(8, "little") + text.encode()


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


NOT_TEXT = "not valid UTF-8 text"
COLLIDE = "both flatten to the name"


ROOTS = {"CKPT_CONFINE_READS": "{ckpt}"}


def _attacks() -> list[Attack]:
    out: list[Attack] = []
    for reader in ("dcp", "accelerate"):
        d = _dcp_folder(reader)
        out += [
            Attack(reader, "relpath-dotdot", _relpath_escape("UP/outside/__0_0.distcp"), "outside/__0_0.distcp",
                   full=True, secret=True),
            Attack(reader, "relpath-etc-passwd", _relpath_escape("../../../../etc/passwd"), "etc/passwd"),
            Attack(reader, "relpath-absolute", _relpath_escape("/etc/passwd"), "absolute"),
            Attack(reader, "relpath-urlencoded", _relpath_escape("%2e%2e/%2e%2e/outside/__0_0.distcp"),
                   "percent-escapes"),
            Attack(reader, "relpath-backslash", _relpath_escape("..\\..\\outside\\__0_0.distcp"), "backslash"),
            Attack(reader, "relpath-fullwidth", _relpath_escape("\uff0e\uff0e/\uff0e\uff0e/outside/__0_0.distcp"),
                   "'..'"),
            Attack(reader, "relpath-uri", _relpath_escape("file:///etc/passwd"), "absolute"),
            Attack(reader, "metadata-fifo", _on(f"{d}.metadata", kit.replace_with_fifo), ".metadata", full=True),
            Attack(reader, "metadata-devzero", _on(f"{d}.metadata", lambda p: kit.replace_with_link(p, "/dev/zero")),
                   ".metadata", full=True),
            Attack(reader, "distcp-fifo", _on(f"{d}__0_0.distcp", kit.replace_with_fifo), "__0_0.distcp"),
            Attack(reader, "distcp-devzero", _on(f"{d}__0_0.distcp", lambda p: kit.replace_with_link(p, "/dev/zero")),
                   "__0_0.distcp"),
            Attack(reader, "roots-symlink", _roots_symlink(f"{d}__0_0.distcp"), "__0_0.distcp", env=ROOTS,
                   full=True, secret=True),
        ]
    out += [
        Attack("dcp", "negative-length", lambda c, _: kit.edit_dcp_metadata(c, kit.set_storage("length", -5, "w")),
               ".metadata", full=True),
        Attack("dcp", "negative-offset", lambda c, _: kit.edit_dcp_metadata(c, kit.set_storage("offset", -1, "b")),
               ".metadata"),
        Attack("dcp", "huge-length", lambda c, _: kit.edit_dcp_metadata(c, kit.set_storage("length", 1 << 40, "w")),
               "__0_0.distcp"),
        Attack("dcp", "truncated-distcp", _on("__0_0.distcp", kit.truncate), "__0_0.distcp", full=True),
        Attack("accelerate", "truncated-distcp", _on("pytorch_model_fsdp_0/__0_0.distcp", kit.truncate),
               "__0_0.distcp"),
        Attack("dcp", "truncated-metadata", _on(".metadata", kit.truncate), ".metadata"),
        Attack("dcp", "oversize-metadata", lambda c, _: None, ".metadata", env={"CKPT_MAX_METADATA_BYTES": "300"},
               full=True),
        Attack("accelerate", "roots-dir-symlink", _dir_symlink("pytorch_model_fsdp_0"), "pytorch_model_fsdp_0",
               env=ROOTS, secret=True),
    ]
    for reader, rel in (("rank-files", "rank0.pt"), ("torch", "model.pt"),
                        ("torch-index", "pytorch_model-00001-of-00002.bin")):
        out += [
            Attack(reader, "fifo", _on(rel, kit.replace_with_fifo), rel, full=reader == "torch"),
            Attack(reader, "devzero", _on(rel, lambda p: kit.replace_with_link(p, "/dev/zero")), rel),
            Attack(reader, "truncated", _on(rel, kit.truncate), rel, full=reader == "rank-files"),
            Attack(reader, "zip-dir-4gib", _on(rel, kit.zip_directory_claim), rel, full=True),
            Attack(reader, "zip64-dir-4gib", _on(rel, lambda p: kit.zip_directory_claim(p, zip64=True)), rel),
            Attack(reader, "zip-deflated", _on(rel, kit.deflate_zip), "compressed"),
            Attack(reader, "roots-symlink", _roots_symlink(rel), rel, env=ROOTS, secret=True),
        ]
    out.append(Attack("rank-files", "canary-import", _canary_pickle, "ckpt_canary", full=True))
    for reader, index in (("torch-index", "pytorch_model.bin.index.json"),
                          ("safetensors-sharded", "model.safetensors.index.json")):
        out += [
            Attack(reader, "weight-map-dotdot", _weight_map_escape("../outside/FILE"), "../outside/", full=True,
                   secret=True),
            Attack(reader, "weight-map-absolute", _weight_map_escape("/etc/passwd"), "absolute"),
            Attack(reader, "weight-map-urlencoded", _weight_map_escape("%2E%2E/outside/FILE"), "percent-escapes"),
            Attack(reader, "weight-map-nested-dotdot", _weight_map_escape("sub/../../outside/FILE"), "'..'"),
            Attack(reader, "index-not-json", _on(index, lambda p: p.write_text("{weight_map: nope")), index,
                   full=True),
            Attack(reader, "index-weight-map-list", _on(index, lambda p: p.write_text('{"weight_map": ["a"]}')),
                   index),
            Attack(reader, "index-weight-map-ints", _on(index, lambda p: p.write_text('{"weight_map": {"w": 1}}')),
                   index),
            Attack(reader, "index-devzero", _on(index, lambda p: kit.replace_with_link(p, "/dev/zero")), index,
                   full=True),
            Attack(reader, "index-fifo", _on(index, kit.replace_with_fifo), index),
        ]
    st = "model.safetensors"
    out += [
        Attack("safetensors", "fifo", _on(st, kit.replace_with_fifo), st, full=True),
        Attack("safetensors", "devzero", _on(st, lambda p: kit.replace_with_link(p, "/dev/zero")), st),
        Attack("safetensors", "negative-shape", _header(st, _entry(lambda e: e.update(shape=[-6, -4]))), st,
               full=True),
        Attack("safetensors", "reversed-offsets", _header(st, _entry(lambda e: e.update(
            data_offsets=e["data_offsets"][::-1]))), st, full=True),
        Attack("safetensors", "overlapping-offsets", _header(st, lambda h: h["b"].update(
            data_offsets=[h["w"]["data_offsets"][0] + 4, h["w"]["data_offsets"][0] + 24])), "overlap", full=True),
        Attack("safetensors", "offsets-past-end", _header(st, lambda h: h["b"].update(
            data_offsets=[10 ** 9, 10 ** 9 + 20])), st),
        Attack("safetensors", "header-list", _header(st, lambda h: [1, 2]), st, full=True),
        Attack("safetensors", "entry-not-dict", _header(st, lambda h: h.update(w=[1, 2])), "'w'"),
        Attack("safetensors", "entry-no-shape", _header(st, _entry(lambda e: e.pop("shape"))), "shape"),
        Attack("safetensors", "shape-strings", _header(st, _entry(lambda e: e.update(shape=["6", "4"]))), "shape"),
        Attack("safetensors", "bad-dtype", _header(st, _entry(lambda e: e.update(dtype="X99"))), "dtype"),
        Attack("safetensors", "metadata-not-dict", _header(st, lambda h: h.update(__metadata__=[1])), "__metadata__"),
        Attack("safetensors", "header-length-huge", _on(st, _length(1 << 40)), st),
        Attack("safetensors", "header-length-past-end", _on(st, _length(10 ** 6)), st, full=True),
        Attack("safetensors", "truncated", _on(st, kit.truncate), st, full=True),
        Attack("safetensors", "roots-symlink", _roots_symlink(st), st, env=ROOTS, secret=True),
        Attack("safetensors-sharded", "shard-fifo", _on("model-00002-of-00002.safetensors", kit.replace_with_fifo),
               "model-00002-of-00002.safetensors"),
        Attack("safetensors-sharded", "shard-truncated", _on("model-00002-of-00002.safetensors", kit.truncate),
               "model-00002-of-00002.safetensors"),
    ]
    pick = partial(kit.data_file, reader="hf-dcp")  # hf-dcp shards are found by pattern
    out += [
        Attack("hf-dcp", "sharding-not-json", _on(pick, lambda p: kit.edit_header(p, _sharding("{not json"))),
               "DCP_SHARDING_INFO", full=True),
        Attack("hf-dcp", "sharding-list", _on(pick, lambda p: kit.edit_header(p, _sharding([1, 2]))),
               "DCP_SHARDING_INFO"),
        Attack("hf-dcp", "sharding-negative", _on(pick, lambda p: kit.edit_header(p, _sharding(
            {"w": {"saved_offsets": [-1, 0]}, "b": {"saved_offsets": [0]}, "e": {"saved_offsets": [0, 0]}}))),
               "saved_offsets"),
        Attack("hf-dcp", "sharding-wrong-rank", _on(pick, lambda p: kit.edit_header(p, _sharding(
            {"w": {"saved_offsets": [0]}, "b": {"saved_offsets": [0]}, "e": {"saved_offsets": [0, 0]}}))),
               "saved_offsets"),
        Attack("hf-dcp", "truncated", _on(pick, kit.truncate), "shard-00001"),
    ]
    out += _name_attacks()
    return out


def _name_attacks() -> list[Attack]:
    """Names that are not valid text, JSON nested without end, colliding keys and chunks that overlap: each was
    accepted (exit 0, wrong or unreadable output) or a traceback before the readers refused them."""
    st, ti = "model.safetensors", "pytorch_model.bin.index.json"
    w = torch.ones(2)
    return [
        Attack("dcp", "overlapping-chunks", lambda c, _: kit.edit_dcp_metadata(c, _overlapping_chunks(3)), "overlap",
               full=True),
        Attack("accelerate", "overlapping-chunks", lambda c, _: kit.edit_dcp_metadata(
            c / "pytorch_model_fsdp_0", _overlapping_chunks(5)), "overlap"),
        Attack("dcp", "relpath-surrogate", _relpath_escape("\ud800.distcp"), "lone surrogates", full=True),
        Attack("torch-index", "weight-map-surrogate", _weight_map_escape("\udc80FILE"), NOT_TEXT),
        Attack("safetensors-sharded", "weight-map-surrogate", _weight_map_escape("FILE\ud800"), NOT_TEXT),
        Attack("dcp", "surrogate-name", lambda c, _: kit.edit_dcp_metadata(c, _rename_dcp_entry("b\ud800")), NOT_TEXT,
               full=True),
        Attack("safetensors", "surrogate-name", _header(st, lambda h: h.update({"w\ud800": h.pop("w")})), NOT_TEXT,
               full=True),
        Attack("safetensors", "surrogate-metadata", _header(st, lambda h: h.update(__metadata__={"x": "\udc80"})),
               NOT_TEXT),
        Attack("safetensors", "header-deep", _on(st, lambda p: p.write_bytes(_raw_header(
            '{"__metadata__": ' + _deep(900) + "}"))), "nested", full=True),
        Attack("safetensors", "header-deeper", _on(st, lambda p: p.write_bytes(_raw_header(_deep(100_000)))),
               "nested"),
        Attack("safetensors-sharded", "index-deep", _json_doc("model.safetensors.index.json", lambda d: d.update(
            metadata=json.loads(_deep(200)))), "model.safetensors.index.json", full=True),
        Attack("torch-index", "surrogate-weight-map", _json_doc(ti, lambda d: d["weight_map"].update(
            {"\ud800": d["weight_map"]["w"]})), ti),
        Attack("torch-index", "name-in-two-shards", _torch_save("pytorch_model-00002-of-00002.bin", lambda: {
            "w": torch.zeros(6, 4), "b": torch.zeros(5), "e": torch.zeros(3, 2)}), "also in another part"),
        Attack("hf-dcp", "sharding-deep", _on(partial(kit.data_file, reader="hf-dcp"), lambda p: kit.edit_header(
            p, _sharding(_deep(100_000)))), "DCP_SHARDING_INFO"),
        Attack("torch", "surrogate-name", _torch_save("model.pt", lambda: {"w\ud800": w}), NOT_TEXT, full=True),
        Attack("torch", "surrogate-value", _torch_save("model.pt", lambda: {"w": w, "note": "\udc80"}), NOT_TEXT),
        Attack("torch", "colliding-int-key", _torch_save("model.pt", lambda: {1: w, "1": w * 2}), COLLIDE,
               full=True),
        Attack("torch", "colliding-dotted-key", _torch_save("model.pt", lambda: {"a.b": w, "a": {"b": w * 2}}),
               COLLIDE),
        Attack("torch", "colliding-nan-keys", _torch_save("model.pt", lambda: {float("nan"): w,
                                                                              float("nan"): w * 2}), COLLIDE),
        Attack("rank-files", "colliding-int-key", _torch_save("rank0.pt", lambda: {0: w, "0": w}), "rank0.pt"),
    ]


ATTACKS = _attacks()


def _params() -> list:
    params = []
    for attack in ATTACKS:  # through the real CLI in subprocesses: the full suite (the fast layer runs
        #                     every attack in-process, below)
        first = COMMANDS if attack.full else ("inspect", "export") if "truncated" in attack.name else ("export",)
        params.append(pytest.param(attack, first, id=attack.id, marks=pytest.mark.slow))
        rest = tuple(c for c in COMMANDS if c not in first)
        if rest:
            params.append(pytest.param(attack, rest, id=f"{attack.id}-rest", marks=pytest.mark.slow))
    return params


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return kit.build_bases(tmp_path_factory.mktemp("bases"))


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    resource.setrlimit(resource.RLIMIT_CPU, (TIMEOUT, TIMEOUT))


def run_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real `ckptctl` in a subprocess, under 1 GiB of address space and a 30 s limit."""
    return subprocess.run([sys.executable, "-m", "ckptctl", *args], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200", **(env or {})}, timeout=TIMEOUT,
                          preexec_fn=_limits)


def _snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


def _args(command: str, source: Path, out: Path, base: Path) -> list[str]:
    return {"inspect": ["inspect", str(source)],
            "export": ["export", str(source), str(out / "export")],
            "convert": ["convert", str(source), str(out / "converted.pt"), "--to", "torch"],
            "verify": ["verify", str(source), str(base)],
            "reshard": ["reshard", str(source), str(out / "resharded"), "--world-size", "2"]}[command]


@pytest.mark.parametrize(("attack", "commands"), _params())
def test_attack_is_refused(attack: Attack, commands: tuple[str, ...], bases: dict[str, Path],
                           tmp_path: Path) -> None:
    ckpt = kit.copy_base(bases[attack.reader], tmp_path / "ckpt")
    (tmp_path / "out").mkdir()
    canary = tmp_path / "canary"
    canary.mkdir()
    marker = tmp_path / "imported"
    (canary / "ckpt_canary.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef boom(): pass\n")
    attack.breaker(ckpt, tmp_path)
    env = {k: v.format(ckpt=ckpt) for k, v in attack.env.items()}
    env["PYTHONPATH"] = os.pathsep.join([str(canary), os.environ.get("PYTHONPATH", "")])
    outside = tmp_path / "outside"
    secrets = [str(outside)] + [f"{p.stat().st_size} bytes" for p in outside.rglob("*") if p.is_file()]
    before = _snapshot(tmp_path)
    for command in commands:
        proc = run_cli(_args(command, ckpt, tmp_path / "out", bases[attack.reader]), env)
        said = f"{command}: exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
        assert proc.returncode == 2, said
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), said
        assert attack.expect in lines[0], said
        if attack.secret:
            assert not any(s in proc.stderr for s in secrets), said
        assert _snapshot(tmp_path) == before, f"{command} left something behind"
        assert not marker.exists(), f"{command} imported a module the checkpoint names"


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.id for a in ATTACKS])
def test_attack_is_refused_in_process(attack: Attack, bases: dict[str, Path], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast layer's run of each attack: the offline export's engine call, in this process, raises one
    CkptError line naming the file, writes nothing and imports nothing."""
    from ckpt_service.executor import engine_call
    from ckpt_service.job_requests import build
    from converters.config import EngineConfig, use
    from converters.errors import CkptError

    ckpt = kit.copy_base(bases[attack.reader], tmp_path / "ckpt")
    (tmp_path / "out").mkdir()
    attack.breaker(ckpt, tmp_path)
    env = {key: value.format(ckpt=ckpt) for key, value in attack.env.items()}
    for key, value in env.items():  # storage reads its two variables itself until it reads the config
        monkeypatch.setenv(key, value)
    before = _snapshot(tmp_path)
    with use(EngineConfig.from_env(env)), pytest.raises(CkptError) as caught:
        engine_call(build("export", {}), str(ckpt), str(tmp_path / "out" / "export"))(None)
    message = str(caught.value)
    assert attack.expect in message and "\n" not in message, message
    if attack.secret:
        outside = tmp_path / "outside"
        assert str(outside) not in message and not any(f"{p.stat().st_size} bytes" in message
                                                       for p in outside.rglob("*") if p.is_file()), message
    assert _snapshot(tmp_path) == before
    assert "ckpt_canary" not in sys.modules


def test_every_reader_and_class_is_attacked() -> None:
    """The matrix covers each reader, and each reader meets escapes or roots, non-regular files and damage."""
    readers = {a.reader for a in ATTACKS}
    assert readers == set(kit.READERS)
    for reader in readers:
        names = {a.name for a in ATTACKS if a.reader == reader}
        assert any("truncated" in n or "sharding" in n for n in names), reader
        if reader != "hf-dcp":
            assert any(n.startswith(("relpath", "weight-map", "roots")) for n in names), reader
            assert any("fifo" in n for n in names), reader


def test_symlinked_members_are_followed_offline(bases: dict[str, Path], tmp_path: Path) -> None:
    """Hugging Face cache snapshots are symlinks into blobs/: offline, with no read roots, they are read."""
    ckpt = kit.copy_base(bases["safetensors-sharded"], tmp_path / "snapshot")
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for path in list(ckpt.iterdir()):
        blob = blobs / f"blob-{path.name}"
        shutil.move(path, blob)
        path.symlink_to(blob)
    proc = run_cli(["export", str(ckpt), str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file

    got = load_file(tmp_path / "out" / "model.safetensors")
    want = kit.reference(bases["safetensors-sharded"])
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    # the same snapshot inside the read roots (blobs included) is read too; roots without blobs/ are not
    proc = run_cli(["inspect", str(ckpt)], {"CKPT_CONFINE_READS": json.dumps(["s3://bucket/x", str(tmp_path)])})
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(["inspect", str(ckpt)], {"CKPT_CONFINE_READS": str(ckpt)})
    assert proc.returncode == 2 and "model.safetensors.index.json" in proc.stderr and "roots" in proc.stderr


def test_big_metadata_is_read_when_the_cap_allows(bases: dict[str, Path]) -> None:
    """The size cap is a setting: the same .metadata refused under a 300-byte cap is read under the default."""
    proc = run_cli(["inspect", str(bases["dcp"])])
    assert proc.returncode == 0 and "dcp" in proc.stdout, proc.stderr
    proc = run_cli(["inspect", str(bases["dcp"])], {"CKPT_MAX_METADATA_BYTES": "300"})
    assert proc.returncode == 2 and "CKPT_MAX_METADATA_BYTES" in proc.stderr


def test_pickled_metadata_is_unchanged_by_edits(bases: dict[str, Path], tmp_path: Path) -> None:
    """The breaking tools themselves are honest: a no-op edit leaves a checkpoint that still exports."""
    ckpt = kit.copy_base(bases["dcp"], tmp_path / "ckpt")
    kit.edit_dcp_metadata(ckpt, lambda md: None)
    proc = run_cli(["export", str(ckpt), str(tmp_path / "out")])
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ["../x", "a/../../x", "/etc/passwd", "C:/x", "file:///etc/passwd", "s3://b/k",
                                  "%2e%2e/x", "a%2Fb", "..\\x", "a\\b", "\uff0e\uff0e/x", "a/\uff0f/b", "./x", "a//b",
                                  "", "a/", "x\x00y", "\n"])
def test_member_names_that_leave_the_folder_are_refused(name: str) -> None:
    from converters import storage
    from converters.errors import FormatError

    with pytest.raises(FormatError, match=r"not read|not a file name"):
        storage.member("s3://bucket/ckpt", name, "s3://bucket/ckpt/.metadata")


def test_member_names_inside_the_folder_are_joined() -> None:
    from converters import storage

    assert storage.member("s3://bucket/ckpt", "__0_0.distcp", "m") == "s3://bucket/ckpt/__0_0.distcp"
    assert storage.member("/data/ckpt", "sub/model-1.safetensors", "m") == "/data/ckpt/sub/model-1.safetensors"
    assert storage.member("/data/ckpt", "..a..b", "m") == "/data/ckpt/..a..b"


def test_whole_file_reads_stop_at_the_cap_even_when_the_size_lies(tmp_path: Path) -> None:
    """/proc files report size 0 but hold more: the read stops at cap + 1 bytes and refuses."""
    from converters import storage
    from converters.errors import FormatError

    with pytest.raises(FormatError, match="100-byte limit"):
        storage.read_all("/proc/self/maps", cap=100)
    (tmp_path / "small.json").write_text("{}")
    assert storage.read_all(str(tmp_path / "small.json"), cap=2) == b"{}"
    with pytest.raises(FormatError, match="1-byte limit"):
        storage.read_all(str(tmp_path / "small.json"), cap=1)


def test_confine_reads_in_process(bases: dict[str, Path], tmp_path: Path) -> None:
    """The service's hook: an engine config with read roots (installed by the service's processes) refuses a
    member whose real path leaves the roots."""
    from converters import operations
    from converters.config import EngineConfig, use
    from converters.errors import SourceError

    ckpt = kit.copy_base(bases["safetensors"], tmp_path / "ckpt")
    outside = tmp_path / "elsewhere" / "model.safetensors"
    outside.parent.mkdir()
    shutil.move(ckpt / "model.safetensors", outside)
    (ckpt / "model.safetensors").symlink_to(outside)
    with use(EngineConfig(read_roots=(str(ckpt),))), pytest.raises(SourceError, match="outside the storage roots") \
            as info:
        operations.inspect(str(ckpt))
    assert str(outside) not in str(info.value) and "ckpt/model.safetensors" in str(info.value)
    with use(EngineConfig(read_roots=(str(tmp_path),))):
        assert sorted(operations.inspect(str(ckpt)).tensors) == ["b", "e", "w"]
    assert sorted(operations.inspect(str(ckpt)).tensors) == ["b", "e", "w"]


@pytest.mark.slow
@pytest.mark.parametrize(("latest", "metadata", "expect"), [
    (None, _deep(100_000), "metadata.json: the JSON document is nested more than 64 levels deep"),
    (None, '{"a": ' * 100_000 + "1" + "}" * 100_000, "metadata.json: the JSON document is nested"),
    (None, '{"sharded_backend": "torch_dist", "x": "\\ud800"}', "metadata.json: the JSON document holds a string "
                                                                "that is not valid UTF-8 text"),
    ("\u00b2", None, "latest_checkpointed_iteration.txt: does not hold 'release' or an iteration number"),
    ("9" * 5000, None, "latest_checkpointed_iteration.txt: 5000 bytes, but it should hold"),
    ("1" + "\u0661", None, "latest_checkpointed_iteration.txt: does not hold"),
], ids=["metadata-deep-lists", "metadata-deep-objects", "metadata-surrogate", "latest-superscript",
        "latest-5000-digits", "latest-arabic-digit"])
def test_megatron_fields_are_refused(bases: dict[str, Path], tmp_path: Path, latest: str | None,
                                     metadata: str | None, expect: str) -> None:
    """A Megatron-shaped folder whose metadata.json or latest_checkpointed_iteration.txt is hostile: one line
    naming the file, exit 2, nothing written (was a RecursionError / ValueError traceback)."""
    run = tmp_path / "run"
    folder = run / "iter_0000001"
    shutil.copytree(bases["dcp"], folder)
    (folder / "metadata.json").write_text(metadata or '{"sharded_backend": "torch_dist"}')
    if latest is not None:
        (run / "latest_checkpointed_iteration.txt").write_text(latest)
    before = _snapshot(tmp_path)
    for command in ("inspect", "export"):
        proc = run_cli(_args(command, run if latest is not None else folder, tmp_path, bases["dcp"]))
        said = f"{command}: exit {proc.returncode}\nstderr: {proc.stderr}"
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expect in lines[0], said
        assert (latest or "\u00b2") not in lines[0] and "9999" not in lines[0], said  # never quotes the file
        assert _snapshot(tmp_path) == before, f"{command} left something behind"


def _entry_of(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Any:
    from converters.index import ByteRange, Chunk, TensorEntry

    return TensorEntry("t", "float32", shape, [Chunk(o, s, ByteRange("f", 0, 0)) for o, s in boxes])


def _covers_once(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    seen = torch.zeros(shape, dtype=torch.int32)
    for offsets, sizes in boxes:
        seen[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    return bool((seen == 1).all())


def test_chunks_must_tile_exactly_in_any_number_of_dims() -> None:
    """The tiling check agrees with counting every element, on random cuts of 1-, 2- and 3-D tensors, moved or
    not; one box moved keeps the total size but overlaps another."""
    import itertools
    import random

    from converters.errors import FormatError
    from converters.index import check_tiling

    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        cuts = [sorted({0, dim, *rng.sample(range(1, dim + 1), rng.randint(0, dim - 1) if dim > 1 else 0)})
                for dim in shape]
        boxes = [((), ())]
        for cut in cuts:
            boxes = [((*o, a), (*s, b - a)) for o, s in boxes for a, b in itertools.pairwise(cut)]
        if rng.random() < 0.5 and len(boxes) > 1:
            i, d = rng.randrange(len(boxes)), rng.randrange(len(shape))
            offsets, sizes = boxes[i]
            room = shape[d] - sizes[d]
            boxes[i] = (tuple(rng.randint(0, room) if k == d else o for k, o in enumerate(offsets)), sizes)
        entry = _entry_of(shape, boxes)
        if _covers_once(shape, boxes):
            check_tiling(entry, "m")
        else:
            with pytest.raises(FormatError, match="overlap"):
                check_tiling(entry, "m")


def test_tiling_check_of_many_chunks_is_fast() -> None:
    """200,000 chunks of a 2-D tensor (and one overlap among them) are checked in linear time: about a second each
    here, where a pairwise check would take hours."""
    import time

    from converters.errors import FormatError
    from converters.index import check_tiling

    boxes = [((r, c * 4), (1, 4)) for r in range(2000) for c in range(100)]
    start = time.process_time()  # CPU time: a loaded machine does not make a linear check look quadratic
    check_tiling(_entry_of((2000, 400), boxes), "m")
    boxes[-1], boxes[-2] = ((1999, 394), (1, 4)), ((1999, 392), (1, 4))
    with pytest.raises(FormatError, match="overlap"):
        check_tiling(_entry_of((2000, 400), boxes), "m")
    assert time.process_time() - start < 10


@pytest.mark.parametrize("error", [RecursionError, MemoryError, ValueError("b'\\x00SECRET'"), UnicodeDecodeError(
    "utf-8", b"SECRET", 0, 1, "bad"), KeyError("SECRET"), IndexError, TypeError, AttributeError, OverflowError,
                                   __import__("struct").error("SECRET")])
def test_any_exception_at_a_readers_boundary_is_one_format_error(error: BaseException, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a reader raises that is not a CkptError becomes one FormatError line naming the checkpoint, without
    the exception's own text (it may quote the file); CkptErrors and OSErrors pass through as they are."""
    from converters import formats
    from converters.errors import FormatError, OptionError
    from converters.formats.base import BaseReader

    class Boom(BaseReader):
        def read(self, locate: bool = True) -> Any:
            raise error

    monkeypatch.setitem(formats.FORMATS, "boom", formats.FormatSpec("boom", Boom))
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FormatError) as caught:
        formats.load_index(str(tmp_path / "ckpt"), "boom")
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'ckpt'}: ") and "\n" not in message and "SECRET" not in message
    assert caught.value.uri == str(tmp_path / "ckpt")
    for passed in (OptionError("x"), FileNotFoundError(2, "gone")):
        error = passed
        with pytest.raises(type(passed)):
            formats.load_index(str(tmp_path / "ckpt"), "boom")
