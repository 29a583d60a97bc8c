"""The deployment files stay true without a Docker engine: docker/Dockerfile passes hadolint, docker/compose.yaml
is valid Compose and matches the image, and the image's own install and start-up steps, read from the Dockerfile
and compose.yaml and run in a fresh virtual environment, give a service that answers /healthz and runs jobs.

The one difference from a real build: torch comes from pip's configured index (here the wheel on local disk)
instead of TORCH_INDEX_URL, which CI cannot reach; the version is the Dockerfile's TORCH_VERSION.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml

from ckpt_service import migrations
from ckpt_service.helpers import free_port
from ckpt_service.settings import Settings

from .deploy_files import (
    Dockerfile,
    DockerIgnore,
    commented_keys,
    copy_context,
    healthcheck_command,
    interpolate,
    read_env_file,
    variables,
)

pytestmark = pytest.mark.slow  # real FSDP samples, servers or containers: the full suite (CI), not the edit loop

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
COMPOSE = DOCKER / "compose.yaml"
ENV_EXAMPLE = DOCKER / ".env.example"
#: The Compose Specification schema, unmodified, from the PyPI package ecs-composex 1.1.9
#: (ecs_composex/specs/compose-spec.json; the compose-spec project's schema, Apache-2.0).
COMPOSE_SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"
COMPOSE_SCHEMA_SHA256 = "a85a0e558502b7fec90b3ad4095d721e31749e9a305b1d80e09c1e64f939b92d"
API_PORT = "8080"


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return Dockerfile.read(DOCKERFILE)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


# -- Dockerfile ----------------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint_with_only_justified_ignores(tmp_path: Path) -> None:
    config = tmp_path / "hadolint.yaml"
    config.write_text("{}\n")  # no ignored rules and the strictest threshold, whatever config lies around
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    proc = subprocess.run(["hadolint", "--config", str(config), "--failure-threshold", "style", "--format", "json",
                           str(DOCKERFILE)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"
    assert json.loads(proc.stdout or "[]") == []
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.search(r"hadolint\s+(global\s+)?ignore", line, re.I):
            assert "global" not in line.lower(), f"line {number + 1}: ignore rules where needed, not globally"
            before = lines[number - 1].strip() if number else ""
            assert before.startswith("#") and "hadolint" not in before and len(before) > 10, \
                f"line {number + 1}: say why the rule is ignored in a comment on the line above"


def test_dockerfile_shape(dockerfile: Dockerfile) -> None:
    build, runtime = dockerfile.stage("build"), dockerfile.final
    assert len(dockerfile.stages) >= 2 and runtime.name == "runtime"
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", dockerfile.global_args["PYTHON_IMAGE"])
    assert build.base == runtime.base == dockerfile.global_args["PYTHON_IMAGE"]
    args = build.arg_defaults()
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu" and re.fullmatch(r"\d+\.\d+\.\d+",
                                                                                             args["TORCH_VERSION"])
    # the build stage copies the package and the install script, never tests or benchmarks
    sources = [src for srcs, _, _ in build.copies() for src in srcs]
    assert "docker/install.sh" in sources and not any(s.startswith(("tests", "benchmarks", ".")) for s in sources)
    # the runtime stage takes only the venv from the build stage
    assert [(srcs, dest, flags) for srcs, dest, flags in runtime.copies()] == [(["/opt/venv"], "/opt/venv",
                                                                                 {"from": "build"})]
    user = runtime.one("USER").text
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), "run as a numeric non-root uid (Kubernetes' runAsNonRoot)"
    assert runtime.instructions.index(runtime.one("USER")) > max(runtime.instructions.index(i)
                                                                 for i in runtime.all("RUN"))
    env = runtime.env({"PATH": "/usr/bin"})
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert runtime.one("VOLUME").json() == [env["CKPT_DATA_DIR"]]
    assert runtime.one("EXPOSE").text == API_PORT
    assert not any(k in env for k in ("CKPT_TOKENS", "CKPT_TOKEN", "AWS_SECRET_ACCESS_KEY")), "no secrets in images"
    assert runtime.one("ENTRYPOINT").json() == ["ckptctl"]
    assert runtime.one("CMD").json() == ["serve", "--host", "0.0.0.0", "--port", API_PORT]
    options, command = healthcheck_command(runtime.one("HEALTHCHECK"))
    assert command[:2] == ["python", "-c"] and f"http://127.0.0.1:{API_PORT}/healthz" in command[2]
    assert {"interval", "timeout", "retries"} <= set(options)


def test_dockerignore_keeps_the_build_context_to_the_package(dockerfile: Dockerfile) -> None:
    ignore = DockerIgnore.read(ROOT / ".dockerignore")
    for path in (".git/HEAD", ".venv/bin/python", "venv/lib/x.py", "bench-out/run/model.safetensors",
                 "samples/fsdp/__0_0.distcp", "tests/test_deploy.py", "benchmarks/bench_convert.py",
                 "converters/__pycache__/api.cpython-311.pyc", "ckpt_service.egg-info/PKG-INFO", ".pytest_cache/x",
                 ".ruff_cache/x", "build/lib/api/app.py", "docker/.env", "ckpt_service/step.safetensors", "x.pt"):
        assert ignore.excluded(path), f"{path} would be sent to the Docker daemon"
    files = ignore.context_files(ROOT)
    for srcs, _, flags in dockerfile.stage("build").copies():
        assert "from" not in flags
        for src in srcs:
            assert any(f == src or f.startswith(src + "/") for f in files), f"COPY {src}: not in the build context"
    assert {f.split("/")[0] for f in files} <= {"pyproject.toml", "README.md", "converters", "ckpt_service", "api",
                                                 "ckptctl", "docker"}


# -- compose.yaml -------------------------------------------------------------------------------------------


def test_compose_file_is_valid_against_the_compose_specification(compose: dict[str, Any]) -> None:
    assert hashlib.sha256(COMPOSE_SCHEMA.read_bytes()).hexdigest() == COMPOSE_SCHEMA_SHA256, "vendored unmodified"
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    wrong = {**compose, "services": {**compose["services"], "api": {**compose["services"]["api"], "port": [1]}}}
    assert list(validator.iter_errors(wrong)), "the schema catches a misspelt key"
    # as written, and as Compose sees it after interpolation with the documented defaults
    for document in (compose, interpolate(compose, read_env_file(ENV_EXAMPLE))):
        errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(document)]
        assert not errors, "\n".join(errors)


def test_compose_file_matches_the_image(compose: dict[str, Any], dockerfile: Dockerfile) -> None:
    services, runtime = compose["services"], dockerfile.final
    data_dir = runtime.env()["CKPT_DATA_DIR"]
    assert {"api", "worker"} <= set(services) and "profiles" not in services["api"]
    assert "profiles" not in services["worker"]
    assert set(compose["volumes"]) == {"data", "checkpoints", "pgdata"}
    assert services["postgres"]["profiles"] == ["scale"] and services["postgres"]["volumes"] == [
        "pgdata:/var/lib/postgresql/data"]
    for name in ("api", "worker"):
        service = services[name]
        assert f"data:{data_dir}" in service["volumes"], f"{name}: the job store must be on the named volume"
        build = service["build"]
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
        assert interpolate(build["args"], {}) == dockerfile.stage("build").arg_defaults(), "same defaults"
        assert service["init"] is True  # reaps the job processes' children
    api, worker = services["api"], services["worker"]
    assert api["environment"]["CKPT_WORKERS"] == "0" and "command" not in api
    assert [p.rsplit(":", 1)[1] for p in api["ports"]] == [runtime.one("EXPOSE").text]
    _, check = healthcheck_command(runtime.one("HEALTHCHECK"))
    assert api["healthcheck"]["test"] == ["CMD", *check]
    assert worker["command"] == ["worker"] and worker["deploy"]["replicas"] == 2
    assert worker["healthcheck"] == {"disable": True}
    assert worker["depends_on"]["api"]["condition"] == "service_healthy"
    assert {"s3", "s3-init"} <= set(services) and services["s3"]["profiles"] == services["s3-init"]["profiles"] == [
        "s3"]
    # every CKPT_ variable given to a container is a real setting (a typo would be ignored silently)
    fields = {f"CKPT_{name.upper()}" for name in Settings.model_fields}
    for name, service in services.items():
        unknown = {k for k in service.get("environment", {}) if k.startswith("CKPT_")} - fields
        assert not unknown, f"{name}: not ckpt-service settings: {unknown}"


def test_compose_configuration_is_documented_and_holds_no_secrets(compose: dict[str, Any]) -> None:
    text, example = COMPOSE.read_text(), ENV_EXAMPLE.read_text()
    documented = set(read_env_file(ENV_EXAMPLE)) | commented_keys(ENV_EXAMPLE)
    used = variables(text)
    assert used - documented == set(), f"used in compose.yaml but not in .env.example: {used - documented}"
    passthrough = {k for s in compose["services"].values() for k, v in s.get("environment", {}).items() if v is None}
    assert passthrough - documented == set(), f"passed through but not in .env.example: {passthrough - documented}"
    assert documented - used - passthrough == set(), f"documented but unused: {documented - used - passthrough}"
    for pattern in (r"sha256:[0-9a-f]{64}", r"ckpt_[A-Za-z0-9_-]{20,}", r"AKIA[0-9A-Z]{16}"):
        assert not re.search(pattern, text + example), f"something like a secret ({pattern}) in the files"
    assert read_env_file(ENV_EXAMPLE)["CKPT_TOKENS"] == ""
    for service in compose["services"].values():
        env = service.get("environment", {})
        for key in ("CKPT_TOKENS", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                    "CKPT_DATABASE_URL", "POSTGRES_PASSWORD"):
            assert env.get(key) in (None, f"${{{key}:-}}"), f"{key}: no credential or default for one in compose"
    assert subprocess.run(["git", "check-ignore", "-q", "docker/.env"], cwd=ROOT).returncode == 0, \
        "docker/.env holds local settings: keep it out of git"


# -- the image's steps, in a fresh virtual environment ----------------------------------------------------------


@dataclass
class Image:
    """The image's filesystem, laid out under `root`: image paths map to local ones through `local()`."""

    root: Path
    dockerfile: Dockerfile
    env: dict[str, str]  # the runtime stage's ENV, with paths mapped
    tokens: tuple[str, str]  # (token, CKPT_TOKENS entry)
    sample: Path

    def local(self, image_path: str) -> str:
        return re.sub(r"(?<![\w/])(/opt/venv|/src|/data|/checkpoints|/home/ckpt)(?=/|:|$)",
                      lambda m: str(self.root / m.group(1).lstrip("/")), image_path)

    @property
    def workdir(self) -> Path:
        return Path(self.local(self.dockerfile.final.workdir()))

    def command(self, args: list[str], env: dict[str, str], port: int | None = None) -> list[str]:
        """ENTRYPOINT + args as the container runs them, but on a loopback port, and with the venv's ckptctl."""
        entry = self.dockerfile.final.one("ENTRYPOINT").json()
        argv = [*entry, *args]
        if port is not None:
            assert argv[argv.index("--host") + 1] == "0.0.0.0" and argv[argv.index("--port") + 1] == API_PORT
            argv[argv.index("--host") + 1], argv[argv.index("--port") + 1] = "127.0.0.1", str(port)
        found = _which(argv[0], env["PATH"])
        assert found.startswith(self.local("/opt/venv/")), f"{argv[0]} resolved to {found}, not the image's venv"
        return [found, *argv[1:]]

    def run(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> str:
        env = env or self.env
        proc = subprocess.run(self.command(args, env), cwd=self.workdir, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, f"ckptctl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
        return proc.stdout


def _which(name: str, path: str) -> str:
    for folder in path.split(os.pathsep):
        candidate = os.path.join(folder, name)
        if os.access(candidate, os.X_OK):
            return candidate
    raise AssertionError(f"{name} not on PATH {path}")


def base_env() -> dict[str, str]:
    """This machine's environment, less anything that could make the venv see the repository or its settings."""
    drop = ("CKPT_", "PYTHON", "VIRTUAL_ENV", "AWS_", "HADOLINT_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    """Build stage: the build context as .dockerignore leaves it, the build stage's COPYs, then its RUN steps with
    its ARG defaults and ENV. Runtime stage: its ENV, the data dir and a token, as `docker run -e` would give."""
    started = time.monotonic()
    df = Dockerfile.read(DOCKERFILE)
    root = tmp_path_factory.mktemp("image")
    context = root / "context"
    copy_context(ROOT, DockerIgnore.read(ROOT / ".dockerignore").context_files(ROOT), context)
    image = Image(root, df, {}, ("", ""), root / "unused")
    build = df.stage("build")
    workdir = Path(image.local(build.workdir()))
    for sources, dest, _ in build.copies():
        target = Path(image.local(dest if dest.startswith("/") else os.path.join(build.workdir(), dest)))
        for src in sources:
            path = context / src
            into = target / path.name if dest.endswith("/") or len(sources) > 1 else target
            if path.is_dir():
                copy_context(path, DockerIgnore([]).context_files(path), into)
            else:
                into.parent.mkdir(parents=True, exist_ok=True)
                into.write_bytes(path.read_bytes())
                into.chmod(path.stat().st_mode)
    # CI cannot reach the torch index: pip's configured index serves the same release
    build_env = {**base_env(), **build.arg_defaults(), "TORCH_INDEX_URL": ""}
    build_env.update(build.env(build_env))
    for run in build.all("RUN"):
        argv = [image.local(word) for word in run.text.split()]
        proc = subprocess.run(argv, cwd=workdir, env=build_env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"RUN {run.text} (line {run.line}) failed:\n{proc.stdout[-3000:]}{proc.stderr}"
    runtime = df.final
    for srcs, dest, flags in runtime.copies():
        assert flags == {"from": "build"} and srcs == [dest] and os.path.isdir(image.local(dest))
    for folder in ("/data", "/checkpoints", runtime.workdir()):
        Path(image.local(folder)).mkdir(parents=True, exist_ok=True)
    base = base_env()
    image.env = {**base, "HOME": image.local("/home/ckpt"),
                 **{k: image.local(v) for k, v in runtime.env(base).items()}}
    where = subprocess.run([image.local("/opt/venv/bin/python"), "-c", "import ckpt_service; print(ckpt_service"
                            ".__file__)"], cwd=image.workdir, env=image.env, capture_output=True, text=True)
    assert where.stdout.startswith(image.local("/opt/venv/lib/")), f"the venv imports {where.stdout}{where.stderr}"
    made = json.loads(image.run(["token", "create", "--scope", "write", "--name", "deploy-test", "--json"]))
    image.tokens = (made["token"], made["entry"])
    image.sample = root / "sample"
    image.run(["sample", str(image.sample), "--world-size", "2", "--size", "tiny"])
    print(f"image venv and sample ready in {time.monotonic() - started:.0f} s")
    return image




@contextmanager
def process(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"no /healthz answer within {timeout} s:\n{log.read_text()[-3000:]}")


def submit_export(image: Image, url: str, source: str, target: str) -> dict[str, Any]:
    """`ckptctl submit export … --wait` from the image, as a client in another container would run it."""
    env = {**image.env, "CKPT_SERVER": url, "CKPT_TOKEN": image.tokens[0], "COLUMNS": "200"}
    out = image.run(["submit", "export", source, target, "--dtype", "bfloat16", "--wait", "--json"], env, 120)
    job = json.loads(out)
    assert job["state"] == "succeeded", job
    return job


def copy_sample(image: Image, image_path: str) -> None:
    copy_context(image.sample, DockerIgnore([]).context_files(image.sample), Path(image.local(image_path)))


def first_release_store(path: Path) -> None:
    """A job store as the first release wrote it (schema version 1), holding one finished job."""
    conn = sqlite3.connect(path, isolation_level=None)
    migrations.migrate(conn, str(path), upto=1)
    spec = json.dumps({"kind": "inspect", "source": "/data/old", "options": {}})
    conn.execute("INSERT INTO jobs (id, kind, state, spec, max_attempts, created_at, updated_at) "
                  "VALUES ('job_from_v1', 'inspect', 'succeeded', ?, 2, ?, ?)", (spec, time.time(), time.time()))
    conn.close()


@pytest.mark.timeout(400)
def test_image_default_command_serves_and_runs_a_job(image: Image) -> None:
    """`docker run -e CKPT_TOKENS=… -v <volume of an older release>:/data ckpt-service`: the store is migrated at
    start-up, then the API with its own job slots runs a job, with the data dir as the storage root."""
    port = free_port()
    env = {**image.env, "CKPT_TOKENS": image.tokens[1]}
    store = Path(env["CKPT_DATA_DIR"]) / "ckpt.db"
    first_release_store(store)
    argv = image.command(image.dockerfile.final.one("CMD").json(), env, port)
    log = image.root / "serve.log"
    with process(argv, env, image.workdir, log) as server:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, server, log)
        _, check = healthcheck_command(image.dockerfile.final.one("HEALTHCHECK"))
        probe = subprocess.run([_which(check[0], env["PATH"]), *check[1:-1], check[-1].replace(API_PORT, str(port))],
                               env=env, cwd=image.workdir, timeout=30)
        assert probe.returncode == 0, "the image's HEALTHCHECK command fails against a healthy server"
        assert httpx.get(f"{url}/v1/jobs", timeout=5).status_code == 401, "tokens are required"
        copy_sample(image, "/data/demo")
        job = submit_export(image, url, image.local("/data/demo"), image.local("/data/demo-export"))
        assert (Path(image.local("/data/demo-export")) / "model.safetensors").is_file()
        assert job["worker"].split(":")[1] == str(server.pid), "the server's own job slots ran it"
        old = httpx.get(f"{url}/v1/jobs/job_from_v1", headers={"Authorization": f"Bearer {image.tokens[0]}"}, timeout=5)
        assert old.status_code == 200 and old.json()["state"] == "succeeded", old.text
    conn = sqlite3.connect(store)
    assert conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == migrations.LATEST
    conn.close()


@pytest.mark.timeout(400)
def test_compose_api_and_worker_run_a_job(image: Image) -> None:
    """compose.yaml's api and worker services, with its environment (documented defaults and a token)."""
    project_env = {**read_env_file(ENV_EXAMPLE), "CKPT_TOKENS": image.tokens[1]}
    services = interpolate(yaml.safe_load(COMPOSE.read_text()), project_env)["services"]

    def service_env(name: str) -> dict[str, str]:
        given = {k: str(v) for k, v in services[name]["environment"].items() if v is not None}
        return {**image.env, **{k: image.local(v) for k, v in given.items()}}

    port = free_port()
    api_env, worker_env = service_env("api"), service_env("worker")
    api_args = services["api"].get("command", image.dockerfile.final.one("CMD").json())
    logs = image.root / "compose-api.log", image.root / "compose-worker.log"
    with (process(image.command(api_args, api_env, port), api_env, image.workdir, logs[0]) as api,
          process(image.command(services["worker"]["command"], worker_env), worker_env, image.workdir,
                  logs[1]) as worker):
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, api, logs[0])
        ready = httpx.get(f"{url}/readyz", timeout=5).json()
        assert ready["status"] == "ready" and ready["checks"]["workers"] == "none in this process"
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/readyz", timeout=5).json()["checks"].get("workers_seen", 0) < 1:
            assert time.monotonic() < deadline, f"the API never saw the worker:\n{logs[1].read_text()[-3000:]}"
            time.sleep(0.2)
        copy_sample(image, "/checkpoints/demo")
        job = submit_export(image, url, image.local("/checkpoints/demo"), image.local("/checkpoints/demo-export"))
        assert job["worker"].split(":")[1] == str(worker.pid), "the worker service ran it, not the API"
        assert (Path(image.local("/checkpoints/demo-export")) / "model.safetensors").is_file()
        assert worker.poll() is None, logs[1].read_text()[-3000:]
