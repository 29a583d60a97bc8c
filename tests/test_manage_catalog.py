"""Runs, tags, aliases and retention planning through the service library (real SQLite store, real DCP
checkpoints on disk); the end-to-end flow against a live server is in test_manage.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_service.auth import Principal
from ckpt_service.catalog import compile_pattern
from ckpt_service.jobs import JobSpec
from ckpt_service.registry import RegisterRequest
from ckpt_service.retention import PolicySpec, Retention
from ckpt_service.service import CkptService
from ckpt_service.service_errors import InvalidRequest, NotFound, OutsideRoots
from ckpt_service.settings import Settings
from tests.conftest import ckptctl

ADMIN = Principal("tester", "admin")


def save(folder: Path, seed: int) -> str:
    torch.manual_seed(seed)
    dcp.save({"w": torch.randn(8, 4), "step": torch.tensor(seed)}, checkpoint_id=str(folder))
    return str(folder)


@pytest.fixture
def svc(tmp_path: Path, store_location: str) -> CkptService:
    """The service on each store (SQLite, and a fresh PostgreSQL database): the same SQL runs on both."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "frozen").mkdir()
    database = store_location if store_location.startswith("postgresql://") else None
    settings = Settings(data_dir=tmp_path / "data", read_roots=[str(tmp_path / "runs"), str(tmp_path / "frozen")],
                        write_roots=[str(tmp_path / "runs")], allow_anonymous=True, database_url=database)
    settings.prepare()
    return CkptService(settings)


def register(svc: CkptService, uri: str, **metadata: object) -> str:
    return svc.register(RegisterRequest(uri=uri, metadata=metadata)).id  # type: ignore[arg-type]


def test_run_pattern_reads_run_and_step_from_the_path() -> None:
    default = compile_pattern("{run}/step_{step}")
    assert default.search("/d/runs/r-1/step_0020")["run"] == "r-1"  # type: ignore[index]
    assert int(default.search("/d/runs/r-1/step_0020")["step"]) == 20  # type: ignore[index]
    assert default.search("/d/runs/r-1/other") is None
    custom = compile_pattern("{run}/checkpoints/ckpt-{step}.pt")
    assert custom.search("/x/gpt/checkpoints/ckpt-7.pt").groupdict() == {"run": "gpt", "step": "7"}  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest, match=r"name \{run\} once"):
        compile_pattern("step_{step}")
    proc = ckptctl("serve", "--print-config", check=False)
    assert proc.returncode == 0 and '"run_pattern": "{run}/step_{step}"' in proc.stdout
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CKPT_RUN_PATTERN", "ckpt-{step}")
        bad = ckptctl("serve", "--print-config", check=False)
    assert bad.returncode == 2 and "setting run_pattern: run_pattern: name {run} once" in bad.stderr


def test_tags_aliases_history_and_alias_sources(svc: CkptService, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    a = register(svc, save(runs / "r1" / "step_10", 10))
    b = register(svc, save(runs / "r1" / "step_20", 20))
    c = register(svc, save(runs / "loose" / "ckpt", 3), run="r2", step=5)  # given at registration
    cat = svc.catalog
    assert [(m.run, m.step) for m in (cat.managed(a), cat.managed(b), cat.managed(c))] == [
        ("r1", 10), ("r1", 20), ("r2", 5)]
    assert cat.latest("r1").checkpoint.id == b and cat.resolve("r1", "latest") == b
    assert [(r.run, r.checkpoints, r.latest_step) for r in cat.runs()] == [("r1", 2, 20), ("r2", 1, 5)]

    assert cat.set_tags(a, {"owner": "alice", "pin": ""}, []) == ["owner=alice", "pin"]
    assert cat.set_tags(a, {"owner": "bob"}, ["pin"]) == ["owner=bob"]
    with pytest.raises(InvalidRequest, match=r"tags\.bad key"):
        cat.set_tags(a, {"bad key": "x"}, [])

    cat.set_alias(None, "prod", a, "alice")  # namespace: the checkpoint's run
    moved = cat.set_alias(None, "prod", b, "bob")
    assert moved.aliases == ["latest@r1", "prod@r1"]
    assert [(h.checkpoint_id, h.previous_id, h.changed_by) for h in cat.history("r1", "prod")] == [
        (a, None, "alice"), (b, a, "bob")]
    with pytest.raises(InvalidRequest, match="alias"):
        cat.set_alias(None, "no/slash", a, "x")

    job, _ = svc.submit(JobSpec(kind="inspect", source="alias:r1/prod"), ADMIN)
    assert job.spec.source == str(runs / "r1" / "step_20")  # resolved at submit time, then the roots checks
    with pytest.raises(InvalidRequest, match="source: no alias missing@r1"):
        svc.submit(JobSpec(kind="inspect", source="alias:r1/missing"), ADMIN)
    cat.remove_alias("r1", "prod", "carol")
    with pytest.raises(NotFound):
        cat.resolve("r1", "prod")
    assert cat.history("r1", "prod")[-1].checkpoint_id is None


def test_retention_plan_keep_every_pins_outputs_and_roots(svc: CkptService, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    ids = {step: register(svc, save(runs / "r" / f"step_{step}", step)) for step in (10, 20, 30, 40, 50, 60)}
    frozen = register(svc, save(tmp_path / "frozen" / "r" / "step_5", 5))  # readable, not writable
    export = save(runs / "exports" / "r-10", 99)  # a job output derived from step 10
    with svc.store.transaction() as conn:
        svc.registry.record_output(conn, uri=export, summary={"format": "dcp"}, job_id="job_x",
                                   source_uri=str(runs / "r" / "step_10"), source_summary=None)
    svc.catalog.set_tags(ids[30], {"pin": "keep-me"}, [])
    retention = Retention(svc)
    retention.add_policy(PolicySpec(name="thin", run="r", applies_to="sources", keep_last=1, keep_every=20), "t")
    plan = retention.plan()
    assert [(p.step, p.policy) for p in plan] == [(50, "thin")]  # 10: its output stays; 30: pinned; 5: frozen
    assert plan[0].reason.startswith("run r step 50: not kept by policy thin (keep_last 1, keep_every 20)")
    assert plan[0].bytes == sum(f.stat().st_size for f in (runs / "r" / "step_50").iterdir())
    assert frozen not in {p.checkpoint_id for p in plan}

    retention.remove_policy("thin")
    retention.add_policy(PolicySpec(name="thin", run="r", keep_last=1, keep_every=20,
                                    delete_with_outputs=True), "t")
    assert [p.step for p in retention.plan()] == [10, 50]
    assert [p.step for p in retention.plan(now=time.time())] == [10, 50]
    retention.add_policy(PolicySpec(name="young", run="r", keep_younger_than="1h"), "t")
    assert retention.plan() == []  # every checkpoint is younger than an hour: a covering policy keeps it

    with pytest.raises(ValueError, match="at least one of keep_last"):
        PolicySpec(name="x", run="r")


def test_interrupted_gc_finishes_on_the_next_run(svc: CkptService, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for step in (1, 2, 3):
        register(svc, save(runs / "r" / f"step_{step}", step))
    retention = Retention(svc)
    retention.add_policy(PolicySpec(name="last1", run="r", keep_last=1), "t")
    plan = retention.plan()
    retention._mark(plan, "t")  # the registry side of a GC that was killed before removing files
    assert (runs / "r" / "step_1").exists() and retention.plan() == []
    assert [d.state for d in retention.deletions()] == ["pending", "pending"]
    report = retention.run(dry_run=False, by="t")
    assert report.plan == [] and len(report.deleted) == 2
    assert sorted(p.name for p in (runs / "r").iterdir()) == ["step_3"]
    assert sorted(d.uri for d in retention.deletions(state="done")) == [str(runs / "r" / "step_1"),
                                                                       str(runs / "r" / "step_2")]
    assert [m.step for m in svc.catalog.steps("r")] == [3]


def test_scheduled_gc_runs_on_its_interval(svc: CkptService, tmp_path: Path) -> None:
    from ckpt_service.rules import Rules, Scheduler

    runs = tmp_path / "runs"
    for step in (1, 2):
        register(svc, save(runs / "r" / f"step_{step}", step))
    retention = Retention(svc)
    retention.add_policy(PolicySpec(name="last1", run="r", keep_last=1), "t")
    scheduler = Scheduler(Rules(svc), retention, discover_seconds=0, gc_seconds=0.2)
    started = time.monotonic()
    scheduler.start()
    try:
        deadline = time.monotonic() + 20
        while not retention.deletions(state="done") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        scheduler.stop()
    assert time.monotonic() - started >= 0.2  # not before its first interval
    assert [(d.uri, d.requested_by, d.policy) for d in retention.deletions()] == [
        (str(runs / "r" / "step_1"), "scheduler", "last1")]
    assert sorted(p.name for p in (runs / "r").iterdir()) == ["step_2"]


def test_rules_refuse_targets_outside_roots_and_options_of_other_kinds(svc: CkptService, tmp_path: Path) -> None:
    from pydantic import ValidationError

    from ckpt_service.rules import Rules, RuleSpec

    rules, runs = Rules(svc), tmp_path / "runs"

    def spec(target: str, pattern: str = f"{runs}/*/step_*", **options: object) -> RuleSpec:
        return RuleSpec.model_validate({"name": "r", "pattern": pattern,
                                        "job": {"kind": "export", "target": target, "options": options}})

    with pytest.raises(OutsideRoots, match=r"job\.target: '\.\.' path segments"):
        rules.add(spec(f"{runs}/out/{{run}}/../../x"), "t")
    with pytest.raises(OutsideRoots, match=r"job\.target: .* outside the storage roots this server may write"):
        rules.add(spec(f"{tmp_path}/frozen/{{run}}"), "t")
    with pytest.raises(OutsideRoots, match=r"pattern: .* outside the storage roots"):
        rules.add(spec(f"{runs}/out/{{run}}", pattern=f"{tmp_path}/elsewhere/*"), "t")
    with pytest.raises(InvalidRequest, match=r"job\.target: outputs would land where the pattern looks"):
        rules.add(spec(f"{runs}/{{run}}-export/{{step}}", pattern=f"{runs}/*"), "t")
    with pytest.raises(InvalidRequest, match=r"options\.world_size: does not apply to export jobs"):
        rules.add(spec(f"{runs}/out/{{run}}/{{step}}", world_size=8), "t")
    with pytest.raises(ValidationError, match=r"job\.kind"):
        RuleSpec.model_validate({"name": "r", "pattern": "/x/*", "job": {"kind": "verify", "target": "/y"}})
    made = rules.add(spec(f"{runs}/out/{{run}}/{{step}}", dtype="bfloat16"), "t")
    assert (made.spec.job.options.dtype, made.spec.job.options.model_fields_set) == ("bfloat16", {"dtype"})
    assert rules.all()[0].spec.pattern == f"{runs}/*/step_*"


def test_gc_waits_for_active_rules_to_fire(svc: CkptService, tmp_path: Path) -> None:
    from ckpt_service.rules import Rules, RuleSpec

    runs = tmp_path / "runs"
    for step in (1, 2, 3):
        register(svc, save(runs / "r" / f"step_{step}", step))
    rules, retention = Rules(svc), Retention(svc)
    retention.add_policy(PolicySpec(name="last1", run="r", keep_last=1), "t")
    rules.add(RuleSpec.model_validate({"name": "ex", "pattern": f"{runs}/r/step_*",
                                       "job": {"kind": "export", "target": f"{runs}/out/{{step}}"}}), "t")
    assert retention.plan() == []  # the rule has not exported them yet
    rules.pause("ex", True)
    assert [p.step for p in retention.plan()] == [1, 2]


def test_two_replicas_scanning_together_fire_each_checkpoint_once(svc: CkptService, tmp_path: Path) -> None:
    import threading

    from ckpt_service.rules import Rules, RuleSpec
    from ckpt_service.store import JobStore

    runs = tmp_path / "runs"
    for step in range(1, 7):
        save(runs / "r" / f"step_{step}", step)
    Rules(svc).add(RuleSpec.model_validate({"name": "ex", "pattern": f"{runs}/r/step_*", "max_concurrent": 10,
                                            "job": {"kind": "export", "target": f"{runs}/out/{{step}}"}}), "t")
    replicas = [Rules(CkptService(svc.settings, JobStore(svc.settings.store_location))) for _ in range(2)]
    barrier, counts = threading.Barrier(2), []

    def scan(rules: Rules) -> None:
        barrier.wait()
        counts.append(rules.scan())

    threads = [threading.Thread(target=scan, args=(r,)) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    jobs = svc.store.list_jobs(kind="export", limit=100)[0]
    assert sum(counts) == len(jobs) == 6
    assert sorted(j.spec["source"] for j in jobs) == [str(runs / "r" / f"step_{n}") for n in range(1, 7)]
    assert Rules(svc).scan() == 0  # and again later: nothing new
    assert [c.step for c in svc.catalog.steps("r")] == [1, 2, 3, 4, 5, 6]


def test_a_claim_left_by_a_crash_is_finished_without_a_second_job(svc: CkptService, tmp_path: Path) -> None:
    from ckpt_service.rules import STALE_CLAIM_SECONDS, Rules, RuleSpec, trigger_key

    runs = tmp_path / "runs"
    source = save(runs / "r" / "step_1", 1)
    rules = Rules(svc)
    rule = rules.add(RuleSpec.model_validate({"name": "ex", "pattern": f"{runs}/r/step_*",
                                              "job": {"kind": "export", "target": f"{runs}/out/{{step}}"}}), "t")
    checkpoint_id, _, _ = rules._registered(source, rules.complete, "t")  # type: ignore[misc]
    claimed_at = time.time() - STALE_CLAIM_SECONDS - 1
    with svc.store.transaction() as conn:  # the crash came after the claim and after the job was queued
        conn.execute("INSERT INTO rule_triggers (rule_id, uri, checkpoint_id, state, claimed_at) "
                     "VALUES (?, ?, ?, 'claimed', ?)", (rule.id, source, checkpoint_id, claimed_at))
    queued, _ = svc.submit(JobSpec(kind="export", source=source, target=str(runs / "out" / "1")),
                           Principal("rule:ex", "write"), idempotency_key=trigger_key(rule.id, source))
    assert rules.scan() == 1
    [trigger] = rules.triggers("ex")
    assert (trigger.state, trigger.job_id) == ("submitted", queued.id)
    assert [j.id for j in svc.store.list_jobs(kind="export")[0]] == [queued.id]


def test_held_back_checkpoints_fire_when_a_slot_frees(svc: CkptService, tmp_path: Path) -> None:
    from ckpt_service.rules import Rules, RuleSpec

    runs = tmp_path / "runs"
    rules = Rules(svc)
    rules.add(RuleSpec.model_validate({"name": "one", "pattern": f"{runs}/r/step_*", "max_concurrent": 1,
                                       "job": {"kind": "export", "target": f"{runs}/out/{{step}}"}}), "t")
    for step in (1, 2):
        register(svc, save(runs / "r" / f"step_{step}", step))  # registered (as a push would), not yet fired
    assert rules.scan(look=False) == 1  # one slot
    assert rules.scan(look=False) == 0  # still busy
    job = svc.store.claim("w", 30)
    assert job is not None and job.spec["source"] == str(runs / "r" / "step_1")
    svc.store.finish_now(job.id, job.attempt, "failed", error=("Test", "stopped here"))
    assert rules.scan(look=False) == 1
    assert [(Path(t.uri).name, t.state) for t in rules.triggers("one")] == [("step_1", "job_failed"),
                                                                          ("step_2", "submitted")]


def test_prefix_policy_for_exports_only(svc: CkptService, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for step in (1, 2, 3):
        source = save(runs / "r" / f"step_{step}", step)
        with svc.store.transaction() as conn:
            svc.registry.record_output(conn, uri=save(runs / "exports" / f"e{step}", step), summary={"format": "dcp"},
                                       job_id=f"job_{step}", source_uri=source, source_summary={"format": "dcp"})
    retention = Retention(svc)
    retention.add_policy(PolicySpec(name="exp", prefix=str(runs / "exports"), applies_to="exports", keep_last=1), "t")
    plan = retention.plan()
    assert [(Path(p.uri).name, p.policy) for p in plan] == [("e1", "exp"), ("e2", "exp")]  # newest first kept
    assert plan[0].reason == "no run: not kept by policy exp (keep_last 1)"
    with pytest.raises(OutsideRoots, match="prefix"):
        retention.add_policy(PolicySpec(name="x", prefix=str(tmp_path / "elsewhere"), keep_last=1), "t")
