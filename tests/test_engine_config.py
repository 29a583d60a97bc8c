"""The engine's one configuration (`converters.config.EngineConfig`): built from the `CKPT_*` variables by one
function, carried as one JSON document, installed with `use`, read below the entry points with `current()`."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextvars import copy_context
from pathlib import Path

import pytest

from converters.config import (
    ENV_VARS,
    ContextPool,
    ContextThread,
    EngineConfig,
    PickleLimits,
    current,
    install,
    use,
)
from converters.errors import OptionError

ROOT = Path(__file__).resolve().parents[1]

#: variable -> (text, the value it sets, read back from the config)
GOOD = {
    "CKPT_EXECUTOR": ("ray", lambda c: c.executor, "ray"),
    "CKPT_RAY_ADDRESS": ("ray://head:10001", lambda c: c.ray_address, "ray://head:10001"),
    "CKPT_CONFINE_READS": ('["/data/a", "s3://bucket/b", " "]', lambda c: c.read_roots, ("/data/a", "s3://bucket/b")),
    "CKPT_MAX_METADATA_BYTES": ("300", lambda c: c.max_metadata_bytes, 300),
    "CKPT_UPLOAD_PARALLEL": (" 2 ", lambda c: c.upload_parallel, 2),
    "CKPT_RAY_PART_BYTES": ("1", lambda c: c.ray_part_bytes, 1),
    "CKPT_MAX_PICKLE_BYTES": ("11", lambda c: c.pickle.max_bytes, 11),
    "CKPT_MAX_PICKLE_MEMO": ("12", lambda c: c.pickle.max_memo, 12),
    "CKPT_MAX_PICKLE_OBJECTS": ("13", lambda c: c.pickle.max_objects, 13),
    "CKPT_MAX_PICKLE_SHARED": ("14", lambda c: c.pickle.max_shared, 14),
    "CKPT_MAX_PICKLE_DEPTH": ("15", lambda c: c.pickle.max_depth, 15),
    "CKPT_MAX_PICKLE_MEMORY": ("16", lambda c: c.pickle.max_memory, 16),
}


def test_every_variable_is_covered() -> None:
    assert set(GOOD) == set(ENV_VARS)


@pytest.mark.parametrize("var", sorted(GOOD))
def test_from_env_reads_each_variable(var: str) -> None:
    text, read, expected = GOOD[var]
    config = EngineConfig.from_env({var: text})
    assert read(config) == expected
    # nothing else moved from its default
    others = {k: getattr(config, k) for k in ("executor", "ray_address", "read_roots", "max_metadata_bytes",
                                              "upload_parallel", "ray_part_bytes")}
    changed = {k for k, v in others.items() if v != getattr(EngineConfig(), k)}
    changed |= {f"pickle.{k}" for k, v in vars(config.pickle).items() if v != getattr(PickleLimits(), k)}
    assert changed == {ENV_VARS[var]}


def test_from_env_defaults_and_single_root() -> None:
    assert EngineConfig.from_env({}) == EngineConfig()
    assert EngineConfig.from_env({k: "  " for k in ENV_VARS}) == EngineConfig()
    assert EngineConfig.from_env({"CKPT_CONFINE_READS": "/data/one"}).read_roots == ("/data/one",)
    assert EngineConfig() == EngineConfig(executor="local", ray_address="auto", read_roots=None,
                                          max_metadata_bytes=256 << 20, upload_parallel=4, ray_part_bytes=1 << 30,
                                          pickle=PickleLimits(max_bytes=1 << 30, max_memo=20_000_000,
                                                              max_objects=100_000_000, max_shared=10_000_000,
                                                              max_depth=100, max_memory=None))


BAD = [(var, text) for var in sorted(GOOD) if var not in ("CKPT_EXECUTOR", "CKPT_RAY_ADDRESS", "CKPT_CONFINE_READS")
       for text in ("0", "-3", "12MB", "x")]
BAD += [("CKPT_EXECUTOR", "slurm"), ("CKPT_CONFINE_READS", "[not json"), ("CKPT_CONFINE_READS", '["/a"')]


@pytest.mark.parametrize(("var", "text"), BAD)
def test_bad_value_is_one_line_naming_the_variable(var: str, text: str) -> None:
    with pytest.raises(OptionError) as caught:
        EngineConfig.from_env({var: text})
    message = str(caught.value)
    assert message.startswith(f"{var}") and "\n" not in message, message


def test_bad_values_say_what_to_give() -> None:
    with pytest.raises(OptionError, match=r"^CKPT_EXECUTOR=slurm: choose local or ray$"):
        EngineConfig.from_env({"CKPT_EXECUTOR": "slurm"})
    with pytest.raises(OptionError, match=r"^CKPT_UPLOAD_PARALLEL='0': give a positive whole number$"):
        EngineConfig.from_env({"CKPT_UPLOAD_PARALLEL": "0"})
    with pytest.raises(OptionError, match=r"^CKPT_CONFINE_READS: not a JSON list of roots$"):
        EngineConfig.from_env({"CKPT_CONFINE_READS": "[x"})


def test_json_round_trip() -> None:
    config = EngineConfig(executor="ray", ray_address="ray://h:10001", read_roots=("/a", "s3://b/c"),
                          max_metadata_bytes=7, pickle=PickleLimits(max_depth=500, max_memory=1 << 20),
                          upload_parallel=3, ray_part_bytes=9)
    text = config.to_json()
    assert EngineConfig.from_json(text) == config
    assert EngineConfig.from_json(EngineConfig().to_json()) == EngineConfig()
    assert EngineConfig.from_json('{"read_roots": ["/x"]}') == EngineConfig(read_roots=("/x",))


@pytest.mark.parametrize(("text", "expect"), [
    ("[1]", "expected a JSON object"),
    ("{", "not a JSON document"),
    ('{"threads": 4}', "unknown setting 'threads'"),
    ('{"executor": "slurm"}', "choose local or ray"),
    ('{"upload_parallel": 0}', "upload_parallel=0"),
    ('{"upload_parallel": true}', "upload_parallel=True"),
    ('{"read_roots": "/a"}', "read_roots: give a list"),
    ('{"pickle": {"max_depth": -1}}', "pickle.max_depth=-1"),
    ('{"pickle": {"depth": 1}}', "unknown limit 'depth'"),
])
def test_bad_documents_are_one_line(text: str, expect: str) -> None:
    with pytest.raises(OptionError) as caught:
        EngineConfig.from_json(text)
    assert expect in str(caught.value) and "\n" not in str(caught.value)


def test_current_is_the_defaults_not_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_EXECUTOR", "ray")
    monkeypatch.setenv("CKPT_MAX_PICKLE_DEPTH", "7")
    assert current() == EngineConfig()


def test_use_nests_restores_and_reaches_pool_threads() -> None:
    outer, inner = EngineConfig(upload_parallel=2), EngineConfig(upload_parallel=3)
    with use(outer):
        assert current() is outer
        with use(inner):
            assert current() is inner
            with ContextPool(2) as pool:
                assert pool.submit(current).result() is inner
            with ThreadPoolExecutor(1) as plain:  # a plain pool does not carry it: engine pools are ContextPools
                assert plain.submit(current).result() == EngineConfig()
        with use(None):  # None keeps the config in force
            assert current() is outer
        assert current() is outer
    assert current() == EngineConfig()


def test_install_reaches_what_the_entry_point_starts() -> None:
    """A process's entry point installs its config once: threads made after it (`ContextThread`, subclassed or
    with a target), asyncio tasks and the threads they hand work to all see it; a plain thread does not."""
    config = EngineConfig(upload_parallel=5)

    class Loop(ContextThread):
        def run(self) -> None:
            seen.append(current())

    async def request() -> EngineConfig:
        return await asyncio.to_thread(current)

    def entry() -> None:
        install(config)
        threads = [ContextThread(target=lambda: seen.append(current())), Loop(), threading.Thread(
            target=lambda: seen.append(current()))]
        for thread in threads:
            thread.start()
            thread.join()
        seen.append(asyncio.run(request()))

    seen: list[EngineConfig] = []
    copy_context().run(entry)  # this test's own context stays as it was
    assert seen == [config, config, EngineConfig(), config]
    assert current() == EngineConfig()


def test_execution_comes_from_the_config() -> None:
    from converters.plan import Execution

    assert Execution().resolve() == Execution("local", None)
    with use(EngineConfig(executor="ray", ray_address="ray://h:10001")):
        assert Execution().resolve() == Execution("ray", "ray://h:10001")
        assert Execution("local").resolve() == Execution("local", None)
    assert Execution(address="ray://x:1").resolve() == Execution("ray", "ray://x:1")


def test_pickle_limits_come_from_the_config() -> None:
    from converters.errors import FormatError
    from converters.unpickle import loads

    data = b"](" + b"K\x01" * 20 + b"e."
    assert loads(data, "x.pt") == [1] * 20
    with use(EngineConfig(pickle=PickleLimits(max_objects=5))), pytest.raises(FormatError, match="objects"):
        loads(data, "x.pt")


def test_no_engine_module_reads_the_environment() -> None:
    """Below the entry points nothing reads os.environ: the one builder is `EngineConfig.from_env`."""
    pattern = re.compile(r"os\.environ|os\.getenv|getenv\(|environ\[")
    readers = sorted(str(p.relative_to(ROOT / "converters")) for p in (ROOT / "converters").rglob("*.py")
                     if pattern.search(p.read_text()))
    assert readers == ["config.py"], readers


def test_settings_build_the_engine_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_service.service_errors import SettingsError
    from ckpt_service.settings import load
    from ckpt_service.worker import process_command

    monkeypatch.setenv("CKPT_MAX_PICKLE_DEPTH", "300")  # an engine variable: still honoured, through from_env
    settings = load(data_dir=str(tmp_path / "data"), read_roots=[str(tmp_path / "in")], executor="ray",
                    ray_address="ray://head:10001")
    config = settings.engine_config()
    assert config == EngineConfig(executor="ray", ray_address="ray://head:10001",
                                  read_roots=(str(tmp_path / "in"), str(tmp_path / "data")),
                                  pickle=PickleLimits(max_depth=300))
    assert settings.masked()["engine"] == config.to_dict()
    command = process_command(settings, "job", "db", "id", "1")
    assert EngineConfig.from_json(command[command.index("--engine-config") + 1]) == config
    monkeypatch.setenv("CKPT_MAX_PICKLE_DEPTH", "deep")
    with pytest.raises(SettingsError, match=r"^engine setting CKPT_MAX_PICKLE_DEPTH='deep': give a positive"):
        load(data_dir=str(tmp_path / "data"))


def test_cli_config_applies_ray_onto_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptctl.common import engine_config

    monkeypatch.setenv("CKPT_UPLOAD_PARALLEL", "2")
    with engine_config("ray://head:10001") as config:
        assert current() is config
        assert config == EngineConfig(executor="ray", ray_address="ray://head:10001", upload_parallel=2)
    with engine_config() as config:
        assert config == EngineConfig(upload_parallel=2)


def test_cli_bad_variable_is_one_line(tmp_path: Path) -> None:
    env = {"CKPT_MAX_PICKLE_DEPTH": "deep", "COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "ckptctl", "inspect", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error: CKPT_MAX_PICKLE_DEPTH='deep': give a positive whole number"
