"""Seeded fuzzing of every reader: small real checkpoints, mutated, through the engine API in-process.

Each mutation (a truncation, byte flips in a header, a metadata pickle or a zip, a JSON edit) must end in
one of two ways: success, with output tensors equal to the honest checkpoint's wherever name, dtype and
shape still match (or, where the mutant is a different but valid file, equal to what torch's or safetensors'
own loader reads from it; a flip inside a data.pkl that no independent loader can judge may change values,
e.g. a stride of 0), or a `CkptError`. Never another exception, a hang (SIGALRM after a few seconds)
or unbounded memory (address space capped at the current size + 1 GiB while fuzzing).

CI runs FUZZ_CASES mutations per reader; `pytest --fuzz-long` runs many more (and `--fuzz-seed N` moves the
seeds), for longer hunts.
"""

from __future__ import annotations

import json
import random
import resource
import shutil
import signal
import struct
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import converters
from converters.errors import CkptError

from . import attack_kit as kit

FUZZ_CASES = 300
LONG_CASES = 3000
HANG_SECONDS = 10
HEADROOM = 1 << 30
_JUNK = [None, -1, 0, 1 << 70, 1.5, "", "../x", "/etc/passwd", "%2e%2e", [], {}, [-1, 2], ["a"], True]


@dataclass
class Mutant:
    description: str
    # "metadata": checkpoint metadata or a header, "zip": zip structure, "pickle": a data.pkl (a flip may
    # legitimately move a tensor's view, e.g. a stride of 0: only an independent loader can judge the values)
    site: str


class Hang(Exception):
    pass


@contextmanager
def bounded() -> Iterator[None]:
    """Raise Hang after HANG_SECONDS; cap the address space at its current size + HEADROOM."""
    def alarm(*_: object) -> None:
        raise Hang(f"no answer after {HANG_SECONDS} s")

    with open("/proc/self/status") as fh:
        vm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = vm + HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(HANG_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _member_spans(raw: bytes, part: bytes) -> list[tuple[int, int]]:
    """Byte ranges of the members whose name holds `part` in a torch.save zip or a .distcp of them: from the
    end of each member's local header to the next local header."""
    heads = []
    pos = raw.find(b"PK\x03\x04")
    while pos >= 0:
        heads.append(pos)
        pos = raw.find(b"PK\x03\x04", pos + 4)
    spans = []
    for at, nxt in zip(heads, [*heads[1:], len(raw)]):
        name_len, extra_len = struct.unpack_from("<HH", raw, at + 26)
        if part in raw[at + 30: at + 30 + name_len]:
            spans.append((at + 30 + name_len + extra_len, nxt))
    return spans


def _flip(path: Path, rng: random.Random, lo: int, hi: int, avoid: list[tuple[int, int]] = (),
          spots: list[int] | None = None) -> str:
    raw = bytearray(path.read_bytes())
    hi = min(hi, len(raw))
    spots = [] if spots is None else spots
    for _ in range(rng.randint(1, 4)):
        for _ in range(20):
            at = rng.randrange(lo, hi)
            if not any(a <= at < b for a, b in avoid):
                break
        raw[at] = rng.choice([raw[at] ^ (1 << rng.randrange(8)), rng.randrange(256), 0, 0xFF])
        spots.append(at)
    path.write_bytes(bytes(raw))
    return f"flip bytes {spots} of {path.name}"


def _json_edit(doc: Any, rng: random.Random) -> str:
    """Replace, delete or add one value somewhere in a JSON document (in place)."""
    node, trail = doc, []
    while isinstance(node, dict | list) and node and rng.random() < 0.7:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        if not isinstance(node[key], dict | list) or not node[key]:
            break
        node, trail = node[key], [*trail, key]
    if isinstance(node, dict) and node:
        key = rng.choice(list(node))
        action = rng.choice(["replace", "delete", "add"])
        if action == "delete":
            del node[key]
        elif action == "add":
            node[rng.choice(["x", "__metadata__", "../y", key + "_"])] = rng.choice(_JUNK)
        else:
            node[key] = rng.choice(_JUNK)
        return f"{action} {[*trail, key]}"
    if isinstance(node, list) and node:
        at = rng.randrange(len(node))
        node[at] = rng.choice(_JUNK)
        return f"replace {[*trail, at]}"
    return "no-op"


def mutate(ckpt: Path, reader: str, rng: random.Random) -> Mutant:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    path = rng.choice(files)
    kind = rng.choice(["truncate", "flip", "flip", "edit"])
    size = path.stat().st_size
    if kind == "truncate":
        keep = rng.randrange(size)
        kit.truncate(path, keep / size)
        return Mutant(f"truncate {path.name} to {keep} bytes", "metadata")
    if path.suffix == ".json":
        doc = json.loads(path.read_text())
        if kind == "edit":
            what = _json_edit(doc, rng)
            path.write_text(json.dumps(doc))
            return Mutant(f"{path.name}: {what}", "metadata")
        return Mutant(_flip(path, rng, 0, size), "metadata")
    if path.suffix == ".safetensors":
        header, data = kit.safetensors_header(path)
        if kind == "edit":
            what = _json_edit(header, rng)
            kit.write_safetensors(path, header, data)
            return Mutant(f"{path.name} header: {what}", "metadata")
        return Mutant(_flip(path, rng, 0, size - len(data)), "metadata")
    if path.name == ".metadata":
        return Mutant(_flip(path, rng, 0, size), "metadata")
    raw = path.read_bytes()
    spots: list[int] = []
    what = _flip(path, rng, 0, size, _member_spans(raw, b"/data/"), spots)
    pickle = any(a <= at < b for at in spots for a, b in _member_spans(raw, b"data.pkl"))
    return Mutant(what, "pickle" if pickle else "zip")


def _oracle(ckpt: Path, reader: str, mutant: Mutant) -> dict[str, torch.Tensor] | None:
    """What the library that owns the format reads from a mutant, when that is safe to ask: never a pickle.load
    of a mutated pickle (torch.load with weights_only=True; dcp.load only while .metadata is the honest one)."""
    from safetensors.torch import load_file

    try:
        if reader in ("dcp", "accelerate") and mutant.site in ("zip", "pickle"):
            return kit.reference(ckpt)
        if reader in ("safetensors", "safetensors-sharded", "hf-dcp"):
            return {k: v for p in ckpt.glob("*.safetensors") for k, v in load_file(p).items()}
        if reader in ("torch", "torch-index", "rank-files"):
            out = {}
            for p in sorted(ckpt.glob("*.pt")) + sorted(ckpt.glob("*.bin")):  # rank0 first: replicas read from it
                for k, v in torch.load(p, weights_only=True).items():
                    if isinstance(v, torch.Tensor):
                        out.setdefault(k, v)
            return out
    except Exception:
        return None
    return None


def _differs(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, v in got.items() if k in want and want[k].dtype == v.dtype and want[k].shape == v.shape
            and not torch.equal(want[k], v)]


def _run(source: Path, target: Path) -> dict[str, torch.Tensor] | None:
    """inspect then convert; the converted tensors, or None when the engine refused with a CkptError."""
    from safetensors.torch import load_file

    try:
        converters.inspect(str(source))
        converters.convert(str(source), str(target))
    except CkptError:
        return None
    files = [target] if target.is_file() else sorted(target.glob("*.safetensors"))
    return {k: v for p in files for k, v in load_file(p).items()}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return kit.build_bases(tmp_path_factory.mktemp("fuzz-bases"))


@pytest.mark.parametrize("reader", kit.READERS)
def test_fuzz_reader(reader: str, bases: dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    long = request.config.getoption("--fuzz-long", default=False)
    seed = request.config.getoption("--fuzz-seed", default=0)
    cases = LONG_CASES if long else FUZZ_CASES
    want = kit.reference(bases[reader])
    failures: list[str] = []
    outcomes = {"refused": 0, "converted": 0}
    for i in range(seed, seed + cases):
        rng = random.Random(f"{reader}-{i}")
        ckpt = kit.copy_base(bases[reader], tmp_path / f"m{i}")
        mutant = mutate(ckpt, reader, rng)
        out = tmp_path / f"out{i}"
        label = f"{reader} #{i} ({mutant.description})"
        try:
            with bounded():
                got = _run(ckpt, out)
        except BaseException as exc:  # anything but a CkptError is the defect sought
            if isinstance(exc, KeyboardInterrupt):
                raise
            where = traceback.extract_tb(exc.__traceback__)[-1]
            failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]} at {where.filename}:{where.lineno}")
            got = None
        outcomes["refused" if got is None else "converted"] += 1
        if got is not None:
            bad = _differs(got, want)
            if bad:
                oracle = _oracle(ckpt, reader, mutant)
                if (oracle is None and mutant.site != "pickle") or (oracle is not None and _differs(got, oracle)):
                    failures.append(f"{label}: succeeded with different values for {bad}")
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    assert not failures, f"{len(failures)} of {cases} mutations misbehaved:\n" + "\n".join(failures[:15])
    # the mutations bite (most are refused) without breaking everything (some still convert)
    assert outcomes["refused"] >= cases // 2 and outcomes["converted"] >= cases // 50, outcomes
