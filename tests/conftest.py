"""Real checkpoints for the tests: made once per session by training with real FSDP on CPU (gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ckpt_service.sample import make_samples

from .pg_server import postgres, store_location  # noqa: F401  (fixtures: a real PostgreSQL server)

FSDP2_LAYOUTS = ("fsdp2-dcp", "rank-files-dtensor", "hf-dcp", "torch-full", "safetensors")
FSDP1_LAYOUTS = ("fsdp1-dcp", "accelerate", "rank-files-sharded", "accelerate-rank-files")


@dataclass
class Sample:
    path: Path
    reference: Path

    def ref(self) -> dict:
        return torch.load(self.reference, weights_only=True)


class Samples:
    """Lazily made, session-cached sample checkpoints, keyed by a name."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, Sample] = {}

    def group(self, key: str, layouts: tuple[str, ...], **kwargs: object) -> dict[str, Sample]:
        if key not in self.made:
            base = self.root / key
            base.mkdir(parents=True)
            make_samples({layout: base / layout for layout in layouts}, reference=base / "reference.pt",
                         size="tiny", **kwargs)
            for layout in layouts:
                self.made[f"{key}/{layout}"] = Sample(base / layout, base / "reference.pt")
            self.made[key] = Sample(base, base / "reference.pt")
        return {layout: self.made[f"{key}/{layout}"] for layout in layouts}

    def one(self, key: str, layout: str, **kwargs: object) -> Sample:
        return self.group(key, (layout,), **kwargs)[layout]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-long", action="store_true", help="tests/test_fuzz.py: thousands of mutations per reader")
    parser.addoption("--fuzz-seed", type=int, default=0, help="tests/test_fuzz.py: first mutation number")


@pytest.fixture(scope="session")
def samples(tmp_path_factory: pytest.TempPathFactory) -> Samples:
    return Samples(tmp_path_factory.mktemp("samples"))


@pytest.fixture(scope="session")
def fsdp2(samples: Samples) -> dict[str, Sample]:
    return samples.group("fsdp2-ws2", FSDP2_LAYOUTS, world_size=2)


@pytest.fixture(scope="session")
def fsdp1(samples: Samples) -> dict[str, Sample]:
    return samples.group("fsdp1-ws2", FSDP1_LAYOUTS, world_size=2)


def ckptctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the real `ckptctl` console entry point in a subprocess."""
    proc = subprocess.run([sys.executable, "-m", "ckptctl", *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, "COLUMNS": "200"}, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckptctl {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, dtypes, shapes and bit-identical values."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that trains sample checkpoints (the `samples` fixtures) is slow wherever it lives."""
    for item in items:
        if {"samples", "fsdp1", "fsdp2"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
