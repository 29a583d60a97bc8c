"""Start-up: each `ckptctl` command imports only what it runs (structural, not timed).

The real CLI entry runs in a fresh interpreter on a tiny checkpoint made here with torch's own savers, then
reports what it imported: no torch on the offline paths of DCP and safetensors input (the closed unpickler
reads them), nothing of the service (HTTP app, job store, job models), and for an offline command none of
the other command modules and no other command than the one it runs; `--help` imports no command module at
all, and lists the commands (`ckptctl.listing.COMMANDS`) as the commands themselves say it. A heavy
top-level import added anywhere on these paths fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
import typer.main
from typer._click.utils import make_default_short_help  # typer vendors click

from ckptctl import MODULES, OFFLINE_COMMANDS, app
from ckptctl.listing import COMMANDS

#: never imported by an offline command on DCP or safetensors input, nor by `--help` (top-level packages)
HEAVY = {"torch", "numpy", "ml_dtypes", "safetensors", "fastapi", "starlette", "uvicorn", "httpx", "psycopg",
         "ray", "api", "sqlite3", "pydantic_settings", "prometheus_client"}
#: the service side of ckpt_service: job models, store, registry, server and workers
SERVICE = {"ckpt_service.jobs", "ckpt_service.store", "ckpt_service.registry", "ckpt_service.service",
           "ckpt_service.worker", "ckpt_service.settings", "ckpt_service.auth", "ckpt_service.webhooks",
           "ckpt_service.catalog"}
#: what an offline command with -q leaves alone on top: the other command modules, progress bars, rich help
NOT_OFFLINE = {"ckptctl.server_commands", "ckptctl.manage", "ckptctl.serving", "rich.progress",
               "typer.rich_utils"}

#: the torch and DCP writers (pickle and zip), which an export to safetensors never loads
OTHER_WRITERS = {"converters.picklewriter", "converters.zipwriter", "converters.writers.dcp",
                 "converters.writers.torchsave"}

RUN = """
import json, sys
sys.argv = ["ckptctl", *json.loads(sys.argv[1])]
from ckptctl import common, main
try:
    main()
except SystemExit as exc:
    code = exc.code
import typer.main
print(json.dumps({"code": code, "modules": sorted(sys.modules),
                  "commands": sorted(typer.main.get_command(common.app).commands)}))
"""


def run_cli(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", RUN, json.dumps(args)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def heavy_in(modules: list[str]) -> list[str]:
    return [m for m in modules if m.split(".")[0] in HEAVY or m in SERVICE]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A DCP checkpoint (model and optimizer state) and a safetensors file of the same weights."""
    root = tmp_path_factory.mktemp("startup")
    weights = {"layer.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
               "layer.bias": torch.tensor([0.5, -1.5, 2.25])}
    state = {"model": dict(weights), "optim": {"state": {"layer.weight": {"step": torch.tensor(1.0),
                                                                          "exp_avg": torch.ones(3, 4)}}}}
    dcp.save(state, checkpoint_id=str(root / "dcp"))
    safetensors.torch.save_file(weights, str(root / "model.safetensors"))
    return root / "dcp", root / "model.safetensors", weights


def test_export_builds_only_export_and_no_torch(tiny: tuple[Path, Path, dict], tmp_path: Path) -> None:
    src, _, weights = tiny
    got = run_cli("export", str(src), str(tmp_path / "out"), "-q")
    assert got["code"] == 0
    assert heavy_in(got["modules"]) == []
    assert [m for m in got["modules"] if m in NOT_OFFLINE] == []
    assert got["commands"] == ["export"]  # main built the command it runs, and no other (nor their flags)
    assert [m for m in got["modules"] if m in OTHER_WRITERS] == []  # a safetensors output needs no pickle writer
    assert "ckptctl.offline" in got["modules"]
    out = safetensors.torch.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(out) == sorted(weights)
    assert all(torch.equal(out[name], tensor) for name, tensor in weights.items())


@pytest.mark.parametrize("command", [
    ("inspect", "{dcp}"),
    ("convert", "{dcp}", "{out}/model.safetensors", "-q"),
    ("convert", "{dcp}", "{out}/model.pt", "--to", "torch", "-q"),
    ("reshard", "{dcp}", "{out}/dcp3", "--world-size", "3", "-q"),
    ("export", "{st}", "{out}/export", "-q"),
    ("inspect", "{st}", "--json"),
])
def test_offline_commands_import_no_torch_nor_service(command: tuple[str, ...], tiny: tuple[Path, Path, dict],
                                                      tmp_path: Path) -> None:
    src, st, _ = tiny
    args = [arg.format(dcp=src, st=st, out=tmp_path) for arg in command]
    got = run_cli(*args)
    assert got["code"] == 0, args
    assert heavy_in(got["modules"]) == []
    assert [m for m in got["modules"] if m in NOT_OFFLINE] == []
    assert "ckptctl.offline" in got["modules"]


def test_help_lists_every_command_without_building_one() -> None:
    got = run_cli("--help")
    assert got["code"] == 0
    assert heavy_in(got["modules"]) == []
    assert got["commands"] == []  # the listing (`listing.COMMANDS`) is all it shows
    assert {f"ckptctl.{name}" for name in MODULES} & set(got["modules"]) == set()
    assert {"ckpt_service.job_requests", "ckpt_service.job_kinds", "pydantic"} & set(got["modules"]) == set()
    assert list(COMMANDS) == list(typer.main.get_command(app).commands)  # every command, in the package's order
    assert {"submit", "jobs", "serve", "worker", "checkpoints"} | OFFLINE_COMMANDS <= set(COMMANDS)


#: the help of `ckptctl ARGS` for each ARGS in argv[2], as `ckptctl` prints it to a pipe, from `ckptctl.app` with
#: the modules in argv[1] imported
HELP = """
import contextlib, io, json, os, sys
import ckptctl
from ckptctl import common
ckptctl.load(tuple(json.loads(sys.argv[1])))
texts = []
for args in json.loads(sys.argv[2]):
    for width in ("80", "200"):
        os.environ["COLUMNS"] = width
        with contextlib.redirect_stdout(io.StringIO()) as text:
            code = common.app(args, prog_name="ckptctl", standalone_mode=False)
        texts.append([args, width, code, text.getvalue()])
print(json.dumps(texts))
"""


def help_texts(modules: tuple[str, ...], commands: list[list[str]]) -> list[list]:
    proc = subprocess.run([sys.executable, "-c", HELP, json.dumps(modules), json.dumps(commands)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_listing_reads_as_the_commands_say_it() -> None:
    """`ckptctl --help` from the listing alone is the help of the package with every command built, at any width."""
    every = help_texts(MODULES, [["--help"]])
    for _, width, code, text in every:
        proc = subprocess.run([sys.executable, "-m", "ckptctl", "--help"], capture_output=True, text=True,
                              timeout=60, env={**os.environ, "COLUMNS": width, "TERM": "dumb"})
        assert (proc.returncode, proc.stdout) == (code, text), width


def test_each_summary_is_what_click_shows_of_the_help() -> None:
    """A command's one-line help, shortened to any width, reads the same from its summary as from its help."""
    for name, command in typer.main.get_command(app).commands.items():  # type: ignore[attr-defined]
        for width in range(10, 400, 3):
            assert make_default_short_help(COMMANDS[name].summary, width) == command.get_short_help_str(width), name


@pytest.mark.parametrize("modules", sorted({entry.modules for entry in COMMANDS.values()}))
def test_each_command_is_made_by_its_listed_modules(modules: tuple[str, ...]) -> None:
    """The modules `listing.COMMANDS` names for a command make all of it: its help (and a group's, each
    sub-command's) with only those imported is the one the package with every module gives."""
    names = [name for name, entry in COMMANDS.items() if entry.modules == modules]
    full = typer.main.get_command(app).commands
    args = [[name, "--help"] for name in names]
    args += [[name, sub, "--help"] for name in names for sub in getattr(full[name], "commands", ())]
    assert help_texts(modules, args) == help_texts(MODULES, args)


def test_importing_converters_loads_only_its_errors() -> None:
    code = "import sys, converters; print(sorted(m for m in sys.modules if m.startswith('converters')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert proc.stdout.strip() == "['converters', 'converters.errors']"


def test_converters_public_names_resolve_and_name_no_submodule() -> None:
    import converters.resharding  # binds the submodules on the package, the way any importer would
    import converters.verification
    from converters import formats, operations

    assert converters.reshard is converters.resharding.reshard and converters.verify is operations.verify
    assert converters.VerifyReport is converters.verification.VerifyReport
    assert converters.inspect is operations.inspect and converters.READERS is formats.READERS
    assert all(getattr(converters, name) is not None for name in converters.__all__)
    assert set(converters.__all__) <= set(dir(converters))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        converters.nothing  # noqa: B018


#: every package `ckptctl inspect` of a DCP checkpoint may import beyond the standard library and what the
#: interpreter itself loads at start-up (its site hooks): the CLI toolkit, the request models' validation, the
#: console, CRC-32, and our three packages
INSPECT_PACKAGES = {"typer", "shellingham", "annotated_doc", "rich", "pydantic", "pydantic_core", "annotated_types",
                    "typing_extensions", "typing_inspection", "isal", "ckptctl", "ckpt_service", "converters"}
#: the modules of ours it may import: the offline command, the job kinds and their engine calls, the engine's
#: readers; no writer but the output's common parts, nothing of the service
INSPECT_OURS = {"ckptctl", "ckptctl.common", "ckptctl.flags", "ckptctl.listing", "ckptctl.offline", "ckpt_service",
                "ckpt_service.service_errors", "ckpt_service.executor", "ckpt_service.helpers",
                "ckpt_service.job_kinds", "ckpt_service.archived", "ckpt_service.job_requests", "ckpt_service.logs",
                "ckpt_service.roots", "ckpt_service.summary", "ckpt_service.units"}
#: standard-library stacks an inspect has no use for (event loop, TLS, HTTP, SQLite, processes; pydantic's plugin
#: lookup, importlib.metadata, brings `email` and `socket`)
INSPECT_NEVER = {"asyncio", "ssl", "http", "sqlite3", "multiprocessing"}


def test_inspect_imports_only_the_listed_packages(tiny: tuple[Path, Path, dict]) -> None:
    """The whole import list of `ckptctl inspect` (structural: a new top-level import on this path is a
    decision, made here, not an accident found in a benchmark)."""
    start = subprocess.run([sys.executable, "-c", "import sys, json; print(json.dumps(sorted(sys.modules)))"],
                           capture_output=True, text=True, timeout=60, check=True)
    at_start = {m.split(".")[0] for m in json.loads(start.stdout)}
    got = run_cli("inspect", str(tiny[0]))
    assert got["code"] == 0
    tops = {m.split(".")[0] for m in got["modules"] if not m.startswith("_")}  # `_sysconfigdata…`: sysconfig's
    tops -= at_start | set(sys.stdlib_module_names)
    assert tops <= INSPECT_PACKAGES, sorted(tops - INSPECT_PACKAGES)
    ours = {m for m in got["modules"] if m.split(".")[0] in ("ckptctl", "ckpt_service")}
    assert ours <= INSPECT_OURS, sorted(ours - INSPECT_OURS)
    assert not {m.split(".")[0] for m in got["modules"]} & INSPECT_NEVER
