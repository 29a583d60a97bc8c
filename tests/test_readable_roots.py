"""Listings filtered by the caller's readable roots in the store query (SQLite and PostgreSQL), so a page of
one team's checkpoints or jobs is full and its cursor stable, however the teams' rows interleave."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any, cast

import pytest

from ckpt_service import registry as registry_module
from ckpt_service.auth import Principal
from ckpt_service.catalog import Catalog
from ckpt_service.dialect import postgres_sql
from ckpt_service.registry import Registry
from ckpt_service.retention import Retention
from ckpt_service.store import JobStore, like_prefix, under

# `_` and `%` in a root are literal: /d/team_a must not hold /d/teamXa, /d/50% not /d/50x; case counts
TEAM_A, TEAM_B = "/d/team_a", "/d/50%"
NEIGHBOURS = ["/d/teamXa/m", "/d/team_ab/m", "/d/50x/m", "/d/50%x/m", "/d/TEAM_A/m", "/d/team_a"]


def pages(fetch: Any, limit: int) -> list[list[str]]:
    found, cursor = [], None
    while True:
        items, cursor = fetch(limit, cursor)
        found.append(items)
        if cursor is None:
            return found


def test_like_prefix_escapes_its_own_wildcards() -> None:
    assert like_prefix("/d/50%_a!b") == "/d/50!%!_a!!b"
    assert under("uri", []) == ("1 = 0", [])
    assert under("uri", ["s3://b/"]) == (
        "((uri = ? OR (uri LIKE ? ESCAPE '!' AND substr(uri, 1, ?) = ?)))", ["s3://b/", "s3://b/%", 7, "s3://b/"])
    assert Principal("oidc:a", "write", roots=(("/d/b", "read"), ("/d/a", "write"), ("/d/a", "read"))).readable() \
        == ["/d/a", "/d/b"]
    assert Principal("oidc:x", "admin", roots=(("*", "read"), ("/d/a", "admin"))).readable() is None
    assert Principal("ci", "read").readable() is None


def test_checkpoint_pages_hold_only_readable_roots_and_are_full(store_location: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    counter = itertools.count()
    monkeypatch.setattr(registry_module, "new_id", lambda prefix: f"{prefix}_{next(counter):04d}")
    store = JobStore(store_location)
    registry = Registry(store)
    uris = []
    for i in range(4):  # ids in this order: a, b, a, b, …, then the neighbours of team A's root
        uris += [f"{TEAM_A}/run/step_{i}", f"{TEAM_B}/run/step_{i}"]
    uris += NEIGHBOURS
    with store.transaction() as conn:
        for uri in uris:
            registry.add(conn, uri=uri, name=uri.rsplit("/", 1)[-1], summary={}, tags=[], metadata={},
                         via={"how": "registered", "by": "t"})

    def fetch(within: list[str]) -> Any:
        def one(limit: int, cursor: str | None) -> tuple[list[str], str | None]:
            items, next_cursor, unreadable = registry.list(limit=limit, after=cursor, within=within)
            assert unreadable == []
            return [view.uri for view in items], next_cursor
        return one

    assert pages(fetch([TEAM_A]), 2) == [[f"{TEAM_A}/run/step_0", f"{TEAM_A}/run/step_1"],
                                         [f"{TEAM_A}/run/step_2", f"{TEAM_A}/run/step_3"], [TEAM_A]]
    assert pages(fetch([TEAM_B]), 3) == [[f"{TEAM_B}/run/step_{i}" for i in range(3)], [f"{TEAM_B}/run/step_3"]]
    both = pages(fetch([TEAM_B, TEAM_A]), 4)
    assert [len(page) for page in both] == [4, 4, 1]
    assert sorted(itertools.chain(*both)) == sorted([*uris[:8], TEAM_A])
    assert pages(fetch([]), 5) == [[]]
    assert pages(fetch(["/d/team_a/run/step_1"]), 5) == [[f"{TEAM_A}/run/step_1"]]
    store.close()


def test_job_pages_need_the_source_and_the_target_readable(store_location: str) -> None:
    store = JobStore(store_location)
    made: list[tuple[str, str]] = []
    plans = [(TEAM_A, f"{TEAM_A}/out"), (TEAM_B, f"{TEAM_B}/out"), ("/d/shared", f"{TEAM_A}/out"),
             ("/d/shared", None), (TEAM_A, f"{TEAM_B}/stolen"), ("/d/TEAM_A", None)] * 2
    for n, (source, target) in enumerate(plans):
        spec = {"kind": "convert", "source": f"{source}/m{n}", "target": target and f"{target}/{n}"}
        job, _ = store.create_job(kind="convert", spec=spec, target=spec["target"], callback_url=None,
                                  submitted_by="t", max_attempts=1, queue_limit=100)
        made.append((job.id, spec["source"]))

    def fetch(within: list[str]) -> Any:
        def one(limit: int, cursor: str | None) -> tuple[list[str], str | None]:
            records, before, unreadable = store.list_jobs(limit=limit, before=int(cursor) if cursor else None,
                                                          within=within)
            assert unreadable == []
            return [r.spec["source"] for r in records], str(before) if before is not None else None
        return one

    newest_first = [source for _, source in made][::-1]
    assert pages(fetch([TEAM_A, "/d/shared"]), 2) == [
        ["/d/shared/m9", "/d/shared/m8"], ["/d/team_a/m6", "/d/shared/m3"], ["/d/shared/m2", "/d/team_a/m0"]]
    assert pages(fetch([TEAM_B]), 2) == [["/d/50%/m7", "/d/50%/m1"]]
    assert pages(fetch(["/d/shared"]), 3) == [["/d/shared/m9", "/d/shared/m3"]]
    assert [s for page in pages(fetch([TEAM_A, TEAM_B, "/d/shared", "/d/TEAM_A"]), 5) for s in page] == newest_first
    store.close()


def test_deletion_log_pages_hold_only_readable_roots_and_are_full(store_location: str) -> None:
    """GET /v1/deletions' query: `limit` of the caller's deletions come back however the teams' rows interleave."""
    store = JobStore(store_location)
    with store.transaction() as conn:
        for n in range(10):  # newest last: b, a, b, a, …; then a neighbour of team A's root
            uri = f"{TEAM_A if n % 2 else TEAM_B}/run/step_{n}"
            conn.execute("INSERT INTO deletions (id, checkpoint_id, uri, bytes, policy, reason, requested_by, state, "
                         "planned_at) VALUES (?, ?, ?, 1, 'p', 'r', 't', ?, ?)",
                         (f"del_{n:02d}", f"ckpt_{n:02d}", uri, "done" if n < 8 else "pending", 1000.0 + n))
        conn.execute("INSERT INTO deletions (id, checkpoint_id, uri, bytes, policy, reason, requested_by, state, "
                     "planned_at) VALUES ('del_xx', 'ckpt_xx', '/d/teamXa/run/step_0', 1, 'p', 'r', 't', 'done', 2000)")
    retention = Retention(cast(Any, SimpleNamespace(store=store)))

    def ids(limit: int, state: str | None = None, within: list[str] | None = None) -> list[str]:
        return [d.id for d in retention.deletions(state, limit, within)]

    assert ids(3, within=[TEAM_A]) == ["del_09", "del_07", "del_05"]
    assert ids(3, "done", [TEAM_A]) == ["del_07", "del_05", "del_03"]
    assert ids(100, within=[TEAM_B]) == ["del_08", "del_06", "del_04", "del_02", "del_00"]
    assert ids(2, within=[]) == []
    assert ids(2) == ["del_xx", "del_09"]
    store.close()


def test_runs_count_and_name_only_readable_steps(store_location: str) -> None:
    """GET /v1/runs' query: a run's count and latest step are those of the caller's steps; a run with none is
    left out."""
    store = JobStore(store_location)
    registry = Registry(store)
    catalog = Catalog(store, registry, "{run}/step_{step}")
    plan = [(f"{TEAM_A}/mixed/step_1", 1), (f"{TEAM_B}/mixed/step_2", 2), (f"{TEAM_A}/mixed/step_3", 3),
            (f"{TEAM_B}/mixed/step_9", 9), (f"{TEAM_B}/theirs/step_5", 5), (f"{TEAM_A}/ours/step_4", 4)]
    ids = {}
    for uri, step in plan:
        with store.transaction() as conn:
            ids[uri] = registry.add(conn, uri=uri, name=uri.rsplit("/", 1)[-1], summary={}, tags=[], metadata={},
                                    via={"how": "registered", "by": "t"})
            catalog.place(conn, ids[uri], uri.split("/")[-2], step, "t")

    def runs(within: list[str] | None) -> list[tuple[str, int, int | None, str | None]]:
        return [(r.run, r.checkpoints, r.latest_step, r.latest_id) for r in catalog.runs(within)]

    assert runs([TEAM_A]) == [("mixed", 2, 3, ids[f"{TEAM_A}/mixed/step_3"]),
                              ("ours", 1, 4, ids[f"{TEAM_A}/ours/step_4"])]
    assert runs([TEAM_B]) == [("mixed", 2, 9, ids[f"{TEAM_B}/mixed/step_9"]),
                              ("theirs", 1, 5, ids[f"{TEAM_B}/theirs/step_5"])]
    assert runs(None) == runs([TEAM_A, TEAM_B]) == [
        ("mixed", 4, 9, ids[f"{TEAM_B}/mixed/step_9"]), ("ours", 1, 4, ids[f"{TEAM_A}/ours/step_4"]),
        ("theirs", 1, 5, ids[f"{TEAM_B}/theirs/step_5"])]
    assert runs([]) == []
    store.close()


def test_job_pages_need_the_paths_options_read_readable_too(store_location: str) -> None:
    """A job reading config_from or base under an unreadable root is not listed (as GET /v1/jobs/{id} refuses it)."""
    assert postgres_sql("SELECT json_extract(spec, '$.options.base') FROM jobs") == (
        "SELECT (spec::jsonb -> 'options' ->> 'base') FROM jobs")
    store = JobStore(store_location)
    plans = [{}, {"config_from": f"{TEAM_B}/hf"}, {"base": f"{TEAM_B}/base"}, {"config_from": f"{TEAM_A}/hf"},
             {"base": f"{TEAM_A}/base", "config_from": None}]
    for n, options in enumerate(plans):
        spec = {"kind": "export", "source": f"{TEAM_A}/m{n}", "target": f"{TEAM_A}/out{n}", "options": options}
        store.create_job(kind="export", spec=spec, target=spec["target"], callback_url=None, submitted_by="t",
                         max_attempts=1, queue_limit=100)

    def sources(within: list[str]) -> list[str]:
        return [r.spec["source"] for r in store.list_jobs(limit=10, within=within)[0]]

    assert sources([TEAM_A]) == [f"{TEAM_A}/m4", f"{TEAM_A}/m3", f"{TEAM_A}/m0"]
    assert sources([TEAM_A, TEAM_B]) == [f"{TEAM_A}/m{n}" for n in (4, 3, 2, 1, 0)]
    store.close()
