"""An engine error names its option as data (`option`), in words no interface owns; the CLI shows the option's
flag in its place, REST the request field (`options.<name>`), and both report the same refusal."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpt_service.jobs import JobSpec
from ckpt_service.service import CkptService
from ckpt_service.service_errors import InvalidRequest
from ckpt_service.settings import Settings
from converters import ConvertOptions, OptionError


def test_the_engine_error_carries_its_option_and_no_flag() -> None:
    with pytest.raises(OptionError) as caught:
        ConvertOptions(memory_limit=1000)
    assert (str(caught.value), caught.value.option) == ("memory_limit must be at least 1MiB", "memory_limit")
    again = pickle.loads(pickle.dumps(caught.value))  # crosses to the job process and back
    assert (str(again), again.option) == ("memory_limit must be at least 1MiB", "memory_limit")
    assert again.said_as({"memory_limit": "--memory-limit"}.get) == "--memory-limit must be at least 1MiB"


def test_said_as_replaces_the_option_word_once_never_inside_a_path_and_each_named_option() -> None:
    flags = {"only": "--only", "include": "--include", "exclude": "--exclude"}.get
    exc = OptionError("/runs/only/ckpt: only model holds weights only", option="only")
    assert exc.said_as(flags) == "/runs/only/ckpt: --only model holds weights only"
    hint = OptionError("x: nothing selected (`only` model, `include`/`exclude`); `latest` is kept")
    assert hint.said_as(flags) == "x: nothing selected (--only model, --include/--exclude); `latest` is kept"
    assert OptionError("no option here").said_as(flags) == "no option here"


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "data" / "model.safetensors"
    path.parent.mkdir()
    save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}, str(path))
    return path


@pytest.mark.parametrize(("flags", "line"), [
    (["--memory-limit", "1000"], "--memory-limit must be at least 1MiB"),
    (["--rename", "no-equals"], "--rename 'no-equals': expected REGEX=REPLACEMENT"),
])
def test_the_cli_says_the_flag(source: Path, tmp_path: Path, flags: list[str], line: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "ckptctl", "export", str(source), str(tmp_path / "out"), *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert line in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("options", "field", "message"), [
    ({"memory_limit": "1000"}, "options.memory_limit", "options.memory_limit must be at least 1MiB"),
    ({"rename": ["no-equals"]}, "options.rename", "options.rename 'no-equals': expected REGEX=REPLACEMENT"),
])
def test_rest_says_the_field(source: Path, tmp_path: Path, options: dict, field: str, message: str) -> None:
    data = source.parent
    settings = Settings(data_dir=tmp_path / "state", read_roots=[str(data)], write_roots=[str(data)])
    settings.prepare()
    spec = JobSpec.model_validate({"kind": "export", "source": str(source), "target": str(data / "out"),
                                   "options": options})
    with pytest.raises(InvalidRequest) as caught:
        CkptService(settings).normalise(spec)
    assert (caught.value.field, str(caught.value)) == (field, message)


def flag_mentions() -> list[str]:
    """Each engine error message (a `...Error(...)` call's text in converters/) that names a CLI flag; Megatron's
    own `--ckpt-format` is a flag of Megatron, not of ours."""
    import ast
    import re

    flag = re.compile(r"(?<![\w-])--(?!ckpt-format)[a-z][a-z-]+")
    root = Path(__file__).resolve().parents[1]
    found = []
    for path in sorted((root / "converters").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "").endswith("Error"):
                texts = [c.value for arg in node.args for c in ast.walk(arg)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                if any(flag.search(text) for text in texts):
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_engine_errors_name_options_not_flags() -> None:
    # a ratchet: the ones left are in modules other work is moving (targets, transforms, sidefiles, adapters)
    assert len(flag_mentions()) <= 6, flag_mentions()
