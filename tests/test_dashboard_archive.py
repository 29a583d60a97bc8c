"""The dashboard's checkpoint page for an archived checkpoint (slow, a real headless Chromium against a real
`ckptctl serve`): "archived in STORE, stored X of Y" and a Restore button that submits a restore job, whose output
is the checkpoint byte for byte."""

from __future__ import annotations

import pytest

from .service_harness import job_spec
from .test_dashboard import Site, Tab, browser, sign_in, site, tab  # noqa: F401  (fixtures)


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
