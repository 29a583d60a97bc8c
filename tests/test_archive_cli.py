"""The archive tier from the command line: `ckptctl archive SRC STORE`, `archives STORE`, `restore STORE ID
TARGET` (byte for byte), `archive-gc STORE`; a damaged chunk is one line naming it (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from ckptctl import app as cli

ENV = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1"}


def ckptctl(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=ENV)
    return result.exit_code, result.output


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_archive_list_restore_and_gc(tmp_path: Path) -> None:
    torch.manual_seed(0)
    frozen = torch.randn(64, 64)
    for step in (1, 2):  # the frozen tensor is stored once across the two steps
        dcp.save({"model": {"frozen": frozen, "moving": torch.randn(32, 32) * step}},
                 checkpoint_id=str(tmp_path / f"step{step}"))
    store = tmp_path / "store"
    ids = []
    for step in (1, 2):
        code, output = ckptctl("archive", str(tmp_path / f"step{step}"), str(store), "--json")
        assert code == 0, output
        ids.append(json.loads(output)["archive_id"])
    code, output = ckptctl("archives", str(store), "--json")
    assert code == 0 and sorted(a["id"] for a in json.loads(output)) == sorted(ids)
    code, output = ckptctl("restore", str(store), ids[1], str(tmp_path / "back"))
    assert code == 0, output
    assert files(tmp_path / "back") == files(tmp_path / "step2")
    code, output = ckptctl("archive-gc", str(store), "--grace", "0")
    assert code == 0 and "deleted 0 chunk(s)" in output  # every chunk is still used
    chunk = next(p for p in (store / "chunks").rglob("*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    broken = [ckptctl("restore", str(store), archive_id, str(tmp_path / f"again-{archive_id}"))
              for archive_id in ids]
    failed = [(archive_id, out) for archive_id, (code, out) in zip(ids, broken, strict=True) if code != 0]
    assert failed and all(len(out.strip().splitlines()) == 1 and chunk.name in out for _, out in failed)
    assert all(code in (0, 2) for code, _ in broken)
    assert not any((tmp_path / f"again-{archive_id}").exists() for archive_id, _ in failed)  # nothing half-written
