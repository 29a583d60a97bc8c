"""Benchmark ckpt-service conversions against `cp -r` and the PyTorch/Accelerate tools (issue 6).

    python benchmarks/bench_convert.py --size 3GB --repeats 3 --out bench-out/results.json

Makes (or reuses, cached under --work-dir) a real FSDP2 DCP checkpoint of the model alone, fp32, world
size 4, plus the same state written by HuggingFaceStorageWriter, with the project's sample generator. Each
case runs as its own process, --repeats times, interleaved (repeat 1 of every case, then repeat 2, ...);
wall time covers process start to exit plus `sync`; peak RSS is read from /proc every 20 ms over the whole
process tree (the larger of the summed VmRSS and the largest single VmHWM). Every output is compared with the
source tensor by tensor (all tensors for small checkpoints, a deterministic sample above --check-budget);
a wrong output marks its row FAILED. Prints a table and writes it as JSON with the targets of issue 6.

This round's writers have rows of their own, each against `cp -r` of its own input (``Case.floor``) and, with
--peers, against the tool a user would otherwise run (``Case.peer``): `export --to-hf auto` of a Megatron MoE
(Mixtral) checkpoint (no peer runs without a GPU), `--gguf f16` and `--quantize fp8-block` of a Llama DCP
checkpoint (peers: our export to HF, then llama.cpp's convert_hf_to_gguf.py or llm-compressor's oneshot),
`--merge-adapter` of a rank-64 LoRA (also against the plain export of its base; peer: PEFT's merge_and_unload),
`archive` and `restore` of the FSDP2 sample. Their inputs, peers and checks are in bench_writers.py.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import struct
import subprocess
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata as importlib_metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZE = 4
RESHARD_WORLD_SIZE = 3
DCP_PEERS = ("dcp_to_torch", "accelerate", "dcp-save_file")  # peers that read the same DCP input as ours
OURS_CONVERSIONS = ("export", "export-bf16", "convert-safetensors", "convert-torch", "reshard")


# --- cases -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One command to time: ``argv(src, out)`` runs it; ``check`` says how its output is verified."""

    name: str
    kind: str  # "floor", "ours" or "peer"
    source: str  # "dcp" or "hf-dcp": which sample it reads
    check: str  # "dcp", "dcp-ws3", "safetensors", "safetensors-bf16", "torch" or "inspect"
    out_name: str  # the output path inside the run folder
    argv: Callable[[Path, Path], list[str]]
    needs: str | None = None  # a module that must be importable, else the case is skipped
    floor: str = "cp"  # the `cp -r` case of the same input (its ratio's denominator)
    peer: str | None = None  # ours: the case of the tool a user would otherwise run on the same input
    plain: str | None = None  # ours: the plain export it is held against (merged adapters)
    slow: bool = False  # a slow peer: run only when named in --cases or with --peers


def _tool(name: str, module: str) -> list[str]:
    """The console script installed beside this interpreter, else ``python -m module``."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def _ckptctl(*args: str) -> list[str]:
    return [*_tool("ckptctl", "ckptctl"), *args]


def _peer(name: str, src: Path, out: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--peer", name, str(src), str(out)]


CASES: tuple[Case, ...] = (
    Case("cp", "floor", "dcp", "dcp", "copy", lambda s, o: ["cp", "-r", str(s), str(o)]),
    Case("export", "ours", "dcp", "safetensors", "export", lambda s, o: _ckptctl("export", str(s), str(o), "-q")),
    Case("export-bf16", "ours", "dcp", "safetensors-bf16", "export",
         lambda s, o: _ckptctl("export", str(s), str(o), "-q", "--dtype", "bfloat16")),
    Case("convert-safetensors", "ours", "dcp", "safetensors", "converted",
         lambda s, o: _ckptctl("convert", str(s), str(o), "--to", "safetensors", "-q")),
    Case("convert-torch", "ours", "dcp", "torch", "model.pt",
         lambda s, o: _ckptctl("convert", str(s), str(o), "--to", "torch", "-q")),
    Case("reshard", "ours", "dcp", "dcp-ws3", "reshard",
         lambda s, o: _ckptctl("reshard", str(s), str(o), "--world-size", str(RESHARD_WORLD_SIZE), "-q")),
    Case("inspect", "ours", "dcp", "inspect", "none", lambda s, o: _ckptctl("inspect", str(s))),
    Case("verify", "ours", "dcp", "verify", "none", lambda s, o: _ckptctl("verify", str(s), str(s.parent / "export"))),
    Case("service-job", "ours", "dcp", "safetensors", "export", lambda s, o: _peer("service-job", s, o),
         needs="fastapi"),
    Case("startup", "ours", "tiny", "tiny", "export", lambda s, o: _ckptctl("export", str(s), str(o), "-q")),
    Case("help", "ours", "tiny", "help", "none", lambda s, o: _ckptctl("--help")),
    Case("dcp_to_torch", "peer", "dcp", "torch", "model.pt",
         lambda s, o: [sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch", str(s),
                       str(o)]),
    Case("accelerate", "peer", "dcp", "safetensors", "merged",
         lambda s, o: [*_tool("accelerate", "accelerate.commands.accelerate_cli"), "merge-weights", str(s), str(o)],
         needs="accelerate"),
    Case("dcp-save_file", "peer", "dcp", "safetensors", "saved", lambda s, o: _peer("dcp-save_file", s, o)),
    Case("consolidate", "peer", "hf-dcp", "safetensors", "consolidated", lambda s, o: _peer("consolidate", s, o)),
    # this round's writers (issues 30-32, 34; sources, peers and checks in bench_writers.py)
    Case("cp-megatron", "floor", "megatron-moe", "none", "copy", lambda s, o: ["cp", "-r", str(s), str(o)]),
    Case("export-megatron-hf", "ours", "megatron-moe", "hf-families", "hf",
         lambda s, o: _ckptctl("export", str(s), str(o), "--to-hf", "auto", "-q"), floor="cp-megatron"),
    Case("cp-llama", "floor", "llama-dcp", "none", "copy", lambda s, o: ["cp", "-r", str(s), str(o)]),
    Case("gguf-f16", "ours", "llama-dcp", "gguf", "model.gguf",
         lambda s, o: _ckptctl("export", str(s), str(o), "--gguf", "f16", "--config-from", str(s.parent / "hf"), "-q"),
         floor="cp-llama", peer="gguf-peer"),
    Case("gguf-peer", "peer", "llama-dcp", "gguf", "model.gguf", lambda s, o: _peer("gguf-peer", s, o),
         floor="cp-llama", slow=True),
    Case("fp8-block", "ours", "llama-dcp", "fp8", "fp8",
         lambda s, o: _ckptctl("export", str(s), str(o), "--quantize", "fp8-block", "--config-from",
                               str(s.parent / "hf"), "-q"), floor="cp-llama", peer="fp8-peer"),
    Case("fp8-peer", "peer", "llama-dcp", "fp8", "fp8", lambda s, o: _peer("fp8-peer", s, o), needs="llmcompressor",
         floor="cp-llama", slow=True),
    Case("cp-llama-hf", "floor", "llama-hf", "none", "copy", lambda s, o: ["cp", "-r", str(s), str(o)]),
    Case("export-base", "ours", "llama-hf", "hf-copy", "export", lambda s, o: _ckptctl("export", str(s), str(o), "-q"),
         floor="cp-llama-hf"),
    Case("merged", "ours", "lora", "merged", "merged",
         lambda s, o: _ckptctl("export", str(s), str(o), "--merge-adapter", "--base", str(s.parent / "hf"), "-q"),
         floor="cp-llama-hf", peer="merged-peer", plain="export-base"),
    Case("merged-peer", "peer", "lora", "merged", "merged", lambda s, o: _peer("merged-peer", s, o), needs="peft",
         floor="cp-llama-hf", slow=True),
    Case("archive", "ours", "dcp", "archive", "store",
         lambda s, o: _ckptctl("archive", str(s), str(o), "--id", "bench")),
    Case("restore", "ours", "archive-store", "restore", "restored",
         lambda s, o: _ckptctl("restore", str(s), "bench", str(o))),
)
CASE_NAMES = tuple(c.name for c in CASES)
CASE_BY_NAME = {c.name: c for c in CASES}
WRITER_SOURCES = ("megatron-moe", "llama-hf", "llama-dcp", "lora", "archive-store")  # made by bench_writers.py


def writers() -> Any:
    """benchmarks/bench_writers.py (imported when a case of this round's writers runs)."""
    sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]
    import bench_writers

    return bench_writers


# --- peers run in their own process (`--peer NAME SRC OUT`) -------------------------------------------


def peer_dcp_save_file(src: str, out: str) -> None:
    """Load the whole DCP checkpoint into memory, then write it with safetensors' save_file."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = _load_state_dict_from_keys(checkpoint_id=src)
    Path(out).mkdir(parents=True)
    save_file(state, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})


def peer_consolidate(src: str, out: str) -> None:
    """DCP's own consolidation of HuggingFaceStorageWriter shards into one safetensors file."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    names: set[str] = set()
    for path in sorted(Path(src).glob("*.safetensors")):
        names.update(safetensors_header(path))
    Path(out).mkdir(parents=True)
    consolidate_safetensors_files(src, out, fqn_to_index_mapping=dict.fromkeys(sorted(names), 1))


def service_job(src: str, out: str) -> None:
    """`ckptctl serve` (SQLite, loopback, one job slot) runs one export job of `src` to `out`, then stops.

    Not a peer: it measures ckpt-service as a service (the process tree holds this client, the server and
    the job's own process)."""
    import tempfile

    from ckpt_service.client import ServiceClient
    from ckpt_service.helpers import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-service-") as data:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
        env.update({"CKPT_READ_ROOTS": json.dumps([src]), "CKPT_WRITE_ROOTS": json.dumps([str(Path(out).parent)]),
                    "CKPT_WORKERS": "1", "CKPT_POLL_SECONDS": "0.05", "CKPT_JOB_NICE": "0"})
        server = subprocess.Popen([*_ckptctl("serve", "--port", str(port), "--data-dir", data)], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            with ServiceClient(f"http://127.0.0.1:{port}", timeout=30.0) as client:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        client.jobs(limit=1)
                        break
                    except Exception:
                        if server.poll() is not None or time.monotonic() > deadline:
                            raise RuntimeError("the service did not start") from None
                        time.sleep(0.05)
                job = client.submit({"kind": "export", "source": src, "target": out, "options": {}})
                final = client.wait(job["id"])
                if final["state"] != "succeeded":
                    raise RuntimeError(f"job {job['id']} {final['state']}: {final.get('error')}")
        finally:
            server.terminate()
            server.wait(30)


PEERS: dict[str, Callable[[str, str], None]] = {"dcp-save_file": peer_dcp_save_file,
                                                "consolidate": peer_consolidate, "service-job": service_job}


# --- samples ---------------------------------------------------------------------------------------


@dataclass
class SampleSet:
    label: str
    dcp: Path
    hf: Path
    made_s: float | None  # seconds to make it, None when reused
    tiny: Path | None = None  # a 1 MB checkpoint for the start-up case (see `tiny_sample`)
    extra: dict[str, Path] = field(default_factory=dict)  # WRITER_SOURCES kind -> its path (bench_writers.py)


def tiny_sample(work: Path) -> Path:
    """A 1 MB FSDP2 DCP checkpoint (world size 2): `ckptctl export` of it is all start-up."""
    path = work / "samples" / "tiny" / "fsdp2-dcp"
    if not (path / ".metadata").exists():
        subprocess.run([*_ckptctl("sample", str(path), "--world-size", "2", "--size", "1MB", "--model-only")],
                       check=True, timeout=600, stdout=subprocess.DEVNULL)
    return path


def size_label(size: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", size.strip())


def sample_set(work: Path, size: str, train: bool = True, hf: bool = True) -> SampleSet:
    """The cached fsdp2-dcp (+ hf-dcp with ``hf``: one generator run, so the same state) of ``size``, made if missing.

    ``train=False`` initialises each rank's shards in place and skips the step (the generator's ``--no-train``):
    no rank holds the full model, so sizes the trained path cannot fit in memory can be made. ``hf=False`` skips
    the HuggingFaceStorageWriter copy (only the `consolidate` peer reads it), which halves the disk and the
    generator's memory.
    """
    label = size_label(size) + ("" if train else "-no-train")
    base = work / "samples" / label
    marker = base / "bench-sample.json"
    if marker.exists() and (not hf or (base / "hf-dcp").exists()):
        return SampleSet(label, base / "fsdp2-dcp", base / "hf-dcp", None)
    from ckpt_service.sample import make_samples

    partial = base.with_name(label + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    partial.mkdir(parents=True)
    how = "trained one step" if train else "untrained"
    print(f"making the {size} sample (FSDP2, world size {WORLD_SIZE}, fp32, model only, {how}) in {base} ...",
          flush=True)
    start = time.perf_counter()
    layouts = {"fsdp2-dcp": partial / "fsdp2-dcp", **({"hf-dcp": partial / "hf-dcp"} if hf else {})}
    make_samples(layouts, world_size=WORLD_SIZE, size=size, dtype="float32", with_optim=False,
                 **({} if train else {"train": False}))
    made = time.perf_counter() - start
    info = {"size": size, "world_size": WORLD_SIZE, "trained": train, "seconds": made}
    (partial / marker.name).write_text(json.dumps(info) + "\n")
    partial.rename(base)
    return SampleSet(label, base / "fsdp2-dcp", base / "hf-dcp", made)


def exported_copy(samples: SampleSet) -> Path:
    """The sample exported to safetensors once (what the `verify` case compares the source with)."""
    path = samples.dcp.parent / "export"
    if not (path / "ckpt-manifest.json").exists():
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run(_ckptctl("export", str(samples.dcp), str(path), "-q"), check=True, timeout=3600)
    return path


# --- measuring one run -----------------------------------------------------------------------------


@dataclass
class RunResult:
    wall_s: float
    peak_rss_mb: float
    anon_mb: float  # peak summed RssAnon of the tree
    file_mb: float  # peak summed RssFile of the tree
    cpu_s: float  # user + system seconds of the tool and its reaped children
    load1: float  # the machine's 1-minute load average when the run started (others' work shows here)
    returncode: int
    log: Path


_STATUS_FIELDS = {b"VmRSS:": 0, b"VmHWM:": 1, b"RssAnon:": 2, b"RssFile:": 3}


def _status_kb(pid: int) -> tuple[int, int, int, int]:
    """(VmRSS, VmHWM, RssAnon, RssFile) of a process in KiB from /proc; zeros once it is gone.

    RssAnon is the process's own memory (heap, buffers, thread stacks); RssFile is pages of mapped files
    (shared libraries, and the page-cache pages of a checkpoint the process maps) that it touched."""
    values = [0, 0, 0, 0]
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                slot = _STATUS_FIELDS.get(line.split(maxsplit=1)[0]) if line.strip() else None
                if slot is not None:
                    values[slot] = int(line.split()[1])
    except OSError:
        pass
    return values[0], values[1], values[2], values[3]


def _descendants(pid: int) -> list[int]:
    """``pid`` and every live descendant, from /proc/PID/task/TID/children (Linux)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError, ValueError):
                todo += [int(c) for c in children.read_text().split()]
    return found


class TreeRssPoller(threading.Thread):
    """Peak memory of a process tree, read from /proc every ``interval`` seconds.

    The peak is the larger of the summed VmRSS of the tree at one poll and the largest VmHWM (the
    kernel's own high-water mark of one process, so a spike between polls still counts). ru_maxrss is
    not used: the kernel folds the spawning process's high-water mark into it at exec, so a child of
    this (torch-loaded) process would report this process's size.
    """

    def __init__(self, pid: int, interval: float = 0.02, rescan: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval, self.rescan = pid, interval, rescan
        self.peak_kb = 0
        self.anon_kb = 0  # peak of the tree's summed RssAnon (polled: no kernel high-water mark for it)
        self.file_kb = 0  # peak of the tree's summed RssFile
        self.stop = threading.Event()

    def poll(self, pids: list[int]) -> None:
        readings = [_status_kb(pid) for pid in pids]
        self.peak_kb = max(self.peak_kb, sum(r[0] for r in readings), *(r[1] for r in readings))
        self.anon_kb = max(self.anon_kb, sum(r[2] for r in readings))
        self.file_kb = max(self.file_kb, sum(r[3] for r in readings))

    def run(self) -> None:
        pids, scanned = _descendants(self.pid), time.monotonic()
        while not self.stop.is_set():
            if time.monotonic() - scanned >= self.rescan:
                pids, scanned = _descendants(self.pid), time.monotonic()
            self.poll(pids)
            self.stop.wait(self.interval)


def sync_output(mode: str, out: Path) -> None:
    """``sync`` (all file systems, what `sync` does) or fsync of every file written under ``out``."""
    if mode == "all":
        os.sync()
        return
    if not out.exists():
        return
    paths = [out] if out.is_file() else [*(p for p in out.rglob("*") if p.is_file()), out]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def run_once(argv: list[str], out: Path, log: Path, sync_mode: str, timeout: float) -> RunResult:
    """Run ``argv`` in a fresh process; time it to exit plus sync; peak RSS and CPU time of its tree."""
    env = {**os.environ, "COLUMNS": "200"}
    load1 = os.getloadavg()[0]
    with open(log, "wb") as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        poller = TreeRssPoller(proc.pid)  # Popen returns after the exec: nothing of this process is counted
        poller.start()
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        _, status, usage = os.wait4(proc.pid, 0)  # CPU times are sound here (unlike ru_maxrss, see above)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        killer.cancel()
        sync_output(sync_mode, out)
        wall = time.perf_counter() - start
    poller.stop.set()
    poller.join()
    cpu = usage.ru_utime + usage.ru_stime
    return RunResult(wall, poller.peak_kb * 1024 / 1e6, poller.anon_kb * 1024 / 1e6, poller.file_kb * 1024 / 1e6,
                     cpu, load1, proc.returncode, log)


# --- checking outputs ------------------------------------------------------------------------------


SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (torch dtype name, shape) from a safetensors file's JSON header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {name: (SAFETENSORS_DTYPES.get(v["dtype"], v["dtype"]), tuple(v["shape"])) for name, v in header.items()}


@dataclass
class Reference:
    """Names/dtypes/shapes of every source tensor, and the values of the ones to compare."""

    meta: dict[str, tuple[str, tuple[int, ...]]]
    values: dict[str, Any]  # name -> torch.Tensor
    total_bytes: int

    @property
    def complete(self) -> bool:
        return len(self.values) == len(self.meta)


def _dcp_meta(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {name: (str(m.properties.dtype).removeprefix("torch."), tuple(m.size)) for name, m in entries.items()
            if isinstance(m, TensorStorageMetadata)}


def _dcp_load(path: Path, names: set[str]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _load_state_dict_from_keys(names, checkpoint_id=str(path))


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    import torch

    count = 1
    for dim in shape:
        count *= dim
    return count * getattr(torch, dtype).itemsize


def pick_sample(meta: dict[str, tuple[str, tuple[int, ...]]], budget: int) -> set[str]:
    """Every tensor if they fit in ``budget`` bytes; else the largest one, then others in a fixed hashed order."""
    sizes = {name: _nbytes(*m) for name, m in meta.items()}
    if sum(sizes.values()) <= budget:
        return set(sizes)
    largest = max(sizes, key=lambda n: (sizes[n], n))
    chosen, used = {largest}, sizes[largest]
    for name in sorted(sizes, key=lambda n: (zlib.crc32(n.encode()), n)):
        if name not in chosen and used + sizes[name] <= budget:
            chosen.add(name)
            used += sizes[name]
    return chosen


def load_reference(dcp: Path, budget: int) -> Reference:
    meta = _dcp_meta(dcp)
    values = _dcp_load(dcp, pick_sample(meta, budget))
    return Reference(meta, values, sum(_nbytes(*m) for m in meta.values()))


def _compare_meta(got: dict[str, tuple[str, tuple[int, ...]]], ref: Reference, dtype: str | None) -> str | None:
    """A problem with the names/dtypes/shapes of an output, or None."""
    missing, extra = sorted(set(ref.meta) - set(got)), sorted(set(got) - set(ref.meta))
    if missing or extra:
        return f"missing {missing[:3]} ({len(missing)}), extra {extra[:3]} ({len(extra)})"
    for name, (want_dtype, shape) in ref.meta.items():
        want = dtype if dtype and want_dtype.startswith(("float", "bfloat")) else want_dtype
        if got[name] != (want, shape):
            return f"{name}: {got[name]} instead of {(want, shape)}"
    return None


def _compare_values(load: Callable[[str], Any], ref: Reference, dtype: str | None) -> str | None:
    import torch

    for name, want in ref.values.items():
        if dtype is not None and want.is_floating_point():
            want = want.to(getattr(torch, dtype))
        got = load(name)
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
            return f"{name}: values differ (max |diff| {diff})"
    return None


def _checked(ref: Reference) -> str:
    return f"{len(ref.values)}/{len(ref.meta)} tensors equal" + ("" if ref.complete else " (sampled)")


def check_safetensors(out: Path, ref: Reference, dtype: str | None = None) -> tuple[bool, str]:
    from safetensors import safe_open

    files = sorted(out.glob("*.safetensors"))
    where: dict[str, Path] = {}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        header = safetensors_header(path)
        if set(header) & set(meta):
            return False, f"{path.name} repeats tensors of another file"
        meta.update(header)
        where.update(dict.fromkeys(header, path))
    index = out / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        if {k: out / v for k, v in weight_map.items()} != where:
            return False, "model.safetensors.index.json does not match the files"
    problem = _compare_meta(meta, ref, dtype)
    if problem is None:
        handles: dict[Path, Any] = {}

        def load(name: str) -> Any:
            if where[name] not in handles:
                handles[where[name]] = safe_open(str(where[name]), "pt")
            return handles[where[name]].get_tensor(name)

        problem = _compare_values(load, ref, dtype)
    return problem is None, problem or f"{len(files)} file(s), {_checked(ref)}"


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_torch(out: Path, ref: Reference) -> tuple[bool, str]:
    import torch

    state = _flatten(torch.load(out, mmap=True, weights_only=True, map_location="cpu"))
    meta = {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state.items()
            if isinstance(v, torch.Tensor)}
    problem = _compare_meta(meta, ref, None) or _compare_values(state.__getitem__, ref, None)
    return problem is None, problem or _checked(ref)


def check_dcp(out: Path, ref: Reference, files: int | None) -> tuple[bool, str]:
    shards = sorted(out.glob("*.distcp"))
    if files is not None and len(shards) != files:
        return False, f"{len(shards)} .distcp files, expected {files}"
    loaded = _dcp_load(out, set(ref.values))
    problem = _compare_meta(_dcp_meta(out), ref, None) or _compare_values(loaded.__getitem__, ref, None)
    return problem is None, problem or f"{len(shards)} shard files, {_checked(ref)}"


def check_inspect(log: Path, ref: Reference) -> tuple[bool, str]:
    text = log.read_text(errors="replace")
    fields = dict(re.findall(r"^\s*(\w+): (\S+)", text, flags=re.MULTILINE))
    want = {"tensors": str(len(ref.meta)), "total_bytes": str(ref.total_bytes), "world_size": str(WORLD_SIZE)}
    wrong = {k: fields.get(k) for k, v in want.items() if fields.get(k) != v}
    return not wrong, f"reported {wrong}, expected {want}" if wrong else "tensors, bytes and world size match"


def check_output(case: Case, out: Path, log: Path, ref: Reference, src: Path,
                 dcp: Path | None = None) -> tuple[bool, str]:
    """Whether ``out`` (``log``: the run's output) is right for ``case`` run on ``src``; ``dcp``: the FSDP2 sample."""
    try:
        if case.check == "inspect":
            return check_inspect(log, ref)
        if case.check == "help":
            text = log.read_text(errors="replace")
            return "Usage: ckptctl" in text, "usage printed" if "Usage: ckptctl" in text else "no usage"
        if case.check == "verify":
            text = log.read_text(errors="replace")
            return "identical" in text, text.strip().splitlines()[-1][:120] if text.strip() else "no output"
        if case.check == "tiny":
            return check_safetensors(out, ref)
        if not out.exists():
            return False, f"no output at {out}"
        if case.check == "none":
            return True, "not checked (the copy floor)"
        if case.check in ("hf-families", "gguf", "fp8", "merged", "hf-copy", "archive", "restore"):
            return writers().check(case.check, out, src, dcp or src)
        if case.check == "safetensors":
            return check_safetensors(out, ref)
        if case.check == "safetensors-bf16":
            return check_safetensors(out, ref, "bfloat16")
        if case.check == "torch":
            return check_torch(out, ref)
        if case.check == "dcp-ws3":
            return check_dcp(out, ref, RESHARD_WORLD_SIZE)
        return check_dcp(out, ref, len(list(src.glob("*.distcp"))))
    except Exception as exc:  # an unreadable output is a wrong output
        return False, f"{type(exc).__name__}: {exc}"


# --- running the cases -----------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    size: str
    kind: str
    command: list[str]
    wall_s: list[float] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    anon_mb: list[float] = field(default_factory=list)
    file_mb: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    load1: list[float] = field(default_factory=list)
    status: str = "ok"  # ok, FAILED or SKIPPED
    note: str = ""
    min_s: float | None = None
    median_s: float | None = None
    peak_rss_mb: float | None = None
    peak_anon_mb: float | None = None
    peak_file_mb: float | None = None
    median_cpu_s: float | None = None
    spread: float | None = None  # (max - min) / median of the wall times: how steady the runs were
    ratio_cp: float | None = None
    cpu_ratio_cp: float | None = None  # median CPU seconds / cp's
    ratio_best_peer: float | None = None
    best_peer: str | None = None
    ratio_consolidate: float | None = None
    ratio_plain: float | None = None  # median / the plain export's (Case.plain)

    def summarize(self) -> None:
        if self.wall_s:
            self.min_s, self.median_s = min(self.wall_s), statistics.median(self.wall_s)
            self.peak_rss_mb = max(self.rss_mb)
            self.peak_anon_mb, self.peak_file_mb = max(self.anon_mb), max(self.file_mb)
            self.median_cpu_s = statistics.median(self.cpu_s)
            self.spread = (max(self.wall_s) - self.min_s) / self.median_s if self.median_s else None


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def _fail(row: Row, note: str) -> None:
    if row.status != "FAILED":
        row.status, row.note = "FAILED", note


def prepare_cache(src: Path, mode: str) -> None:
    """Give every run the same page cache: `warm` reads the source files through once (they are then in
    the page cache, as right after training wrote them), `cold` drops the page cache (root only), so every
    run reads the source from disk."""
    if mode == "cold":
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return
    buf = memoryview(bytearray(8 << 20))
    for path in [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [buf]):
                pass
        finally:
            os.close(fd)


def run_case(case: Case, row: Row, samples: SampleSet, refs: dict[str, Reference], args: argparse.Namespace,
             rep: int) -> None:
    src = {"hf-dcp": samples.hf, "tiny": samples.tiny, **samples.extra}.get(case.source) or samples.dcp
    ref = refs.get(case.source, refs["dcp"])
    run_dir = args.work_dir / "runs" / samples.label / case.name
    _remove(run_dir)
    run_dir.mkdir(parents=True)
    out, log = run_dir / case.out_name, args.work_dir / "logs" / f"{samples.label}-{case.name}-{rep}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    os.sync()  # what earlier runs left dirty is not this run's to pay for
    prepare_cache(src, args.cache)
    if case.source in WRITER_SOURCES and args.cache == "warm":
        for other in writers().also_read(case.source, src):
            prepare_cache(other, args.cache)
    if case.name in WARM_TOOL_CASES and args.cache == "warm":
        # the tool's own files (interpreter, libraries, bytecode) in the page cache, as after any earlier run:
        # the gigabytes moved by the cases before this one evict them, and then reading them back is measured
        run_once(case.argv(src, out), out, log, args.sync, args.timeout)
        _remove(out)
    result = run_once(case.argv(src, out), out, log, args.sync, args.timeout)
    row.wall_s.append(round(result.wall_s, 4))
    row.rss_mb.append(round(result.peak_rss_mb, 1))
    row.anon_mb.append(round(result.anon_mb, 1))
    row.file_mb.append(round(result.file_mb, 1))
    row.cpu_s.append(round(result.cpu_s, 3))
    row.load1.append(round(result.load1, 2))
    if result.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        _fail(row, f"exit {result.returncode} (repeat {rep}; {log}): {tail[0][:200]}")
    else:
        ok, note = check_output(case, out, log, ref, src, samples.dcp)
        if not ok:
            _fail(row, f"repeat {rep}: {note}")
        elif row.status == "ok":
            row.note = note
    _remove(run_dir)
    print(f"  {samples.label:>6} {case.name:<14} repeat {rep}: {result.wall_s:7.2f} s, "
          f"{result.peak_rss_mb:8.1f} MB (anon {result.anon_mb:.0f}, file {result.file_mb:.0f}), "
          f"cpu {result.cpu_s:6.2f} s, load {result.load1:4.1f}, {row.status}",
          flush=True)


def skipped(case: Case) -> str | None:
    if case.needs and find_spec(case.needs) is None:
        return f"{case.needs} is not installed (pip install -e '.[bench]')"
    return None


def run_size(size: str, cases: list[Case], args: argparse.Namespace) -> tuple[list[Row], dict[str, Any]]:
    from ckpt_service.units import parse_size

    wants_hf = not args.no_hf and any(c.source == "hf-dcp" for c in cases)
    samples = sample_set(args.work_dir, size, train=not args.no_train, hf=wants_hf)
    if any(c.check == "verify" for c in cases):
        exported_copy(samples)
    print(f"loading the reference tensors of {samples.dcp} ...", flush=True)
    ref = load_reference(samples.dcp, args.check_budget)
    refs = {"dcp": ref}
    writer_dir = args.work_dir / "samples" / f"{size_label(size)}-writers"
    for kind in dict.fromkeys(c.source for c in cases if c.source in WRITER_SOURCES and not skipped(c)):
        samples.extra[kind] = writers().source_path(kind, writer_dir, size, parse_size(size), samples.dcp)
    if any(c.source == "tiny" for c in cases):
        samples.tiny = tiny_sample(args.work_dir)
        refs["tiny"] = load_reference(samples.tiny, args.check_budget)
    rows = {c.name: Row(c.name, samples.label, c.kind, c.argv(Path("SRC"), Path("OUT"))) for c in cases}
    for case in cases:
        if note := skipped(case):
            rows[case.name].status, rows[case.name].note = "SKIPPED", note
        elif case.source == "hf-dcp" and not samples.hf.exists():
            rows[case.name].status, rows[case.name].note = "SKIPPED", "no HuggingFaceStorageWriter copy (--no-hf)"
    for rep in range(1, args.repeats + 1):
        for case in cases:
            if rows[case.name].status != "SKIPPED":
                run_case(case, rows[case.name], samples, refs, args, rep)
    info = {"label": samples.label, "dcp": str(samples.dcp), "hf_dcp": str(samples.hf), "tensors": len(ref.meta),
            "total_bytes": ref.total_bytes, "checked_tensors": len(ref.values), "sample_made_s": samples.made_s,
            "trained": not args.no_train}
    return list(rows.values()), info


def add_ratios(rows: list[Row]) -> None:
    """ours/cp and ours/best-peer (median over median), per size."""
    for row in rows:
        row.summarize()
    for size in {r.size for r in rows}:
        by_name = {r.case: r for r in rows if r.size == size and r.status == "ok" and r.median_s}
        peers = [by_name[p] for p in DCP_PEERS if p in by_name]
        best = min(peers, key=lambda r: r.median_s or 0.0) if peers else None
        cons = by_name.get("consolidate")
        for row in by_name.values():
            case = CASE_BY_NAME[row.case]
            floor = by_name.get(case.floor)
            if floor and case.kind != "floor":
                row.ratio_cp = row.median_s / floor.median_s
                if floor.median_cpu_s:
                    row.cpu_ratio_cp = (row.median_cpu_s or 0.0) / floor.median_cpu_s
            if case.peer and case.peer in by_name:
                row.ratio_best_peer, row.best_peer = row.median_s / by_name[case.peer].median_s, case.peer
            if case.plain and case.plain in by_name:
                row.ratio_plain = row.median_s / by_name[case.plain].median_s
            if row.case in OURS_CONVERSIONS and best:
                row.ratio_best_peer, row.best_peer = row.median_s / best.median_s, best.case
            if row.case in ("export", "export-bf16") and cons:
                row.ratio_consolidate = row.median_s / cons.median_s


# --- targets, table, JSON --------------------------------------------------------------------------


OPS: dict[str, Callable[[float, float], bool]] = {"<=": lambda v, x: v <= x, "<": lambda v, x: v < x,
                                                  ">=": lambda v, x: v >= x}


def _target(name: str, size: str, value: float | None, op: str, limit: float) -> dict[str, Any]:
    met = None if value is None else OPS[op](value, limit)
    return {"target": name, "size": size, "value": value, "rule": op, "limit": limit, "met": met}


WARM_TOOL_CASES = ("startup", "help", "inspect")  # start-up bound: one untimed run first (see run_case)
MEMORY_CASES = ("export", "export-bf16", "convert-safetensors", "convert-torch", "reshard", "verify", "service-job",
                "export-megatron-hf", "gguf-f16", "fp8-block", "merged", "archive", "restore")
#: this round's writers (issues 30, 31, 32, 34): (case, its limit against its copy floor, against its peer)
WRITER_TARGETS = (("export-megatron-hf", 1.5, None), ("gguf-f16", 1.5, 3.0), ("fp8-block", 1.5, 3.0),
                  ("archive", 3.0, None), ("restore", 1.5, None))
MERGED_LIMIT = 1.3  # issue 32: merged export within 1.3x the plain export of its base


def copy_speed_limit() -> float:
    """Issue 17: within 1.1x `cp -r` on a 16-core machine (at 12 GB), within 1.3x on smaller ones (at 3 GB)."""
    return 1.1 if (os.cpu_count() or 1) >= 16 else 1.3


def targets(rows: list[Row]) -> list[dict[str, Any]]:
    """The targets of issues 6, 17, 29 and 36, per size, then across sizes (value and met are None where a case did not
    run or failed)."""
    found: list[dict[str, Any]] = []
    limit = copy_speed_limit()
    sizes = list(dict.fromkeys(r.size for r in rows))
    for size in sizes:
        get = {r.case: r for r in rows if r.size == size and r.status == "ok"}.get
        export, bf16, inspect, startup = get("export"), get("export-bf16"), get("inspect"), get("startup")
        help_row = get("help")
        speedup = 1 / export.ratio_best_peer if export and export.ratio_best_peer else None
        for case in ("export", "convert-safetensors", "convert-torch", "reshard"):
            row = get(case)
            found.append(_target(f"{case} median / cp median", size, row and row.ratio_cp, "<=", limit))
        found += [
            _target("fastest DCP peer median / export median", size, speedup, ">=", 3.0),
            _target("export CPU s / cp CPU s", size, export and export.cpu_ratio_cp, "<=", 2.0),
            _target("export median / consolidate_safetensors_files median", size,
                    export and export.ratio_consolidate, "<", 1.0),
            _target("export bf16 median / cp median", size, bf16 and bf16.ratio_cp, "<=", 2.0),
            _target("inspect median wall s", size, inspect and inspect.median_s, "<=", 0.3),
            _target("ckptctl --help median wall s", size, help_row and help_row.median_s, "<=", 0.25),
            _target("startup (export of a 1 MB checkpoint) median wall s", size, startup and startup.median_s,
                    "<=", 0.25),
        ]
        for case, cp_limit, peer_limit in WRITER_TARGETS:
            row, floor = get(case), CASE_BY_NAME[case].floor
            found.append(_target(f"{case} median / {floor} median", size, row and row.ratio_cp, "<=", cp_limit))
            if peer_limit:
                speed = 1 / row.ratio_best_peer if row and row.ratio_best_peer else None
                found.append(_target(f"{CASE_BY_NAME[case].peer} median / {case} median", size, speed, ">=",
                                     peer_limit))
        merged = get("merged")
        found.append(_target("merged median / export-base median", size, merged and merged.ratio_plain, "<=",
                             MERGED_LIMIT))
        for case in MEMORY_CASES:
            row = get(case)
            found.append(_target(f"{case} peak RSS MB", size, row and row.peak_rss_mb, "<", 300.0))
    if len(sizes) > 1:  # flat memory: the peak at the largest size within 15% of the peak at the smallest
        first, last = sizes[0], sizes[-1]
        for case in MEMORY_CASES:
            peaks = {r.size: r.peak_rss_mb for r in rows if r.case == case and r.status == "ok"}
            change = (peaks[last] / peaks[first] - 1) * 100 if peaks.get(first) and peaks.get(last) else None
            found.append(_target(f"{case} peak RSS change {first} -> {last}, |%|", f"{first}..{last}",
                                 None if change is None else abs(change), "<=", 15.0))
    return found


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


#: a copy floor whose runs spread wider than this makes every ratio of that size uncertain
FLOOR_SPREAD = 0.20


def floor_notes(rows: list[Row]) -> list[str]:
    """A line for each size where `cp` itself varied by more than FLOOR_SPREAD within the run."""
    return [f"{r.size}: cp varied by {r.spread:.0%} within this run ({', '.join(f'{w:.2f}' for w in r.wall_s)} s); "
            "ratios against it are uncertain by as much"
            for r in rows if r.case == "cp" and r.spread is not None and r.spread > FLOOR_SPREAD]


def print_table(rows: list[Row], goals: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ckpt-service conversions vs cp -r and peers (wall includes sync; RSS of the process tree)")
    for col in ("case", "size", "kind", "min s", "median s", "spread", "peak RSS MB", "anon MB", "file MB", "CPU s",
                "CPU/cp", "/cp", "/best peer", "/consolidate", "/plain", "check"):
        table.add_column(col, justify="right" if col[0] in "mpsC/" else "left")
    for r in rows:
        peer = f"{_fmt(r.ratio_best_peer, '.2f')} ({r.best_peer})" if r.best_peer else "-"
        numbers = (_fmt(r.min_s, ".2f"), _fmt(r.median_s, ".2f"),
                   "-" if r.spread is None else f"{r.spread:.0%}", _fmt(r.peak_rss_mb, ".0f"),
                   _fmt(r.peak_anon_mb, ".0f"), _fmt(r.peak_file_mb, ".0f"), _fmt(r.median_cpu_s, ".2f"),
                   _fmt(r.cpu_ratio_cp, ".2f"), _fmt(r.ratio_cp, ".2f"), peer, _fmt(r.ratio_consolidate, ".2f"),
                   _fmt(r.ratio_plain, ".2f"))
        table.add_row(r.case, r.size, r.kind, *numbers, f"{r.status}: {r.note[:60]}" if r.note else r.status)
    console = Console(width=max(200, shutil.get_terminal_size().columns))
    console.print(table)
    for note in floor_notes(rows):
        console.print(f"  [yellow]note[/]    {note}")
    for g in goals:
        label, color = {True: ("met", "green"), False: ("MISSED", "red"), None: ("n/a", "yellow")}[g["met"]]
        mark = f"[{color}]{label:<6}[/]"
        value = "-" if g["value"] is None else f"{g['value']:.3g}"
        console.print(f"  {mark}  {g['size']:>6}  {g['target']}: {value} (target {g['rule']} {g['limit']:g})")


def _version(dist: str) -> str | None:
    try:
        return importlib_metadata.version(dist)
    except importlib_metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return {"cores": os.cpu_count(), "ram_gib": round(pages * page_size / 2**30, 1), "platform": platform.platform(),
            "python": platform.python_version(), "hostname": platform.node()}


def engine_sources() -> dict[str, str]:
    """path -> sha1 of the engine's and the CLI's sources: other work may change them while a run is going."""
    hashes: dict[str, str] = {}
    for path in sorted([*ROOT.glob("converters/**/*.py"), *ROOT.glob("ckpt_service/**/*.py")]):
        with contextlib.suppress(OSError):
            hashes[str(path.relative_to(ROOT))] = hashlib.sha1(path.read_bytes()).hexdigest()
    return hashes


def changed_sources(before: dict[str, str]) -> list[str]:
    after = engine_sources()
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


def git_state() -> dict[str, Any]:
    """The commit measured and the engine/CLI paths with uncommitted changes, at the start of the run."""
    def git(*args: str) -> str:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return proc.stdout.strip()

    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty_paths": git("status", "--porcelain", "--", "converters", "ckpt_service").splitlines()}


def write_json(path: Path, rows: list[Row], sizes: dict[str, Any], goals: list[dict[str, Any]],
               args: argparse.Namespace, git: dict[str, Any]) -> None:
    doc = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": [Path(sys.executable).name, *sys.argv],
        "machine": machine(),
        "git": git,
        "versions": {d: _version(d) for d in ("torch", "ckpt-service", "safetensors", "accelerate")},
        "repeats": args.repeats, "sync": args.sync, "cache": args.cache, "check_budget_bytes": args.check_budget,
        "rss_method": "peak RSS: max over /proc polls every 20 ms of (summed VmRSS of the tree, largest VmHWM); "
                      "anon: peak summed RssAnon (the processes' own memory); file: peak summed RssFile (mapped "
                      "files: libraries and page-cache pages of mapped checkpoint files); MB = 1e6 B",
        "sizes": sizes,
        "rows": [asdict(r) for r in rows],
        "floor_notes": floor_notes(rows),
        "targets": goals,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


# --- command line ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="3GB", help="Checkpoint size (fp32 parameter bytes), e.g. 3GB.")
    p.add_argument("--sizes", help="Comma-separated sizes, e.g. 3GB,6GB (overrides --size).")
    p.add_argument("--no-train", action="store_true", help="Make the sample untrained, shards initialised in place "
                   "(no full model on any rank: for sizes whose training does not fit in memory).")
    p.add_argument("--no-hf", action="store_true", help="Make no HuggingFaceStorageWriter copy of a sample that "
                   "lacks one (it doubles the disk and the generator's memory); `consolidate` is skipped there.")
    p.add_argument("--repeats", type=int, default=3, help="Runs of each case (default 3).")
    p.add_argument("--cases", default=",".join(c.name for c in CASES if not c.slow),
                   help=f"Comma-separated subset of {','.join(CASE_NAMES)} (default: all but the slow peers "
                   f"{','.join(c.name for c in CASES if c.slow)}).")
    p.add_argument("--peers", action="store_true", help="Add the slow peers of this round's writers to --cases "
                   "(llama.cpp's converter and llm-compressor after our export, PEFT's merge).")
    p.add_argument("--work-dir", type=Path, default=ROOT / "bench-out", help="Samples cache, outputs, logs.")
    p.add_argument("--out", type=Path, default=None, help="JSON results (default WORK_DIR/results.json).")
    p.add_argument("--check-budget", default="512MB", help="Compare every tensor below this checkpoint size, "
                   "else a deterministic sample of about this many bytes.")
    p.add_argument("--sync", choices=("all", "output"), default="all",
                   help="After each command: `sync` everything (default) or fsync the output's files only.")
    p.add_argument("--cache", choices=("warm", "cold"), default="warm",
                   help="Before each run: read the source through once (warm, default) or drop the page cache "
                   "(cold: every run reads the source from disk; needs root).")
    p.add_argument("--timeout", type=float, default=1800.0, help="Seconds before a run is killed.")
    p.add_argument("--peer", nargs=3, metavar=("NAME", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        return args
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    if args.peers:
        names += [c.name for c in CASES if c.slow]
    if unknown := sorted(set(names) - set(CASE_NAMES)):
        p.error(f"unknown case(s) {unknown}: choose from {', '.join(CASE_NAMES)}")
    args.case_list = [c for c in CASES if c.name in names]
    args.size_list = [s.strip() for s in (args.sizes or args.size).split(",") if s.strip()]
    args.work_dir = args.work_dir.resolve()
    args.out = (args.out or args.work_dir / "results.json").resolve()
    from ckpt_service.units import parse_size

    args.check_budget = parse_size(args.check_budget)
    for size in args.size_list:
        parse_size(size)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def iter_sizes(args: argparse.Namespace) -> Iterator[tuple[list[Row], dict[str, Any]]]:
    for size in args.size_list:
        print(f"== {size}", flush=True)
        yield run_size(size, args.case_list, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer:
        name, src, out = args.peer
        (PEERS.get(name) or writers().PEERS[name])(src, out)
        return 0
    git, sources = git_state(), engine_sources()
    # bytecode as an installed package has it (PYTHONDONTWRITEBYTECODE would have every run compile again)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "converters", "ckpt_service", "api", "ckptctl"], cwd=ROOT,
                   check=False, stdout=subprocess.DEVNULL)
    rows: list[Row] = []
    sizes: dict[str, Any] = {}
    for size_rows, info in iter_sizes(args):
        rows += size_rows
        sizes[info["label"]] = info
    add_ratios(rows)
    goals = targets(rows)
    print_table(rows, goals)
    git["changed_during_run"] = changed_sources(sources)
    if git["changed_during_run"]:
        print(f"warning: changed during the run (rows may mix versions): {', '.join(git['changed_during_run'])}")
    write_json(args.out, rows, sizes, goals, args, git)
    print(f"wrote {args.out}")
    return 1 if any(r.status == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
