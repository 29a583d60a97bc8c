"""The job-kind registry: a kind declared once (`ckpt_service.job_kinds`) is a REST kind with its options in the
schema, a dashboard choice, a `ckptctl submit` command with its flags, and a job the executor runs.

Adding a kind is proved by adding one: a fresh interpreter declares a tiny `echo` kind (its request model
and its engine function, nothing else), then submits it through the real app (TestClient), runs it with the
executor and reads the job back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_service import job_kinds
from ckpt_service.job_requests import APPLIES, REQUESTS, JobRequest
from ckpt_service.jobs import KINDS, WRITING_KINDS, Kind
from ckpt_service.rules import JobTemplate
from converters import dtypes

SCRIPT = r'''
import json, sys
from pathlib import Path
from typing import Annotated

from pydantic import Field

from ckpt_service import job_kinds
from ckpt_service.job_requests import JobRequest, flag


class EchoRequest(JobRequest):
    """Say a word back (a kind made by a test)."""

    word: Annotated[str, Field(min_length=1, max_length=20, description="What to say back."), flag("--word")] = "hello"


def echo_call(request, source, target):
    return lambda progress: {"echo": request.word, "source": source}


job_kinds.declare(job_kinds.JobKind("echo", EchoRequest, echo_call, job_kinds.as_is, arguments=(job_kinds.SOURCE,)))

from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from ckptctl import app as cli
from ckpt_service.executor import run_job
from ckpt_service.settings import Settings

root = Path(sys.argv[1])
source = root / "data" / "anything"
source.parent.mkdir()
source.write_bytes(b"x")
settings = Settings(data_dir=root / "state", read_roots=[str(root / "data")], write_roots=[str(root / "data")])
settings.prepare()
got = {}
with TestClient(create_app(settings)) as client:
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    got["kinds"] = schema["JobSpec"]["properties"]["kind"]["enum"]
    got["word"] = schema["JobOptions"]["properties"]["word"]
    got["template_kinds"] = schema["JobTemplate"]["properties"]["kind"]["enum"]
    page = client.get("/").text
    got["form"] = ["<option>echo</option>" in page, 'name="options.word"' in page]
    stray = client.post("/v1/jobs", json={"kind": "echo", "source": str(source), "options": {"dtype": "float16"}})
    long = client.post("/v1/jobs", json={"kind": "echo", "source": str(source), "options": {"word": "x" * 21}})
    got["refused"] = [[r.status_code, r.json()["error"]["message"]] for r in (stray, long)]
    job = client.post("/v1/jobs", json={"kind": "echo", "source": str(source), "options": {"word": "hi"}}).json()
    got["queued"] = [job["kind"], job["state"], job["spec"]["options"]["word"]]
    store = client.app.state.service.store
    claimed = store.claim("test-worker", 60.0)
    got["ran"] = run_job(store, claimed.id, claimed.attempt)
    done = client.get(f"/v1/jobs/{job['id']}").json()
    got["done"] = [done["state"], done["result"]]
usage = CliRunner().invoke(cli, ["submit", "echo", "--help"], env={"COLUMNS": "200", "TERM": "dumb"}).output
got["cli"] = ["--word" in usage, "Say a word back" in usage, "SOURCE" in usage, "TARGET" not in usage]
print(json.dumps(got))
'''


def test_a_declared_kind_is_served_offered_and_run(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    source = str(tmp_path / "data" / "anything")
    assert got["kinds"] == ["convert", "export", "reshard", "import", "verify", "inspect", "scan", "scrub", "diff",
                            "archive", "restore", "echo"]
    # echo writes nothing: no rule runs it; restore reads an archive store, not a checkpoint a rule finds
    assert got["template_kinds"] == ["convert", "export", "reshard", "import", "archive", "scan", "scrub"]
    assert got["word"] == {"anyOf": [{"description": "What to say back.", "maxLength": 20, "minLength": 1,
                                      "type": "string"}, {"type": "null"}],
                           "default": "hello", "description": "What to say back. (echo)", "title": "Word"}
    assert got["form"] == [True, True]
    assert got["refused"] == [[422, "options.dtype: does not apply to echo jobs"],
                              [422, "options.word: String should have at most 20 characters"]]
    assert got["queued"] == ["echo", "queued", "hi"]
    assert got["ran"] == 0
    assert got["done"] == ["succeeded", {"echo": "hi", "source": source}]
    assert got["cli"] == [True, True, True, True]


def test_the_built_in_kinds_are_derived_from_their_declarations() -> None:
    declared = job_kinds.kinds()
    assert KINDS == Kind.__args__ == ("convert", "export", "reshard", "import", "verify", "inspect", "scan", "scrub",
                                      "diff", "archive", "restore")
    assert set(WRITING_KINDS) == {"convert", "export", "reshard", "import", "restore"}
    assert JobTemplate.model_fields["kind"].annotation.__args__ == ("convert", "export", "reshard", "import",
                                                                    "archive", "scan", "scrub")
    assert dict(REQUESTS) == {k.name: k.request for k in declared.values()}
    assert all(REQUESTS[name].kind == name for name in KINDS)
    assert [k.name for k in declared.values() if not k.takes_target] == ["inspect", "scan", "scrub"]
    assert APPLIES["inspect"] == {"source_format", "tag", "weights", "tensors", "stats"}
    # the cast dtypes are the engine's
    assert REQUESTS["convert"].model_validate({"dtype": "bf16"}).dtype == "bfloat16"  # type: ignore[attr-defined]
    schema = REQUESTS["convert"].model_json_schema()["properties"]["dtype"]["anyOf"][0]["enum"]
    assert schema == list(dtypes.CAST_TARGETS)


def test_a_kind_declared_after_the_job_models_are_built_is_refused() -> None:
    class LateRequest(JobRequest):
        """Too late."""

    with pytest.raises(RuntimeError) as caught:
        job_kinds.declare(job_kinds.JobKind("late", LateRequest, lambda r, s, t: lambda p: None, job_kinds.as_is))
    assert str(caught.value) == ("job kind late: declare it before ckpt_service.jobs is imported (the job models are "
                                 "built from the kinds declared by then)")
    assert "late" not in job_kinds.kinds()
