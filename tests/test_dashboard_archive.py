"""The dashboard and archived checkpoints (slow, a real headless Chromium against a real `ckptctl serve`): the
checkpoint page's "archived in STORE, stored X of Y" and a Restore button that submits a restore job, whose output
is the checkpoint byte for byte; the retention page's form adding an archive policy, its plan, and the checkpoint
list's badge on what it archived."""

from __future__ import annotations

import pytest
import torch

from .service_harness import job_spec
from .test_dashboard import Site, Tab, _save, browser, sign_in, site, tab  # noqa: F401  (fixtures)


def size(n: int) -> str:
    """dom.js `bytes`."""
    units, value, i = ["B", "KiB", "MiB", "GiB", "TiB"], float(n), 0
    while value >= 1024 and i < len(units) - 1:
        value, i = value / 1024, i + 1
    return f"{value:.1f} {units[i]}" if i else f"{n} B"


@pytest.mark.slow
def test_archived_checkpoint_page_restores_it(tab: Tab, site: Site) -> None:  # noqa: F811
    store = site.data / "archive" / "store"
    with site.server.client(site.tokens.write) as client:
        made = client.submit(job_spec("archive", site.small, store))["id"]
    archived = site.server.wait_job(made, ("succeeded", "failed"), token=site.tokens.read)
    assert archived["state"] == "succeeded", archived
    result = archived["result"]
    page = tab.page
    sign_in(tab, site.tokens.write, "write")
    page.goto(f"{site.server.url}/#/checkpoints/{result['checkpoint_id']}")
    item = f"#ckpt-archives li[data-archive='{result['archive_id']}']"
    page.wait_for_selector(item)
    text = page.text_content(item)
    assert text.startswith(f"archived in {store}, stored {size(result['stored_bytes'])} of "
                           f"{size(result['logical_bytes'])} (archive {result['archive_id']}, job:{made})"), text
    target = site.data / "restored" / "step300.pt"
    page.fill(f"{item} input", str(target))
    page.click(f"{item} button[data-restore='{result['archive_id']}']")
    page.wait_for_url("**/#/jobs/*")
    job_id = page.url.rsplit("/", 1)[-1]
    restored = site.server.wait_job(job_id, ("succeeded", "failed"), token=site.tokens.read)
    assert restored["state"] == "succeeded", restored
    assert (restored["kind"], restored["spec"]["options"]["archive_id"]) == ("restore", result["archive_id"])
    assert target.read_bytes() == site.small.read_bytes()
    tab.shot("checkpoint-archived")
    assert tab.errors == []


@pytest.mark.slow
def test_retention_form_adds_an_archive_policy_and_the_list_badges_what_it_archived(tab: Tab, site: Site) -> None:  # noqa: F811
    run = site.data / "steps" / "ar"
    steps = {step: _save(run / f"step_{step}.pt", {"w": torch.ones(64, 64) * step, "frozen": torch.ones(64, 64)})
             for step in (10, 20)}
    with site.server.client(site.tokens.write) as client:
        ids = {step: client.register(str(path), metadata={"run": "ar", "step": step})["id"]
               for step, path in steps.items()}
    store = site.data / "archive" / "policy-store"
    page = tab.page
    sign_in(tab, site.tokens.admin, "admin")
    page.click("a[data-nav=retention]")
    page.wait_for_selector("#policy-form")
    assert page.is_disabled("#policy-store")  # a store only with the archive action
    page.fill("#policy-name", "archive-ar")
    page.fill("#policy-covers", "ar")
    page.fill("#policy-keep-last", "1")
    page.select_option("#policy-action", "archive")
    page.click("#policy-form button[type=submit]")  # no store: the API's one line, shown by the form
    page.wait_for_selector("#policy-form-error:not(:empty)")
    assert "store" in page.text_content("#policy-form-error")
    page.fill("#policy-store", str(store))
    page.click("#policy-form button[type=submit]")
    row = page.wait_for_selector("#policies tbody tr:has-text('archive-ar')")
    cells = [c.text_content() for c in row.query_selector_all("td")]
    assert cells[:5] == ["archive-ar", "run ar", "all", "keep the last 1 steps", f"archive to {store}, then delete"]
    plan = page.wait_for_selector(f"#gc tbody tr[data-plan='{ids[10]}']")
    tab.shot("retention-archive-policy")
    assert [c.text_content() for c in plan.query_selector_all("td")][5] == f"archive to {store}, then delete"
    size10 = steps[10].stat().st_size
    assert page.text_content("#gc-total") == (f"1 checkpoint(s), {size(size10)} would be deleted now ({size(size10)} "
                                              "of it archived first, restorable).")
    with site.server.http(site.tokens.admin) as http:
        report = http.post("/v1/gc", json={"dry_run": False}).json()
        assert (report["archived"], report["bytes"], report["archived_bytes"]) == ([ids[10]], size10, size10)
        assert http.delete("/v1/policies/archive-ar").status_code == 200

    page.goto(f"{site.server.url}/#/checkpoints?archived=true")
    badge = page.wait_for_selector(f"#ckpts-body tr[data-checkpoint='{ids[10]}'] .archived")
    assert badge.text_content() == "archived, files deleted"
    assert badge.get_attribute("title") == f"restorable from {store}"
    assert page.input_value("#filter-archived") == "true"
    page.goto(f"{site.server.url}/#/checkpoints?name=step_20.pt")
    page.wait_for_selector(f"#ckpts-body tr[data-checkpoint='{ids[20]}']")
    assert page.query_selector(f"#ckpts-body tr[data-checkpoint='{ids[20]}'] .archived") is None  # kept, not archived
    tab.shot("checkpoints-archived")
    assert tab.errors == []
