"""Service jobs read only inside their storage roots, member by member: a checkpoint inside the read root
whose data file is a symlink to a file outside every root fails the job, naming the file, while the same
checkpoint converts offline (where the user reads with their own permissions)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from .conftest import ckptctl
from .service_harness import Tokens, job_spec, leftovers, make_server

pytestmark = pytest.mark.slow


def test_member_symlink_out_of_the_read_roots_fails_the_job(tmp_path: Path) -> None:
    read_root, write_root, outside = tmp_path / "data", tmp_path / "out", tmp_path / "elsewhere"
    for folder in (read_root, write_root, outside):
        folder.mkdir()
    weights = {"layer.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    source = read_root / "ckpt"
    dcp.save(weights, checkpoint_id=str(source), no_dist=True)
    (data_file,) = source.glob("*.distcp")
    shutil.move(data_file, outside / data_file.name)  # the bytes now live outside every root
    os.symlink(outside / data_file.name, data_file)

    offline = tmp_path / "offline"
    ckptctl("export", str(source), str(offline))
    assert torch.equal(load_file(offline / "model.safetensors")["layer.weight"], weights["layer.weight"])

    tokens = Tokens.make()
    server = make_server(tmp_path / "srv", read_roots=[read_root], write_roots=[write_root],
                         tokens=tokens.entries).start()
    try:
        target = write_root / "export"
        with server.client(tokens.write) as client:
            job = client.submit(job_spec("export", source, target))
        done = server.wait_job(job["id"], ("failed", "succeeded"), token=tokens.read)
        assert done["state"] == "failed", done
        message = done["error"]["message"]
        assert data_file.name in message and "outside the storage roots" in message, message
        assert str(outside) not in message  # nothing about where the link points
        assert leftovers(target) == []
    finally:
        server.stop()
