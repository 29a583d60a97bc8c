"""Above the engine, code reaches `converters` only through its public names (`converters.__all__`); the layer
order itself (ckptctl > api > ckpt_service > converters) is `lint-imports`' contract in pyproject.toml."""

from __future__ import annotations

import ast
from pathlib import Path

import converters

ROOT = Path(__file__).resolve().parents[1]
ABOVE_ENGINE = ("ckpt_service", "api", "ckptctl")


def engine_imports_past_all(path: Path, root: Path = ROOT) -> list[str]:
    """Each import in `path` that names a converters submodule or a name converters does not export."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("converters.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("converters."):
                found.append(f"from {node.module} import ...")
            elif node.module == "converters":
                found += [f"from converters import {a.name}" for a in node.names if a.name not in converters.__all__]
    return [f"{path.relative_to(root)}:{line}" for line in found]


def test_service_api_and_cli_import_only_the_engines_public_names() -> None:
    files = [p for package in ABOVE_ENGINE for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 40
    assert [hit for path in files for hit in engine_imports_past_all(path)] == []


def test_every_public_name_resolves() -> None:
    assert sorted(set(converters.__all__)) == sorted(converters.__all__)
    missing = [name for name in converters.__all__ if getattr(converters, name, None) is None]
    assert missing == []


def test_the_check_sees_a_reach_past_the_public_names(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import converters.storage\nfrom converters.copier import DEFAULT_MEMORY_LIMIT\n"
                     "from converters import plan, CkptError\nfrom . import converters\n")
    assert engine_imports_past_all(probe, tmp_path) == [
        "probe.py:import converters.storage", "probe.py:from converters.copier import ...",
        "probe.py:from converters import plan"]
