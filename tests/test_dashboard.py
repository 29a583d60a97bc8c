"""The web dashboard at `/`: its shell and headers (fast, over HTTP), and end to end in a real headless Chromium
(slow) against a real `ckptctl serve` on loopback with real checkpoints made by torch.save."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
import torch

from api.dashboard.routes import CSP, STATIC
from ckpt_service.jobs import JobOptions
from tests.ranks import run_tool

from .service_harness import Server, Tokens, job_spec, make_server, wait_for

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--no-first-run"]
EVIL = '<script>alert("x")</script>'
EVIL_IMG = "<img src=x onerror=alert(2)>"
RATE = 2_000_000  # bytes per second per job: the export below takes about 2 s, so the browser sees it run


@dataclass
class Site:
    server: Server
    tokens: Tokens
    data: Path
    source: Path  # 4 MB of float32 in one torch.save file
    evil: Path  # tensor names with markup in them
    big: Path  # 16 MB: its export runs for about 8 s
    small: Path  # 1 MB, for a chain of jobs


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, path)
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    base = tmp_path_factory.mktemp("dashboard")
    data = base / "data"
    gen = torch.Generator().manual_seed(0)
    source = _save(data / "run1" / "step100.pt",
                   {f"model.layers.{i}.weight": torch.randn(256, 512, generator=gen) for i in range(8)})
    big = _save(data / "run2" / "step200.pt", {f"w{i}": torch.randn(1024, 1024, generator=gen) for i in range(4)})
    small = _save(data / "run3" / "step300.pt",
                  {f"l{i}.weight": torch.randn(128, 256, generator=gen) for i in range(8)})
    evil = _save(data / "evil" / "evil.pt", {f"{EVIL}.weight": torch.ones(2, 2), EVIL_IMG: torch.ones(1),
                                               "ok.bias": torch.zeros(3)})
    tokens = Tokens.make()
    server = make_server(base / "state", read_roots=[data], write_roots=[data], workers=2, tokens=tokens.entries,
                         extra_env={"CKPT_JOB_MAX_BYTES_PER_SECOND": str(RATE)})
    server.start()
    try:
        yield Site(server, tokens, data, source, evil, big, small)
    finally:
        server.stop()


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_shell_is_served_with_a_strict_policy(site: Site) -> None:
    response = httpx.get(f"{site.server.url}/", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-security-policy"] == CSP
    assert "script-src 'self';" in CSP and "unsafe" not in CSP
    assert response.headers["x-content-type-options"] == "nosniff"
    parser = _Tags()
    parser.feed(response.text)
    scripts = [attrs for tag, attrs in parser.tags if tag == "script"]
    assert [s["type"] for s in scripts] == ["module"]  # one script, from a file; no inline code
    handlers = [(tag, name) for tag, attrs in parser.tags for name in attrs if name.startswith("on")]
    assert handlers == []
    assert all(attrs.get("style") is None for _, attrs in parser.tags)
    # every option of every kind is on the form, marked with the kinds it applies to
    fields = {attrs["name"]: attrs for tag, attrs in parser.tags if (attrs.get("name") or "").startswith("options.")}
    assert sorted(fields) == sorted(f"options.{name}" for name in JobOptions.model_fields)
    assert {"options.world_size", "options.to_hf", "options.tag"} <= set(fields)
    assert "ckptctl token create" in response.text

    asset = scripts[0]["src"]
    assert re.fullmatch(r"/dashboard/static/js/app\.js\?v=[0-9a-f]{12}", asset)
    cached = httpx.get(f"{site.server.url}{asset}", timeout=10)
    assert cached.status_code == 200
    assert cached.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert cached.headers["content-type"].startswith("text/javascript")
    stale = httpx.get(f"{site.server.url}/dashboard/static/js/app.js?v=000000000000", timeout=10)
    assert stale.headers["cache-control"] == "no-cache"
    assert (STATIC.parent / "routes.py").exists()  # next to the assets, and not served
    assert httpx.get(f"{site.server.url}/dashboard/static/%2e%2e/routes.py", timeout=10).status_code == 404


def test_scripts_never_write_markup() -> None:
    """Values go into the page as text: no innerHTML, outerHTML, insertAdjacentHTML, document.write or eval."""
    sources = {p.name: p.read_text() for p in (STATIC / "js").glob("*.js")}
    assert set(sources) >= {"api.js", "app.js", "dom.js", "jobs.js", "checkpoints.js", "lineage.js"}
    for name, text in sources.items():
        found = re.findall(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function", text)
        assert found == [], name


def test_whoami(site: Site) -> None:
    url = f"{site.server.url}/v1/whoami"
    read = httpx.get(url, headers={"Authorization": f"Bearer {site.tokens.read}"}, timeout=10)
    assert read.status_code == 200
    body = read.json()
    assert (body["name"], body["scope"], body["anonymous_allowed"]) == ("test-read", "read", False)
    assert body["version"] == httpx.get(f"{site.server.url}/openapi.json", timeout=10).json()["info"]["version"]
    anonymous = httpx.get(url, timeout=10)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["type"] == "unauthorized"


# -- in a real browser -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    if shutil.which("chromium") is None and not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (`apt-get install -y --no-install-recommends "
                    "chromium`; .ci/run does) to run the dashboard's browser tests")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class Tab:
    page: object
    dialogs: list[str]
    errors: list[str]
    shots: Path

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 1000
        return path


@pytest.fixture
def tab(browser: object, site: Site, tmp_path: Path) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1366, "height": 768})  # a laptop screen
    page = context.new_page()
    dialogs: list[str] = []
    errors: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("pageerror", lambda e: errors.append(str(e)))
    # the browser logs every 4xx answer as an error; the ones the page asks for (who am I, before sign-in; a
    # refused form) are expected, anything else (a script error, a resource refused by the CSP) is not
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" and not re.search(
        r"status of 4(01|03|22)", m.text) else None)
    page.set_default_timeout(20_000)
    page.goto(f"{site.server.url}/")
    yield Tab(page, dialogs, errors, tmp_path)
    context.close()


def rows_become(page: object, selector: str, key: str, want: list[str], timeout: float = 20.0) -> None:
    """Wait until the table's rows are exactly `want` (by their data-KEY), in order."""
    script = f"rs => rs.map(r => r.dataset.{key})"
    wait_for(lambda: page.eval_on_selector_all(selector, script) == want, timeout, f"rows {want}")


def sign_in(tab: Tab, token: str, expect_scope: str, view: str = "jobs") -> None:
    page = tab.page
    page.wait_for_selector("#view-signin:not([hidden])")
    page.fill("#token", token)
    page.press("#token", "Enter")
    page.wait_for_selector(f"#view-{view}:not([hidden])")
    assert page.text_content("#who").startswith(f"test-{expect_scope} · {expect_scope}")


@pytest.mark.slow
def test_export_from_the_form_runs_live_and_lands_in_the_lineage(tab: Tab, site: Site) -> None:
    page = tab.page
    assert "ckptctl token create" in page.text_content("#view-signin")
    tab.shot("signin")
    sign_in(tab, site.tokens.write, "write")
    tab.shot("jobs-empty")
    page.evaluate("window.__sameDocument = 'yes'")  # gone if anything reloads the page

    page.click("a[data-nav=new]")
    page.select_option("#f-kind", "export")
    assert page.is_hidden("#f-world_size") and page.is_visible("#f-dtype")  # only export's options
    target = site.data / "exports" / "step100"
    page.fill("#f-source", str(site.source))
    page.fill("#f-target", str(target))
    page.select_option("#f-dtype", "bfloat16")
    tab.shot("new-job")
    page.click("#job-submit")

    page.wait_for_selector("#view-job:not([hidden]) #job-timeline")
    job_id = page.url.rsplit("/", 1)[-1]
    assert re.fullmatch(r"#?job_[A-Za-z0-9_-]+|[A-Za-z0-9_-]+", job_id)
    seen: set[str] = set()
    percents: list[int] = []
    for _ in range(400):  # the state and bar move while the page stays put (bounded: 400 x 50 ms)
        state = page.get_attribute("#job-body .state", "data-state")
        seen.add(state)
        percents.append(int(page.get_attribute("#job-body .percent", "data-percent")))
        if state == "succeeded":
            break
        if state == "running" and 0 < percents[-1] < 100 and not (tab.shots / "job-running.png").exists():
            tab.shot("job-running")
        page.wait_for_timeout(50)
    assert state == "succeeded", (seen, site.server.log_tail())
    assert "running" in seen
    assert any(0 < p < 100 for p in percents), percents  # seen part-way, not just before and after
    assert percents == sorted(percents) and percents[-1] == 100
    assert page.text_content("#job-body .state") == "succeeded"
    assert page.get_attribute("#job-body progress", "value") == "100"
    assert page.evaluate("window.__sameDocument") == "yes"
    timeline = page.text_content("#job-timeline")
    assert "queued" in timeline and "started (attempt 1)" in timeline and "finished: succeeded" in timeline
    assert page.is_hidden("#job-cancel") and page.is_hidden("#job-retry")
    tab.shot("job-succeeded")

    page.click("#job-output")
    page.wait_for_selector("#view-checkpoint:not([hidden]) svg.lineage-graph")
    assert page.text_content("#ckpt-title") == "Checkpoint step100"
    assert "bfloat16: 8" in page.text_content("#ckpt-body")
    labels = page.eval_on_selector_all("svg.lineage-graph a.node-checkpoint text.label",
                                       "ts => ts.map(t => t.textContent)")
    assert sorted(labels) == ["step100", "step100.pt"]  # the source checkpoint -> the export job -> the output
    assert page.locator("svg.lineage-graph a.node-job").count() == 1
    assert page.locator("svg.lineage-graph path.edge").count() == 2
    tab.shot("checkpoint")
    page.click("a[data-nav=checkpoints]")
    page.wait_for_selector("#ckpts-body tr[data-checkpoint]")
    assert page.locator("#ckpts-body tr[data-checkpoint]").count() == 2
    tab.shot("checkpoints")
    page.click("a[data-nav=health]")
    page.wait_for_selector("#health-body dd")
    assert "ready" in page.text_content("#health-body")
    tab.shot("health")
    assert tab.dialogs == [] and tab.errors == []


@pytest.mark.slow
def test_invalid_form_shows_the_error_next_to_the_field(tab: Tab, site: Site) -> None:
    page = tab.page
    sign_in(tab, site.tokens.write, "write")
    for _ in range(20):  # by keyboard: Tab to the "New job" link, Enter; then type and press Enter to submit
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.id") == "nav-new":
            break
    page.keyboard.press("Enter")
    page.wait_for_selector("#view-new:not([hidden])")
    page.select_option("#f-kind", "export")
    page.fill("#f-source", str(site.source))
    page.fill("#f-target", str(site.data / "exports" / "never"))
    page.fill("#f-max_shard_size", "lots")
    page.press("#f-max_shard_size", "Enter")
    error = page.wait_for_selector("#error-options\\.max_shard_size:not(:empty)")
    assert "5GB or 256MiB" in error.text_content()
    # the message sits in the field's own row, and the field is marked invalid and focused
    assert page.eval_on_selector("#error-options\\.max_shard_size", "e => e.closest('.field').contains("
                                 "document.getElementById('f-max_shard_size'))")
    assert page.get_attribute("#f-max_shard_size", "aria-invalid") == "true"
    assert page.evaluate("document.activeElement.id") == "f-max_shard_size"
    assert page.text_content("#error-source") == "" and page.is_visible("#view-new")
    tab.shot("new-job-invalid")
    page.fill("#f-max_shard_size", "")
    page.fill("#f-target", "/etc/elsewhere")  # outside the storage roots: the API names `target`
    page.click("#job-submit")
    assert "write" in page.wait_for_selector("#error-target:not(:empty)").text_content()
    assert page.text_content("#error-options\\.max_shard_size") == ""
    assert not (site.data / "exports" / "never").exists()
    assert tab.errors == []


@pytest.mark.slow
def test_read_token_sees_no_cancel_button(browser: object, tab: Tab, site: Site) -> None:
    with site.server.client(site.tokens.write) as client:
        job = client.submit(job_spec("export", site.big, site.data / "exports" / "slow"))
    page = tab.page
    sign_in(tab, site.tokens.read, "read")
    assert page.is_hidden("a[data-nav=new]")
    page.evaluate("window.__sameDocument = 'yes'")
    page.click(f"#jobs-body tr[data-job='{job['id']}'] a")
    page.wait_for_selector("#job-timeline")
    assert page.get_attribute("#job-body .state", "data-state") in ("queued", "running")
    assert page.is_hidden("#job-cancel") and page.is_hidden("#job-retry")
    tab.shot("job-read-only")
    page.click("a[data-nav=jobs]")  # the live table, while the job runs
    row = f"#jobs-body tr[data-job='{job['id']}']"
    page.wait_for_selector(f"{row} .state[data-state=running]")
    # the submitter, in a browser context of its own, sees Cancel for the same job, and it works
    context = browser.new_context(viewport={"width": 1366, "height": 768})
    try:
        other = Tab(context.new_page(), [], [], tab.shots)
        other.page.goto(f"{site.server.url}/#/jobs/{job['id']}")
        sign_in(other, site.tokens.write, "write", view="job")
        other.page.wait_for_selector("#job-cancel:not([hidden])")
        assert other.page.get_attribute("#job-body .state", "data-state") == "running"
        other.page.click("#job-cancel")
        other.page.wait_for_selector("#job-body .state[data-state=cancelled]")
        assert other.page.is_visible("#job-retry") and other.page.is_hidden("#job-cancel")
        other.page.click("#job-retry")  # the same spec again, as a new job, which this page then follows
        for _ in range(200):  # (wait_for_function would need eval, which the page's CSP refuses)
            again = other.page.url.rsplit("/", 1)[-1]
            if again != job["id"]:
                break
            other.page.wait_for_timeout(50)
        assert again != job["id"]
        other.page.wait_for_selector("#job-cancel:not([hidden])")
        with site.server.client(site.tokens.read) as client:
            retried = client.job(again)
        assert retried["spec"] == job["spec"] and retried["submitted_by"] == "test-write"
        other.page.click("#job-cancel")
        other.page.wait_for_selector("#job-body .state[data-state=cancelled]")
    finally:
        context.close()
    # the read token's table followed the job to its end without a reload
    page.wait_for_selector(f"{row} .state[data-state=cancelled]")
    assert page.text_content(f"{row} .state") == "cancelled"
    assert page.evaluate("window.__sameDocument") == "yes"
    assert not (site.data / "exports" / "slow").exists()
    tab.shot("jobs")
    assert tab.dialogs == [] and tab.errors == []


@pytest.mark.slow
def test_without_tokens_the_page_opens_signed_in(browser: object, tmp_path: Path, site: Site) -> None:
    """The README's `ckptctl serve` (no tokens, loopback): the page needs no sign-in."""
    server = make_server(tmp_path / "state", read_roots=[site.data], write_roots=[tmp_path], workers=0)
    server.start()
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(f"{server.url}/")
        page.wait_for_selector("#view-jobs:not([hidden])")
        assert page.text_content("#who") == "anonymous · admin"
        assert page.is_hidden("#sign-out") and page.is_visible("a[data-nav=new]")
        # an empty Jobs page says what to do next: a link to the form, and the CLI command
        assert page.text_content("#jobs-body") == "No jobs yet: New job (or ckptctl export SOURCE TARGET)."
        page.click("#jobs-next-step")
        page.wait_for_selector("#view-new:not([hidden])")
        # the header fits a 420 px wide screen: nothing scrolls sideways, and every link is on screen
        page.set_viewport_size({"width": 420, "height": 800})
        assert page.evaluate("document.documentElement.scrollWidth") <= 420
        rights = page.eval_on_selector_all(".top a, .top span", "es => es.map(e => e.getBoundingClientRect().right)")
        assert rights and max(rights) <= 420, rights
    finally:
        context.close()
        server.stop()


@pytest.mark.slow
def test_lineage_graph_over_two_hops(tab: Tab, site: Site) -> None:
    """source -> export -> convert: the middle checkpoint's graph shows both hops, oldest on the left."""
    middle, last = site.data / "chain" / "mid", site.data / "chain" / "last.pt"
    with site.server.client(site.tokens.write) as client:
        first = site.server.wait_job(client.submit(job_spec("export", site.small, middle))["id"], ("succeeded",),
                                     token=site.tokens.write)
        second = site.server.wait_job(client.submit(job_spec("convert", middle, last, to="torch"))["id"],
                                      ("succeeded",), token=site.tokens.write)
    page = tab.page
    sign_in(tab, site.tokens.read, "read")
    page.goto(f"{site.server.url}/#/checkpoints/{first['result']['checkpoint_id']}")
    page.wait_for_selector("#view-checkpoint:not([hidden]) svg.lineage-graph")
    boxes = page.eval_on_selector_all(
        "svg.lineage-graph a.node", "ns => ns.map(n => [n.querySelector('text.label').textContent, "
        "Number(n.querySelector('rect').getAttribute('x')), n.classList.contains('current')])")
    order = [label for label, _, _ in sorted(boxes, key=lambda b: b[1])]
    assert order == ["step300.pt", "export job", "mid", "convert job", "last.pt"]
    assert [label for label, _, current in boxes if current] == ["mid"]
    edges = page.eval_on_selector_all("svg.lineage-graph path.edge",
                                      "es => es.map(e => [e.dataset.from, e.dataset.to])")
    mid, end = first["result"]["checkpoint_id"], second["result"]["checkpoint_id"]
    with site.server.http(site.tokens.read) as http:
        source = http.get(f"/v1/checkpoints/{mid}/lineage").json()["ancestors"][0]["checkpoint"]["id"]
    one, two = f"job:{first['id']}", f"job:{second['id']}"
    assert sorted(map(tuple, edges)) == sorted([(source, one), (one, mid), (mid, two), (two, end)])
    tab.shot("lineage-two-hops")
    page.click(f"svg.lineage-graph a[data-node='job:{second['id']}']")  # a job in the picture is a link
    page.wait_for_selector("#view-job:not([hidden]) #job-timeline")
    assert page.text_content("#job-title") == f"convert job {second['id']}"
    with site.server.client(site.tokens.write) as client:  # a job that fails: the two differ
        failed = site.server.wait_job(client.submit(job_spec("verify", site.small, site.source))["id"],
                                      ("failed", "succeeded"),
                                      token=site.tokens.write)
    page.goto(f"{site.server.url}/#/jobs/{failed['id']}")
    page.wait_for_selector("#job-body .error-box")
    assert page.text_content("#job-body .error-box strong") == failed["error"]["type"] == "VerifyError"
    assert page.text_content("#job-body .error-message") == failed["error"]["message"]
    assert page.text_content("#job-body .state") == "failed"
    assert page.is_hidden("#job-retry")  # a read token
    tab.shot("job-failed")

    # the table pages with the API's cursor, and filters by state and kind
    with site.server.http(site.tokens.read) as http:
        newest = [j["id"] for j in http.get("/v1/jobs", params={"limit": 4}).json()["items"]]
    page.goto(f"{site.server.url}/#/jobs?limit=2")
    rows = "#jobs-body tr[data-job]"
    rows_become(page, rows, "job", newest[:2])
    assert page.is_disabled("#jobs-newest")
    page.click("#jobs-older")
    rows_become(page, rows, "job", newest[2:4])
    page.click("#jobs-newest")
    rows_become(page, rows, "job", newest[:2])
    page.select_option("#filter-state", "failed")
    page.wait_for_selector(f"{rows}[data-job='{failed['id']}']")
    page.select_option("#filter-kind", "export")
    page.wait_for_selector("#jobs-body td.empty")
    assert page.text_content("#jobs-body") == "No jobs match these filters."
    assert page.url.endswith("#/jobs?state=failed&kind=export")
    assert tab.errors == []


@pytest.mark.slow
def test_markup_in_tensor_names_renders_as_text(tab: Tab, site: Site) -> None:
    with site.server.client(site.tokens.write) as client:
        evil = client.register(str(site.evil), name=EVIL, tags=["x"])
    page = tab.page
    sign_in(tab, site.tokens.read, "read")
    page.goto(f"{site.server.url}/#/checkpoints/{evil['id']}")
    page.wait_for_selector("#view-checkpoint:not([hidden]) svg.lineage-graph")
    assert page.text_content("#ckpt-title") == f"Checkpoint {EVIL}"
    page.click("#ckpt-tensors")
    page.wait_for_selector("#tensors")
    names = page.eval_on_selector_all("#tensors tbody tr td:first-child", "cs => cs.map(c => c.textContent)")
    assert sorted(names) == sorted([f"{EVIL}.weight", EVIL_IMG, "ok.bias"])
    for tag in ("script", "img"):  # no element was made from a name
        assert page.eval_on_selector_all(f"main {tag}", "s => s.length") == 0, tag
    assert EVIL in page.text_content("svg.lineage-graph a.current title")
    page.click("a[data-nav=checkpoints]")
    page.wait_for_selector(f"#ckpts-body tr[data-checkpoint='{evil['id']}']")
    assert EVIL in page.text_content(f"#ckpts-body tr[data-checkpoint='{evil['id']}']")
    page.fill("#filter-tag", "x")  # the registry's filters: only the checkpoint tagged x
    page.press("#filter-tag", "Enter")
    rows_become(page, "#ckpts-body tr[data-checkpoint]", "checkpoint", [evil["id"]])
    assert page.url == f"{site.server.url}/#/checkpoints?tag=x"
    tab.shot("checkpoint-markup")
    assert tab.dialogs == []  # alert() never ran
    assert page.eval_on_selector_all("script", "s => s.length") == 1


@pytest.mark.slow  # real FSDP jobs, consumer loads or a subprocess: the full suite
def test_wheel_ships_the_dashboard(tmp_path: Path) -> None:
    """Built from a copy of the source tree (no build/ left in the checkout), the wheel has every asset."""
    root = Path(__file__).resolve().parent.parent
    tree = tmp_path / "src"
    shutil.copytree(root, tree, ignore=shutil.ignore_patterns(".git", "tests", "benchmarks", "docker", "build",
                                                              "*.egg-info", "__pycache__", ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(tree), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("ckpt_service-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {n for n in archive.namelist() if n.startswith("api/dashboard/")}
    here = STATIC.parent
    wanted = {f"api/dashboard/{p.relative_to(here).as_posix()}" for p in here.rglob("*")
              if p.is_file() and "__pycache__" not in p.parts}
    assert wanted <= shipped
    assert {"api/dashboard/templates/index.html", "api/dashboard/static/dashboard.css",
            "api/dashboard/static/js/app.js"} <= shipped


def _dcp(path: Path, world: int = 2) -> Path:
    """A DCP checkpoint written by `world` ranks' worth of files (.metadata plus one file per rank)."""
    plain = _save(path.parent / f"{path.name}-src.pt", {f"w{i}": torch.ones(64, 32) * i for i in range(3)})
    subprocess.run([sys.executable, "-m", "ckptctl", "reshard", str(plain), str(path), "--world-size",
                    str(world)], check=True, capture_output=True, timeout=120)
    return path


@pytest.mark.slow
def test_checkpoint_page_lists_every_file_and_manages_aliases_and_tags(tab: Tab, site: Site) -> None:
    dcp = _dcp(site.data / "manage" / "dcp")
    on_disk = {p.name: p.stat().st_size for p in dcp.iterdir() if p.name != "ckpt-manifest.json"}
    assert sorted(on_disk) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    with site.server.client(site.tokens.write) as client:
        ckpt = client.register(str(dcp), name="sharded", tags=["stage=dev"], metadata={"run": "manage", "step": 7})
    page = tab.page
    sign_in(tab, site.tokens.write, "write")
    page.goto(f"{site.server.url}/#/checkpoints/{ckpt['id']}")
    page.wait_for_selector("#view-checkpoint:not([hidden]) svg.lineage-graph")
    files = page.eval_on_selector_all("#ckpt-files tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    assert files == [[name, f"{size} B" if size < 1024 else f"{size / 1024:.1f} KiB"]
                     for name, size in sorted(on_disk.items())]  # all three, with their sizes on disk
    assert page.text_content("#ckpt-made-by") == "registered by test-write in run manage, step 7"
    # set an alias, set and remove tags (`latest@manage` is the run's own alias)
    assert page.eval_on_selector_all("#ckpt-aliases tbody tr", "rs => rs.map(r => r.dataset.alias)") == \
        ["latest@manage"]
    page.fill("#alias-name", "prod")
    page.click("#alias-form button[type=submit]")
    page.wait_for_selector("#ckpt-aliases tr[data-alias='prod@manage']")
    page.fill("#tag-key", "pin")
    page.click("#tag-form button[type=submit]")
    page.wait_for_selector("#ckpt-tags tr[data-tag=pin]")
    page.click("#ckpt-tags button[data-remove-tag='stage=dev']")
    page.wait_for_selector("#ckpt-tags tr[data-tag='stage=dev']", state="detached")
    with site.server.http(site.tokens.read) as http:
        assert http.get(f"/v1/checkpoints/{ckpt['id']}/tags").json()["tags"] == ["pin"]
        assert http.get("/v1/aliases/manage/prod").json()["checkpoint"]["id"] == ckpt["id"]
    page.fill("#alias-name", "bad name")
    page.click("#alias-form button[type=submit]")
    assert "422" not in page.wait_for_selector("#alias-error:not(:empty)").text_content()
    page.click("#ckpt-aliases button[data-remove-alias='prod@manage']")
    page.wait_for_selector("#ckpt-aliases tr[data-alias='prod@manage']", state="detached")
    with site.server.http(site.tokens.read) as http:
        assert http.get("/v1/aliases/manage/prod").status_code == 404
    tab.shot("checkpoint-manage")
    # a read token sees the aliases and tags, and no action
    page.click("#sign-out")
    sign_in(tab, site.tokens.read, "read", view="checkpoint")
    page.wait_for_selector("#ckpt-tags tr[data-tag=pin]")
    assert page.locator("#ckpt-manage button").count() == 0 and page.locator("#ckpt-manage form").count() == 0
    assert page.locator("#view-checkpoint button:visible").all_text_contents() == ["Read the tensor table"]


@pytest.mark.slow
def test_sign_out_only_when_signed_in(tab: Tab, site: Site) -> None:
    page = tab.page
    page.wait_for_selector("#view-signin:not([hidden])")
    assert page.is_hidden("#sign-out")
    page.fill("#token", "ckpt_not_a_token")
    page.press("#token", "Enter")
    page.wait_for_selector("#token-error:not(:empty)")
    assert page.is_hidden("#sign-out") and page.text_content("#who") == ""  # a refused token is not signed in


@pytest.mark.slow
def test_runs_rules_and_retention(tab: Tab, site: Site) -> None:
    run = site.data / "steps" / "r1"
    steps = {step: _save(run / f"step_{step}.pt", {"w": torch.ones(8, 8) * step}) for step in (100, 200)}
    with site.server.client(site.tokens.write) as client:
        ids = {step: client.register(str(path), metadata={"run": "r1", "step": step})["id"]
               for step, path in steps.items()}
    with site.server.http(site.tokens.write) as http:
        out = str(site.data / "rule-out" / "{name}")
        rule = http.post("/v1/rules", json={"name": "exports", "pattern": str(site.data / "rulerun" / "*.pt"),
                                            "job": {"kind": "export", "target": out}})
        assert rule.status_code == 201, rule.text
        rule = rule.json()
        fired = _save(site.data / "rulerun" / "step_1.pt", {"w": torch.ones(4)})
        notified = http.post("/v1/notify", json={"uri": str(fired)}).json()
        assert [t["state"] for t in notified["triggers"]] == ["submitted"]
    with site.server.http(site.tokens.admin) as http:
        policy = http.post("/v1/policies", json={"name": "keep1", "run": "r1", "keep_last": 1})
        assert policy.status_code == 201, policy.text
    page = tab.page
    sign_in(tab, site.tokens.write, "write")
    page.click("a[data-nav=runs]")
    row = page.wait_for_selector("#runs tr[data-run=r1]")
    assert [c.text_content() for c in row.query_selector_all("td")][:4] == ["r1", "2", "200", ids[200]]
    page.click("#runs tr[data-run=r1] a")
    page.wait_for_selector("#steps")
    assert page.eval_on_selector_all("#steps tbody tr", "rs => rs.map(r => r.cells[1].textContent)") == \
        ["step_100.pt", "step_200.pt"]
    assert page.text_content("#run-title") == "Run r1"

    page.click("a[data-nav=rules]")
    cells = page.wait_for_selector(f"#rules tr[data-rule={rule['id']}]").query_selector_all("td")
    assert [c.text_content() for c in cells[:5]] == ["exports", rule["spec"]["pattern"], "export",
                                                     rule["spec"]["job"]["target"], "active"]
    page.click(f"#rules button[data-toggle={rule['id']}]")  # pause
    page.wait_for_selector(f"#rules tr[data-rule={rule['id']}] button:text('Resume')")
    assert page.text_content(f"#rules tr[data-rule={rule['id']}] td:nth-child(5)") == "paused"
    with site.server.http(site.tokens.read) as http:
        assert http.get(f"/v1/rules/{rule['id']}").json()["paused"] is True
    page.click(f"#rules button[data-toggle={rule['id']}]")  # resume
    page.wait_for_selector(f"#rules tr[data-rule={rule['id']}] button:text('Pause')")
    page.click(f"#rules tr[data-rule={rule['id']}] a")
    trigger = page.wait_for_selector(f"#triggers tr[data-trigger={notified['checkpoint_id']}]")
    texts = [c.text_content() for c in trigger.query_selector_all("td")]
    assert texts[0] == str(fired) and texts[1] in ("submitted", "done")
    assert texts[2] == notified["triggers"][0]["job_id"]

    page.click("a[data-nav=retention]")
    page.wait_for_selector("#policies tr")
    assert page.eval_on_selector_all("#policies tbody tr", "rs => rs.map(r => r.cells[0].textContent)") == ["keep1"]
    assert "keep the last 1 steps" in page.text_content("#policies")
    plan = page.eval_on_selector_all("#gc tbody tr", "rs => rs.map(r => r.dataset.plan)")
    assert plan == [ids[100]]  # the older step goes, the newest stays
    assert page.text_content("#gc-total").startswith("1 checkpoint(s)")
    assert page.text_content("#deletions-body") == "No deletions yet."
    with site.server.http(site.tokens.admin) as http:
        assert http.post("/v1/gc", json={"dry_run": False}).json()["plan"][0]["checkpoint_id"] == ids[100]
    page.reload()
    row = page.wait_for_selector("#deletions tbody tr")
    assert row.query_selector("td").text_content() == str(steps[100])
    assert "done" in row.text_content() and "keep1" in row.text_content()
    assert page.text_content("#gc-total") == "Nothing would be deleted now."
    tab.shot("retention")
    assert tab.errors == []


def test_run_page_plots_its_scanned_steps(tab: Tab, site: Site) -> None:
    """Three steps of a run, scanned: the run page draws each layer's norm (three points), its change from step
    to step (two), and the NaN/Inf count (three, the last one 1)."""
    run = site.data / "plotted" / "r9"
    steps = {}
    for step in (10, 20, 30):
        weight = torch.full((8, 8), float(step))
        if step == 30:
            weight[0, 0] = float("nan")
        steps[step] = _save(run / f"step_{step}.pt", {"layers.0.weight": weight, "layers.1.weight": torch.ones(4, 4)})
    with site.server.client(site.tokens.write) as client:
        for step, path in steps.items():
            client.register(str(path), metadata={"run": "r9", "step": step})
        jobs = [client.submit(job_spec("scan", path))["id"] for path in steps.values()]
    for job in jobs:
        site.server.wait_job(job, ("succeeded",), token=site.tokens.read)
    with site.server.http(site.tokens.read) as http:
        points = http.get("/v1/runs/r9/stats").json()
    assert [p["step"] for p in points] == [10, 20, 30] and [p["nonfinite"] for p in points] == [0, 0, 1]
    assert points[0]["norms"]["layers.0"] == pytest.approx(80.0) and points[1]["norm_change"]["layers.0"] == 1.0
    page = tab.page
    sign_in(tab, site.tokens.read, "read")
    page.goto(f"{site.server.url}/#/runs/r9")
    page.wait_for_selector("#plot-norms")
    count = "(sel) => document.querySelectorAll(sel).length"
    assert page.evaluate(count, "#plot-norms g[data-series='layers.1'] circle") == 3
    assert page.evaluate(count, "#plot-change g[data-series='layers.1'] circle") == 2
    steps_drawn = page.eval_on_selector_all("#plot-nonfinite circle", "cs => cs.map(c => c.dataset.step)")
    assert steps_drawn == ["10", "20", "30"]
    assert "NaN/Inf at step 30: 1" in page.text_content("#plot-nonfinite")
    tab.shot("run-plots")
    assert tab.errors == []


def _torch_layer_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float | None]:
    """Per layer (converters' grouping of keys): torch's relative L2 change ||a-b|| / ||b|| of its tensors together
    in float64, None for a layer none of whose tensors changed at all."""
    from converters.stats.diffs import layer_of

    diff_sq: dict[str, float] = {}
    sq: dict[str, float] = {}
    moved: set[str] = set()
    for name in sorted(set(a) & set(b)):
        x, y = a[name].double(), b[name].double()
        layer = layer_of(name)
        diff_sq[layer] = diff_sq.get(layer, 0.0) + float(((x - y) ** 2).sum())
        sq[layer] = sq.get(layer, 0.0) + float((y**2).sum())
        if not torch.equal(x, y):
            moved.add(layer)
    return {layer: (diff_sq[layer] ** 0.5 / sq[layer] ** 0.5 if layer in moved else None) for layer in diff_sq}


@pytest.mark.slow
def test_the_diff_view_names_the_changed_layers(tab: Tab, site: Site) -> None:
    """Three real FSDP2 steps (tests/stats_job.py: `layers.1` frozen): from the run page the user compares steps 1
    and 2; the diff job's view draws one bar per layer, names the layers that moved most in torch's order and the
    frozen one as unmoved, and each layer's relative change equals torch's on the gathered tensors."""
    from tests import stats_job

    out = site.data / "fsdp2"
    run_tool("stats_job", out)
    with site.server.client(site.tokens.write) as client:
        for step in range(1, stats_job.STEPS + 1):
            client.register(str(out / f"step-{step}"), metadata={"run": "fsdp2", "step": step})
    full = {step: {n.removeprefix("model."): t
                   for n, t in torch.load(out / f"full-{step}.pt", weights_only=True).items()} for step in (1, 2)}
    want = _torch_layer_diff(full[1], full[2])
    assert [layer for layer, rel in want.items() if rel is None] == [stats_job.FROZEN]
    model = {layer: rel for layer, rel in want.items() if not layer.startswith("optim.")}
    moved = sorted((layer for layer, rel in model.items() if rel is not None), key=lambda layer: -(model[layer] or 0))
    assert sorted(moved) == ["embed", "head", "layers.0", "layers.2"]

    page = tab.page
    sign_in(tab, site.tokens.write, "write")
    page.goto(f"{site.server.url}/#/runs/fsdp2")
    page.wait_for_selector("#diff-form")
    page.select_option("#diff-a", str(out / "step-1"))
    page.select_option("#diff-b", str(out / "step-2"))
    page.click("#diff-form button[type=submit]")
    page.wait_for_selector("#diff-layers", timeout=60_000)
    assert page.text_content("#run-diff h2") == "Diff: step 1 → step 2"
    script = "gs => gs.map(g => [g.dataset.layer, g.classList.contains('unchanged')])"
    bars = page.eval_on_selector_all("#diff-chart g.bar", script)
    assert bars == [[layer, False] for layer in moved] + [[stats_job.FROZEN, True]]  # largest first, frozen last
    optim = page.eval_on_selector_all("#diff-chart-optim g.bar", script)  # the optimizer state apart
    assert sorted(layer for layer, _ in optim) == sorted(layer for layer in want if layer.startswith("optim."))
    assert page.eval_on_selector_all("#diff-moved li", "ls => ls.map(l => l.dataset.name)") == moved
    assert page.eval_on_selector_all("#diff-unchanged li", "ls => ls.map(l => l.dataset.name)") == [stats_job.FROZEN]
    shown = dict(page.eval_on_selector_all("#diff-layers tbody tr", "rs => rs.map(r => [r.dataset.layer, "
                                           "Number(r.dataset.rel)])"))
    assert shown.keys() == want.keys()
    for layer, rel in want.items():
        assert shown[layer] == pytest.approx(rel or 0.0, rel=1e-12, abs=0.0), layer
    assert page.text_content("#diff-only-a") == "Only in step 1None."  # the same tensors on both sides
    tab.shot("run-diff")
    # a read token opens the same view by its address, and has no form
    job_id = page.evaluate("() => new URLSearchParams(location.hash.split('?')[1]).get('diff')")
    page.click("#sign-out")
    sign_in(tab, site.tokens.read, "read", view="run")
    page.wait_for_selector("#diff-layers")
    assert page.locator("#diff-form").count() == 0 and job_id in page.text_content("#diff-state")
    assert tab.errors == []


@pytest.mark.slow
def test_checkpoint_page_shows_certificate_scrub_and_damage(tab: Tab, site: Site) -> None:
    """An output of a convert job carries a certificate: its page says what it covers and that it was never
    scrubbed; after a clean scrub it shows the scrub; after a flipped bit the next scrub fails and the page warns
    that it is damaged, naming the file."""
    source = _save(site.data / "integrity" / "src.pt", {f"l{i}.weight": torch.ones(16, 16) * i for i in range(3)})
    out = site.data / "integrity" / "out"
    with site.server.client(site.tokens.write) as client:
        made = client.submit(job_spec("convert", source, out))["id"]
    made = site.server.wait_job(made, ("succeeded",), token=site.tokens.read)
    output = made["result"]["checkpoint_id"]
    page = tab.page
    sign_in(tab, site.tokens.read, "read")
    page.goto(f"{site.server.url}/#/checkpoints/{output}")
    page.wait_for_selector("#ckpt-certificate")
    assert page.text_content("#ckpt-certificate") == ("yes: 3 tensors, 1 output file with CRC-32s, 1 source file "
                                                      "named")
    assert page.text_content("#ckpt-scrub") == "never scrubbed" and page.locator("#ckpt-damaged").count() == 0
    scrubs = []
    for flip in (False, True):
        if flip:
            data = out / "model.safetensors"
            raw = bytearray(data.read_bytes())
            raw[-1] ^= 0x10
            data.write_bytes(bytes(raw))
        with site.server.client(site.tokens.write) as client:
            scrubs.append(client.submit(job_spec("scrub", out))["id"])
        site.server.wait_job(scrubs[-1], ("succeeded", "failed"), token=site.tokens.read)
        page.reload()
        page.wait_for_selector(f"#ckpt-scrub a:text('{scrubs[-1]}')")
        if not flip:
            assert page.get_attribute("#ckpt-scrub", "data-state") == "succeeded"
            assert page.locator("#ckpt-damaged").count() == 0
    assert page.get_attribute("#ckpt-scrub", "data-state") == "failed"
    warning = page.text_content("#ckpt-damaged")
    assert warning.startswith("Damaged: a scrub found this checkpoint differs from its recorded checksums: ")
    assert f"{out / 'model.safetensors'}: bytes 0-" in warning
    tab.shot("checkpoint-damaged")
    assert tab.errors == []


@pytest.mark.slow
def test_job_pages_show_reason_log_fields_and_files(tab: Tab, site: Site) -> None:
    source = _save(site.data / "jobpage" / "step_5.pt", {f"w{i}": torch.ones(32, 32) for i in range(2)})
    target = site.data / "jobpage" / "export"
    with site.server.client(site.tokens.write) as client:
        export = site.server.wait_job(client.submit(job_spec("export", source, target, dtype="bfloat16"))["id"],
                                      ("succeeded", "failed"), token=site.tokens.write)
        failed = site.server.wait_job(client.submit(job_spec("verify", source, site.small))["id"],
                                      ("failed", "succeeded"), token=site.tokens.write)
    assert export["state"] == "succeeded" and failed["state"] == "failed"
    page = tab.page
    sign_in(tab, site.tokens.read, "read")
    reason = page.wait_for_selector(f"#jobs-body tr[data-job={failed['id']}] .reason")
    assert reason.text_content() == f"{failed['error']['type']}: {failed['error']['message']}"
    assert page.locator(f"#jobs-body tr[data-job={export['id']}] .reason").count() == 0

    page.goto(f"{site.server.url}/#/jobs/{export['id']}")
    page.wait_for_selector("#job-log")
    log = page.text_content("#job-log")
    assert log.startswith("--- attempt 1 ---") and '"event": "job.succeeded"' in log and export["id"] in log
    spec = page.eval_on_selector_all("#job-spec dt", "ds => ds.map(d => [d.textContent, "
                                                     "d.nextElementSibling.textContent])")
    assert spec[:2] == [["source", str(source)], ["target", str(target)]]
    assert ["dtype", "bfloat16"] in spec and ["max shard size", "4.7 GiB"] in spec
    assert not {"world size", "layout", "rtol", "to"} & {k for k, _ in spec}  # not export's options
    files = page.eval_on_selector_all("#job-files tbody tr", "rs => rs.map(r => [...r.cells].map(c => c.textContent))")
    on_disk = {o["name"]: o["bytes"] for o in export["result"]["outputs"]}
    assert files == [[n, f"{b / 1024:.1f} KiB"] for n, b in sorted(on_disk.items())]
    assert {"model.safetensors"} <= set(on_disk)
    assert "total bytes" in page.text_content("#job-result") and page.locator("#job-body pre.spec").count() == 0
    tab.shot("job-export-fields")
    with site.server.http(site.tokens.read) as http:
        body = http.get(f"/v1/jobs/{export['id']}/logs").json()
        assert body["text"] == log and body["truncated"] is False
        assert http.get("/v1/jobs/job_unknown/logs").status_code == 404
        assert httpx.get(f"{site.server.url}/v1/jobs/{export['id']}/logs", timeout=10).status_code == 401

    # the source, registered when the export finished, says so
    ckpt = next(c for c in site.server.client(site.tokens.read).checkpoints(limit=200)["items"]
                if c["uri"] == str(source))
    page.goto(f"{site.server.url}/#/checkpoints/{ckpt['id']}")
    page.wait_for_selector("#view-checkpoint:not([hidden]) svg.lineage-graph")
    assert page.text_content("#ckpt-made-by") == f"registered as the source of job {export['id']}"
    assert tab.errors == []


@pytest.mark.slow
def test_form_errors_beside_their_fields_and_reshard_sends_no_only(tab: Tab, site: Site) -> None:
    page = tab.page
    sign_in(tab, site.tokens.write, "write")
    bodies: list[str] = []
    page.on("request", lambda r: bodies.append(r.post_data or "") if r.method == "POST" else None)
    page.goto(f"{site.server.url}/#/new")
    page.wait_for_selector("#view-new:not([hidden])")
    page.select_option("#f-kind", "export")
    page.fill("#f-source", str(site.source))
    page.fill("#f-target", str(site.evil))  # exists already
    page.click("#job-submit")
    slot = page.wait_for_selector(".field-error:not(:empty)")
    assert slot.get_attribute("id") in ("error-options.overwrite", "error-target"), slot.get_attribute("id")
    assert page.text_content("#error-form") == ""
    page.select_option("#f-kind", "reshard")
    page.fill("#f-source", str(site.data / "missing.pt"))
    page.fill("#f-target", str(site.data / "reshard-never"))
    page.fill("#f-world_size", "2")
    page.click("#job-submit")
    page.wait_for_selector(".field-error:not(:empty)")
    sent = json.loads(bodies[-1])
    assert sent["kind"] == "reshard" and "only" not in sent["options"], sent


@pytest.mark.slow
def test_audit_page_for_admins_only(tab: Tab, site: Site) -> None:
    """Admins see the audit log: a change with its object as JSON text (markup in it stays text) and a refused
    attempt with the line its caller got, filtered through the form; other tokens get no Audit link."""
    path = _save(site.data / "audited" / "step1.pt", {"w": torch.ones(4, 4)})
    with site.server.http(site.tokens.write) as http, site.server.http(site.tokens.read) as reader:
        made = http.post("/v1/checkpoints", json={"uri": str(path), "metadata": {"note": EVIL}})
        assert made.status_code == 201, made.text
        refused = reader.post("/v1/checkpoints", json={"uri": str(path), "name": "again"})
        assert refused.status_code == 403
    page = tab.page
    sign_in(tab, site.tokens.write, "write")
    assert page.is_hidden("#nav-audit")
    page.click("#sign-out")
    sign_in(tab, site.tokens.admin, "admin")
    assert page.is_visible("#nav-audit")
    page.click("#nav-audit")
    page.wait_for_selector("#view-audit:not([hidden])")
    page.fill("#audit-principal", "test-read")
    page.click("#audit-filters button[type=submit]")
    wait_for(lambda: "principal=test-read" in page.evaluate("location.hash"), 10, "the filter in the address")
    rows_become(page, "#audit tbody tr", "outcome", ["refused"])
    cells = page.eval_on_selector_all("#audit tbody tr td", "tds => tds.map(td => td.textContent)")
    assert cells[1:6] == ["test-read", "checkpoint.register", "checkpoint:(new)", "refused",
                          "HTTP 403: " + refused.json()["error"]["message"]]
    page.fill("#audit-principal", "test-write")
    page.fill("#audit-object", f"checkpoint:{made.json()['id']}")
    page.click("#audit-filters button[type=submit]")
    rows_become(page, "#audit tbody tr", "outcome", ["done"])
    page.click("#audit tbody tr details summary")
    after = json.loads(page.text_content("#audit pre[data-side=after]"))
    assert (after["id"], after["uri"], after["metadata"]["note"]) == (made.json()["id"], str(path), EVIL)
    assert page.text_content("#audit pre[data-side=before]") == "(none)"
    assert tab.dialogs == [] and tab.errors == []
