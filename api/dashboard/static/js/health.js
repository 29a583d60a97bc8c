// Health: the server's /healthz and /readyz, queue length and version.

import { api } from "./api.js";
import { clear, el } from "./dom.js";
import { session } from "./session.js";

async function ready(signal) {
  const response = await fetch("/readyz", { signal, headers: { Accept: "application/json" } });
  return response.json(); // 503 still carries the checks
}

async function count(state, signal) {
  const page = await api(`/v1/jobs?state=${state}&limit=200`, { signal });
  return `${page.items.length}${page.next_cursor ? "+" : ""}`;
}

export async function showHealth(signal) {
  const box = document.getElementById("health-body");
  const [live, readiness, queued, running] = await Promise.all([
    api("/healthz", { signal }).then((h) => h.status, (e) => e.message), ready(signal),
    count("queued", signal), count("running", signal)]);
  const checks = readiness.checks || {};
  const workers = checks.workers;
  const rows = [
    ["Liveness", live], ["Readiness", readiness.status],
    ["Store", checks.store_problem ? `${checks.store}: ${checks.store_problem}` : checks.store],
    ["Job slots", typeof workers === "object" ? `${workers.busy} of ${workers.slots} in use` : String(workers)],
    ["Workers alive", typeof workers === "object" ? (workers.alive ? "yes" : "no") : "–"],
    ["Workers seen", checks.workers_seen ?? "–"],
    ["Queued jobs", queued], ["Running jobs", running],
    ["Version", session.who ? session.who.version : "–"],
  ];
  clear(box);
  for (const [k, v] of rows) {
    const bad = (k === "Readiness" && v !== "ready") || (k === "Store" && v !== "ok");
    box.append(el("dt", {}, k), el("dd", { class: bad ? "bad" : "" }, String(v)));
  }
}
