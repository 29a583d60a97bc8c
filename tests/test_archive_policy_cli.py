"""`ckptctl policies add --action archive --store` and `ckptctl gc` against a real `ckptctl serve`: the plan says what
is archived first, the run archives then deletes, and the report keeps freed and archive-stored bytes apart; a
single-file output's manifest beside it goes with it. Checkpoints are written by torch's dcp.save and converted by
the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_service.units import human
from converters import ConvertOptions, convert
from converters.names import MANIFEST
from tests.conftest import ckptctl
from tests.service_harness import make_server


def step(folder: Path, n: int) -> Path:
    """A DCP step whose frozen tensor every step shares (so the archive stores it once)."""
    torch.manual_seed(n)
    dcp.save({"frozen": torch.ones(128, 128), "w": torch.randn(32, 32), "step": torch.tensor(n)},
             checkpoint_id=str(folder), no_dist=True)
    return folder


def disk(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
def test_an_archive_policy_from_the_cli_archives_then_deletes_and_gc_reports_bytes_apart(tmp_path: Path) -> None:
    runs, exports = tmp_path / "runs", tmp_path / "exports"
    steps = [step(runs / "r" / f"step_{n}", n) for n in (1, 2, 3)]
    single = exports / "one" / "model.safetensors"
    convert(str(steps[2]), str(single), ConvertOptions(to="safetensors"))
    beside = single.parent / f"{single.name}.{MANIFEST}"
    assert beside.is_file()
    store = exports / "archive"
    server = make_server(tmp_path / "data", read_roots=[runs, exports], write_roots=[runs, exports], workers=1,
                         extra_env={"CKPT_DISCOVER_SECONDS": "0", "CKPT_GC_SECONDS": "0"}).start()
    try:
        def cli(*args: str) -> str:
            return ckptctl(*args, "--server", server.url).stdout

        for path in [*steps, single]:
            cli("checkpoints", "register", str(path))
        cli("policies", "add", "cold", "--run", "r", "--keep-last", "1", "--action", "archive", "--store", str(store))
        cli("policies", "add", "ones", "--prefix", str(exports / "one"), "--keep-last", "0")
        sizes = {p: disk(p) for p in steps[:2]}
        moved, freed = sum(sizes.values()), sum(sizes.values()) + single.stat().st_size
        dry = json.loads(cli("gc", "--dry-run", "--json"))
        assert (dry["bytes"], dry["archived_bytes"], dry["archive_stored_bytes"]) == (freed, moved, 0)
        text = cli("gc", "--dry-run").splitlines()
        assert [line.split("  ")[0] for line in text[:-1]] == [  # the plan is in URI order
            f"would delete {single}", f"would archive, then delete {steps[0]}",
            f"would archive, then delete {steps[1]}"]
        assert text[-1] == f"3 checkpoint(s), {human(freed)} ({human(moved)} of it archived first)"

        report = cli("gc").splitlines()
        assert [line.split("  ")[0] for line in report[:-1]] == [
            f"deleted {single}", f"archived, then deleted {steps[0]}", f"archived, then deleted {steps[1]}"]
        assert not steps[0].exists() and not steps[1].exists() and steps[2].exists()
        assert not single.exists() and not beside.exists() and list(single.parent.iterdir()) == []
        listed = json.loads(cli("checkpoints", "list", "--json"))["items"]
        archived = {c["uri"]: c for c in listed}
        assert str(steps[2]) in archived and archived[str(steps[2])]["archives"] == []
        restorable = json.loads(cli("checkpoints", "list", "--archived", "--json"))["items"]
        with server.http() as http:  # the flag asks what the API's filter answers
            assert restorable == http.get("/v1/checkpoints", params={"archived": "true"}).json()["items"]
        added = sum(c["archives"][0]["new_stored_bytes"] for c in restorable)
        assert sorted(c["uri"] for c in restorable) == [str(steps[0]), str(steps[1])]
        header, *lines = [line.split("\t") for line in cli("checkpoints", "list", "--archived").splitlines()]
        rows = {cells[0]: dict(zip(header, cells, strict=True)) for cells in lines}
        assert sorted(rows) == sorted(c["id"] for c in restorable)
        for c in restorable:  # the table: files deleted, the store and archive id, its stored bytes
            (archive,) = c["archives"]
            assert {k: rows[c["id"]][k] for k in ("uri", "files", "archived in", "stored")} == {
                "uri": c["uri"], "files": "deleted", "archived in": f"{archive['store']} ({archive['archive_id']})",
                "stored": human(archive["stored_bytes"])}
        assert report[-1] == (f"3 checkpoint(s), {human(freed)} ({human(moved)} of it archived first, adding "
                              f"{human(added)} to the archive stores)")
    finally:
        server.stop()
