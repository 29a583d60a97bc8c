"""Listings filtered by the caller's readable roots in the store query (SQLite and PostgreSQL), so a page of
one team's checkpoints or jobs is full and its cursor stable, however the teams' rows interleave."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from ckpt_service import registry as registry_module
from ckpt_service.auth import Principal
from ckpt_service.registry import Registry
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
