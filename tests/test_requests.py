"""The request models (one per job kind): wire compatibility, defaults, the CLI flags generated from them,
the service's checks, and the executor's engine call run in-process on real small checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import typer.main
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from ckpt_service.executor import engine_call, key_options
from ckpt_service.job_kinds import kind_of
from ckpt_service.job_requests import APPLIES, REQUESTS, KeyedRequest, build, flag_of
from ckpt_service.jobs import JobOptions, JobSpec, request_of
from ckpt_service.service import CkptService
from ckpt_service.service_errors import InvalidRequest
from ckpt_service.settings import Settings
from ckptctl import app
from converters.errors import OptionError, VerifyError

#: The options each kind took before the request models (the REST wire format): must not change.
WIRE = {
    "convert": {"source_format", "to", "only", "clean_keys", "rename", "include", "exclude", "dtype",
                "max_shard_size", "memory_limit", "overwrite", "drop_tied", "verify"},
    "export": {"source_format", "only", "clean_keys", "rename", "include", "exclude", "dtype", "max_shard_size",
               "memory_limit", "overwrite", "drop_tied", "verify", "to_hf"},  # to_hf: added with the Megatron reader
    "reshard": {"source_format", "only", "clean_keys", "rename", "include", "exclude", "dtype", "dtype_optim",
                "memory_limit", "overwrite", "verify", "world_size", "layout", "shard_dim_rule"},
    "verify": {"source_format", "target_format", "only", "clean_keys", "rename", "include", "exclude",
               "memory_limit", "atol", "rtol"},
    "inspect": {"source_format", "tensors"},
}
for _kind in ("convert", "export", "reshard", "inspect"):  # added with the DeepSpeed reader
    WIRE[_kind] |= {"tag", "weights"}
WIRE["export"] |= {"config_from"}  # added with the side files an export carries (config, tokenizer)
WIRE["export"] |= {"quantize", "ignore", "adapter_only", "merge_adapter", "base"}  # added with FP8 and adapter exports
WIRE["reshard"] |= {"output_layout"}  # added with the framework layouts a reshard keeps (Accelerate, Lightning)
WIRE["export"] |= {"gguf"}  # added with the GGUF export
WIRE["inspect"] |= {"stats"}  # added with per-tensor statistics, with the scan and diff kinds
WIRE["scan"] = {"source_format", "tag", "weights", "only", "clean_keys", "rename", "include", "exclude",
                "memory_limit"}
WIRE["diff"] = set(WIRE["verify"])
WIRE["import"] = {"family", "memory_limit", "overwrite"}  # added with the HF -> Megatron import
WIRE["import"] |= {"into", "world_size"}  # added with the HF -> FSDP2 DCP import
for _kind in ("convert", "export", "reshard"):  # added with the scan guard
    WIRE[_kind] |= {"require_finite"}
for _kind in ("convert", "export", "reshard"):  # added with bounds on statistics (guards)
    WIRE[_kind] |= {"require"}
for _kind in ("convert", "export", "reshard"):  # added with conversion certificates
    WIRE[_kind] |= {"stats"}
WIRE["verify"] |= {"certificate"}  # verify --certificate OUT
WIRE["scrub"] = {"memory_limit"}
WIRE["archive"] = WIRE["restore"] = {"archive_id"}  # added with the archive tier's job kinds
EXTRAS = {"quiet", "as_json", "wait", "callback_url", "idempotency_key", "server", "token",
          "ray"}  # offline --ray ADDRESS: the Ray executor for this run


def test_each_kind_takes_the_options_it_always_took() -> None:
    assert {kind: set(names) for kind, names in APPLIES.items()} == WIRE
    assert set(JobOptions.model_fields) == set().union(*WIRE.values())


def test_defaults_per_kind() -> None:
    requests = {kind: build(kind, {"world_size": 2} if kind == "reshard" else {})
                for kind in ("convert", "export", "reshard", "verify")}
    keys = {kind: (r.only, r.clean_keys, key_options(r).clean) for kind, r in requests.items()  # type: ignore[attr-defined, arg-type]
            if isinstance(r, KeyedRequest)}
    # convert keeps keys as stored; reshard leaves it to the engine (kept for --only all, a training state);
    # export cleans them (a serving checkpoint)
    assert keys == {"convert": ("all", False, False), "export": ("model", True, True),
                    "reshard": ("all", None, False), "verify": ("all", True, True)}
    assert key_options(build("reshard", {"world_size": 2, "only": "all"})).clean is False  # type: ignore[arg-type]
    export = build("export", {})
    assert (export.max_shard_size, export.memory_limit) == (5 * 1000**3, 256 * 1024**2)  # type: ignore[attr-defined]
    sized = build("convert", {"max_shard_size": "100KB", "memory_limit": "64MiB"})
    assert (sized.max_shard_size, sized.memory_limit) == (100_000, 64 * 1024**2)  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="world_size"):
        build("reshard", {})
    with pytest.raises(ValidationError, match="unknown dtype 'int8'"):
        build("export", {"dtype": "int8"})


def test_key_options_map_every_field() -> None:
    request = build("export", {"clean_keys": False, "rename": ["^layers=blocks"], "include": ["*.weight"],
                               "exclude": ["*.bias"], "only": "all"})
    keys = key_options(request)  # type: ignore[arg-type]
    assert (keys.only, keys.clean, keys.renames, keys.include, keys.exclude) == (
        "all", False, [("^layers", "blocks")], ["*.weight"], ["*.bias"])
    with pytest.raises(OptionError, match=r"^rename 'no-equals-sign': expected REGEX=REPLACEMENT$") as caught:
        key_options(build("export", {"rename": ["no-equals-sign"]}))  # type: ignore[arg-type]
    assert caught.value.option == "rename"


@pytest.mark.parametrize("group", ["", "submit"])
def test_cli_flags_are_the_model_fields(group: str) -> None:
    """Every option has a flag and every flag an option, on the offline and the submit commands."""
    root = typer.main.get_command(app)
    commands = root.commands[group].commands if group else root.commands  # type: ignore[attr-defined]
    for kind, model in REQUESTS.items():
        if not group and not kind_of(kind).offline:
            continue  # archive and restore have their own offline commands (ckptctl/offline.py)
        command = commands[kind]
        options = {p.name: p for p in command.params if p.param_type_name == "option"}
        assert set(options) - EXTRAS - {"help"} == set(model.model_fields), kind
        for name in model.model_fields:
            declared = flag_of(model, name).decls[0].split("/")
            assert declared[0] in options[name].opts, (kind, name)
            assert declared[1:] == options[name].secondary_opts[:len(declared) - 1], (kind, name)


def test_spec_options_become_the_kinds_request() -> None:
    spec = JobSpec.model_validate({"kind": "verify", "source": "/a", "target": "/b",
                                   "options": {"atol": 0.5, "source_format": "dcp", "clean_keys": None}})
    request = request_of(spec.kind, spec.options)
    assert request.model_dump() == {**build("verify", {}).model_dump(), "atol": 0.5, "source_format": "dcp"}
    # a stored spec written with every option present (null for another kind's) reads back the same
    stored = JobSpec.model_validate({**spec.model_dump(mode="json")})
    assert request_of(stored.kind, stored.options) == request


@pytest.fixture
def service(tmp_path: Path) -> CkptService:
    data = tmp_path / "data"
    data.mkdir()
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(data)], write_roots=[str(data)])
    settings.prepare()
    return CkptService(settings)


def test_service_refuses_stray_options_missing_ones_and_overlap(service: CkptService, tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "run").mkdir()

    def refused(spec: dict) -> InvalidRequest:
        with pytest.raises(InvalidRequest) as caught:
            service.normalise(JobSpec.model_validate(spec))
        return caught.value

    stray = refused({"kind": "export", "source": str(data / "run"), "target": str(data / "x"),
                     "options": {"world_size": 2}})
    assert (stray.field, str(stray)) == ("options.world_size", "options.world_size: does not apply to export jobs")
    missing = refused({"kind": "reshard", "source": str(data / "run"), "target": str(data / "x")})
    assert (missing.field, str(missing)) == ("options.world_size", "options.world_size: required for reshard jobs")
    for source, target in ((data / "run", data / "run" / "out"), (data / "run" / "step", data / "run"),
                           (data / "run", data / "run")):
        overlap = refused({"kind": "export", "source": str(source), "target": str(target)})
        assert (overlap.field, "overlap the source" in str(overlap)) == ("target", True), (source, target)
    beside = service.normalise(JobSpec.model_validate({"kind": "export", "source": str(data / "run"),
                                                       "target": str(data / "run-export")}))
    # the queued spec shows every option of the kind, defaults filled in
    shown = beside.options.model_dump()
    assert {name: shown[name] for name in APPLIES["export"]} == build("export", {}).model_dump()


def small_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors = {"layers.0.weight": torch.arange(24, dtype=torch.float32).reshape(6, 4),
               "layers.0.bias": torch.linspace(-1, 1, 6), "step": torch.tensor(7, dtype=torch.int64)}
    save_file(tensors, path)
    return tensors


def test_engine_calls_run_in_process(tmp_path: Path) -> None:
    source = tmp_path / "m.safetensors"
    tensors = small_checkpoint(source)
    exported = engine_call(build("export", {"rename": [r"^layers\.=blocks."]}), str(source), str(tmp_path / "e"))(
        None)
    assert [name for name, _ in exported.outputs] == ["model.safetensors"]
    got = load_file(tmp_path / "e" / "model.safetensors")
    assert sorted(got) == ["blocks.0.bias", "blocks.0.weight", "step"]
    assert torch.equal(got["blocks.0.weight"], tensors["layers.0.weight"]) and got["step"].item() == 7
    resharded = engine_call(build("reshard", {"world_size": 2}), str(source), str(tmp_path / "r"))(None)
    assert resharded.world_size == 2 and (tmp_path / "r" / ".metadata").is_file()
    same = engine_call(build("verify", {"only": "model"}), str(source), str(tmp_path / "r"))(None)
    assert same.ok
    save_file({**tensors, "layers.0.bias": tensors["layers.0.bias"] + 1}, tmp_path / "changed.safetensors")
    with pytest.raises(VerifyError) as differ:
        engine_call(build("verify", {}), str(source), str(tmp_path / "changed.safetensors"))(None)
    assert differ.value.report is not None and not differ.value.report.ok
    assert list(differ.value.report.max_abs_diff) == ["layers.0.bias"]
    info = engine_call(build("inspect", {"tensors": True}), str(source))(None)
    assert (info["format"], info["tensors"]) == ("safetensors", 3)
