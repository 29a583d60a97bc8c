// The dashboard: sign-in, a hash router (#/jobs, #/jobs/ID, #/checkpoints, #/checkpoints/ID, #/runs, #/runs/RUN,
// #/rules, #/rules/ID, #/retention, #/new, #/audit, #/health)
// and the views. Data comes only from the public REST API; every value is put in the page as text.

import { api, ApiError, setToken, token } from "./api.js";
import { showAudit } from "./audit.js";
import { showCheckpoint, showCheckpoints } from "./checkpoints.js";
import { el } from "./dom.js";
import { showHealth } from "./health.js";
import { showJob, showJobs } from "./jobs.js";
import { showRetention, showRule, showRules, showRun, showRuns } from "./manage.js";
import { setupForm } from "./newjob.js";
import { canWrite, session } from "./session.js";

let current = new AbortController();
const ID_TOKEN = "ckpt-id-token";  // the issuer's ID token after an issuer sign-in (sessionStorage, this tab)

function notify(message) {
  const notice = document.getElementById("notice");
  notice.textContent = message || "";
  notice.hidden = !message;
}

function showView(name) {
  for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== `view-${name}`;
  for (const a of document.querySelectorAll("[data-nav]")) {
    if (a.dataset.nav === name.replace(/^(job|checkpoint|run|rule)$/, "$1s")) {
      a.setAttribute("aria-current", "page");
    } else {
      a.removeAttribute("aria-current");
    }
  }
}

function showWho() {
  const who = document.getElementById("who");
  const signedIn = Boolean(session.who);
  who.textContent = signedIn ? `${session.who.name} · ${session.who.scope}${session.who.scope === "read"
    ? " (read-only)" : ""}` : "";
  // only a token that was accepted can be signed out of (not a refused one, not a server without tokens)
  document.getElementById("sign-out").hidden = !(signedIn && token());
  document.getElementById("nav-new").hidden = !canWrite();
  document.getElementById("nav-audit").hidden = !(signedIn && session.who.scope === "admin");
}

async function whoami() {
  try {
    session.who = await api("/v1/whoami");
  } catch (error) {
    session.who = null;
    if (!(error instanceof ApiError) || error.status !== 401) throw error;
  }
  showWho();
  return session.who;
}

function signIn(message) {
  current.abort();
  session.who = null;
  showWho();
  showView("signin");
  document.getElementById("token-error").textContent = message || "";
  document.getElementById("token").focus();
}

// Back from the OpenID issuer (GET /v1/session/callback sent the browser to #/sso/HANDOFF): trade the one-time
// handoff id for the access token, kept in sessionStorage like a pasted one; the id leaves the address bar first.
async function finishSso() {
  const match = /^#\/sso\/([A-Za-z0-9_-]{1,128})$/.exec(location.hash);
  if (!match) return;
  history.replaceState(null, "", `${location.pathname}#/jobs`);
  try {
    const found = await api("/v1/session/handoff", { method: "POST", body: { handoff: match[1] } });
    setToken(found.access_token);
    // kept beside the token, for this tab only: signing out hands it to the issuer as id_token_hint
    if (found.id_token) sessionStorage.setItem(ID_TOKEN, found.id_token);
  } catch (error) {
    notify(`Sign-in did not complete: ${error.message}`);
  }
}

// Sign out: forget the tokens here; after an issuer sign-in, also end the issuer's session (RP-initiated
// logout) where it offers that: the browser goes to the issuer, which sends it back to the dashboard.
async function signOut() {
  const idToken = sessionStorage.getItem(ID_TOKEN);
  sessionStorage.removeItem(ID_TOKEN);
  setToken("");
  if (idToken) {
    try {
      const { url } = await api("/v1/session/logout", { method: "POST", body: { id_token_hint: idToken } });
      if (url) {
        location.assign(url);
        return;
      }
    } catch (error) {
      notify(`Signed out here; the issuer's session may remain: ${error.message}`);
    }
  }
  signIn();
}

async function offerSso() {
  try {
    document.getElementById("sso").hidden = !(await api("/v1/session/config")).sso;
  } catch {
    document.getElementById("sso").hidden = true;
  }
}

function parseHash() {
  const [path, search] = location.hash.replace(/^#\/?/, "").split("?");
  const [section, ...rest] = path.split("/");
  return { section: section || "jobs", id: rest.length ? decodeURIComponent(rest.join("/")) : "",
    params: new URLSearchParams(search || "") };
}

// Each section's views: `one` for an address naming an item (#/runs/RUN), `all` for the section itself; each is
// [the view's id, show(id, params, signal)]. An unknown section shows the jobs.
const ROUTES = {
  jobs: { one: ["job", (id, params, signal) => showJob(id, signal, notify)],
    all: ["jobs", (id, params, signal) => showJobs(params, signal)] },
  checkpoints: { one: ["checkpoint", (id, params, signal) => showCheckpoint(id, signal)],
    all: ["checkpoints", (id, params, signal) => showCheckpoints(params, signal)] },
  runs: { one: ["run", (id, params, signal) => showRun(id, signal, params)],
    all: ["runs", (id, params, signal) => showRuns(signal)] },
  rules: { one: ["rule", (id, params, signal) => showRule(id, signal)],
    all: ["rules", (id, params, signal) => showRules(signal, route)] },
  retention: { all: ["retention", (id, params, signal) => showRetention(signal, route)] },
  new: { all: ["new", () => {
    if (!canWrite()) notify("This token is read-only: it cannot submit jobs.");
    document.getElementById("job-submit").disabled = !canWrite();
  }] },
  audit: { all: ["audit", (id, params, signal) => showAudit(params, signal)] },
  health: { all: ["health", (id, params, signal) => showHealth(signal)] },
};

async function route() {
  current.abort();
  current = new AbortController();
  const { signal } = current;
  notify("");
  if (!session.who) {
    signIn();
    return;
  }
  const { section, id, params } = parseHash();
  try {
    const known = Object.hasOwn(ROUTES, section) ? ROUTES[section] : ROUTES.jobs;
    const [view, show] = (id && known.one) || known.all;
    showView(view);
    await show(id, params, signal);
  } catch (error) {
    if (signal.aborted || error.name === "AbortError") return;
    if (error instanceof ApiError && error.status === 401) signIn(error.message);
    else notify(error.message);
  }
}

function setHashParams(base, form) {
  const params = new URLSearchParams();
  for (const input of form.querySelectorAll("input, select")) if (input.value) params.set(input.name, input.value);
  const s = params.toString();
  location.hash = s ? `${base}?${s}` : base;
}

function pageTo(base, cursor) {
  const { params } = parseHash();
  if (cursor) params.set("cursor", cursor);
  else params.delete("cursor");
  const s = params.toString();
  location.hash = s ? `${base}?${s}` : base;
}

function setup() {
  document.getElementById("skip").addEventListener("click", (e) => { // not a route: just move the focus
    e.preventDefault();
    document.getElementById("main").focus();
  });
  // each paged list: its filter form (applied on submit; the jobs' also on every change) and its two pager buttons
  for (const [route, form, next, first] of [["#/jobs", "job-filters", "jobs-older", "jobs-newest"],
    ["#/checkpoints", "ckpt-filters", "ckpts-next", "ckpts-first"],
    ["#/audit", "audit-filters", "audit-older", "audit-newest"]]) {
    const filters = document.getElementById(form);
    filters.addEventListener("submit", (e) => {
      e.preventDefault();
      setHashParams(route, filters);
    });
    document.getElementById(next).addEventListener("click", (e) => pageTo(route, e.target.dataset.cursor));
    document.getElementById(first).addEventListener("click", () => pageTo(route, ""));
  }
  const jobFilters = document.getElementById("job-filters");
  jobFilters.addEventListener("change", () => setHashParams("#/jobs", jobFilters));
  document.getElementById("signin-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const input = document.getElementById("token");
    setToken(input.value.trim());
    input.value = "";
    try {
      if (await whoami()) route();
      else {
        setToken("");
        signIn("That token was not accepted (unknown or revoked).");
      }
    } catch (error) {
      signIn(error.message);
    }
  });
  document.getElementById("sign-out").addEventListener("click", () => {
    signOut().catch((error) => signIn(error.message));
  });
  setupForm();
  window.addEventListener("hashchange", route);
}

async function start() {
  setup();
  await finishSso();
  await offerSso();
  try {
    await whoami();
  } catch (error) {
    notify(`The server did not answer: ${error.message}`);
    return;
  }
  route();
}

start().catch((error) => document.body.prepend(el("p", { class: "notice" }, String(error))));
