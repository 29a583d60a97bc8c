// The jobs table (live) and one job's page.

import { api, follow, query } from "./api.js";
import { age, bytes, checkpointLink, clear, duration, el, facts, progressCell, stateBadge, table, when } from "./dom.js";
import { appliesTo, canCancel, canWrite, pageSize, TERMINAL } from "./session.js";

const MAX_STREAMS = 5; // the API caps streams per token (10 by default); leave room for other tabs
const REFRESH_MS = 5000;

function shortId(id) {
  return id.length > 12 ? `${id.slice(0, 12)}…` : id;
}

// The last two segments of a path or URI (the table is narrow); the whole of it is in the title.
function shortPath(path, prefix = "") {
  const parts = path.split("/").filter(Boolean);
  const tail = parts.slice(-2).join("/");
  return el("span", { class: "path", title: path }, prefix, parts.length > 2 ? `…/${tail}` : path);
}

function throughput(p) {
  return p && p.throughput_bytes_per_s ? `${bytes(p.throughput_bytes_per_s)}/s` : "–";
}

function jobRow(job) {
  const spec = job.spec;
  return el("tr", { "data-job": job.id },
    el("td", {}, el("a", { href: `#/jobs/${encodeURIComponent(job.id)}`, title: job.id }, shortId(job.id))),
    el("td", {}, job.kind),
    el("td", { class: "paths" }, shortPath(spec.source), spec.target ? shortPath(spec.target, "→ ") : ""),
    el("td", {}, stateBadge(job), job.error ? el("div", { class: "reason", title: job.error.message },
      `${job.error.type}: ${job.error.message}`) : ""),
    el("td", {}, progressCell(job)),
    el("td", {}, throughput(job.progress)),
    el("td", {}, job.progress && job.progress.eta_seconds !== null ? duration(job.progress.eta_seconds) : "–"),
    el("td", {}, `${job.attempt}/${job.max_attempts}`),
    el("td", {}, job.submitted_by || "–"),
    el("td", { title: job.created_at, class: "nowrap" }, age(job.created_at)));
}

// An empty table says what to do next: submit a job (in the page, or with the CLI), or widen the filters.
function noJobs(state, kind, cursor) {
  if (state || kind || cursor) return "No jobs match these filters.";
  const cli = el("code", {}, "ckptctl export SOURCE TARGET");
  return canWrite() ? ["No jobs yet: ", el("a", { href: "#/new", id: "jobs-next-step" }, "New job"), " (or ", cli, ")."]
    : ["No jobs yet. Someone with a write token submits them (", cli, ")."];
}

// Apply an SSE event to a job document: `state`/`end` carry the whole document, `progress` a part of it.
function apply(job, name, data) {
  if (name === "progress") return { ...job, state: data.state, attempt: data.attempt, progress: data.progress };
  return data;
}

export async function showJobs(params, signal) {
  const body = document.getElementById("jobs-body");
  const state = params.get("state") || "";
  const kind = params.get("kind") || "";
  const cursor = params.get("cursor") || "";
  const limit = pageSize(params);
  document.getElementById("filter-state").value = state;
  document.getElementById("filter-kind").value = kind;
  const jobs = new Map();
  const streams = new Map();
  const replace = (job) => {
    jobs.set(job.id, job);
    const row = body.querySelector(`tr[data-job="${CSS.escape(job.id)}"]`);
    if (row) row.replaceWith(jobRow(job));
  };
  const watch = (job) => {
    if (TERMINAL.has(job.state) || streams.has(job.id) || streams.size >= MAX_STREAMS) return;
    const stop = new AbortController();
    signal.addEventListener("abort", () => stop.abort());
    streams.set(job.id, stop);
    follow(job.id, (name, data) => replace(apply(jobs.get(job.id) || job, name, data)), stop.signal)
      .catch(() => {}) // a stream refused (429) or cut: the periodic refresh still updates the row
      .finally(() => streams.delete(job.id));
  };
  const load = async () => {
    const page = await api(`/v1/jobs${query({ state, kind, cursor, limit })}`, { signal });
    clear(body);
    if (!page.items.length) body.append(el("tr", {}, el("td", { colspan: "10", class: "empty" }, noJobs(state, kind,
      cursor))));
    for (const job of page.items) {
      jobs.set(job.id, job);
      body.append(jobRow(job));
    }
    page.items.forEach(watch);
    const older = document.getElementById("jobs-older");
    older.disabled = !page.next_cursor;
    older.dataset.cursor = page.next_cursor || "";
    document.getElementById("jobs-newest").disabled = !cursor;
  };
  await load();
  if (!cursor) { // the first page also picks up newly submitted jobs
    const timer = setInterval(() => load().catch(() => {}), REFRESH_MS);
    signal.addEventListener("abort", () => clearInterval(timer));
  }
}

function timelineItem(label, at) {
  return el("li", {}, el("time", { datetime: at || "" }, at ? when(at) : new Date().toLocaleString()), " ", label);
}

function renderJob(job, box) {
  const p = job.progress;
  const parts = [facts([
    ["Id", job.id], ["Kind", job.kind], ["State", stateBadge(job)], ["Progress", progressCell(job)],
    ["Throughput", throughput(p)], ["ETA", p && p.eta_seconds !== null ? duration(p.eta_seconds) : "–"],
    ["Attempt", `${job.attempt} of ${job.max_attempts}`], ["Submitted by", job.submitted_by || "–"],
    ["Submitted", when(job.created_at)], ["Started", when(job.started_at)], ["Finished", when(job.finished_at)],
    ["Worker", job.worker || "–"],
  ])];
  if (job.error) {
    parts.push(el("div", { class: "error-box", role: "alert" }, el("h2", {}, "Error"),
      el("p", {}, el("strong", {}, job.error.type), ": ", el("span", { class: "error-message" }, job.error.message))));
  }
  if (job.result) parts.push(...renderResult(job.result));
  clear(box).append(...parts);
}

// A value as text: lists joined, objects as `key: value` pairs, booleans as yes/no.
function text(value) {
  if (value === null || value === undefined || value === "") return "–";
  if (typeof value === "boolean") return value ? "yes" : "no";
  if (Array.isArray(value)) return value.length ? value.map(text).join(", ") : "–";
  if (typeof value === "object") return Object.entries(value).map(([k, v]) => `${k}: ${text(v)}`).join("; ") || "–";
  return String(value);
}

const BYTE_FIELDS = new Set(["max_shard_size", "memory_limit", "total_bytes", "compared_bytes"]);
const RESULT_SKIP = new Set(["checkpoint_id", "outputs", "summary", "verify_summary", "bytes_per_file", "file_bytes",
  "tensor_table"]);

function field(key, value) {
  return [key.replace(/_/g, " "), BYTE_FIELDS.has(key) && typeof value === "number" ? bytes(value) : text(value)];
}

function renderResult(result) {
  const output = [el("h2", {}, "Output")];
  if (result.checkpoint_id) {
    output.push(el("p", {}, "Registered as checkpoint ",
      el("a", { href: `#/checkpoints/${encodeURIComponent(result.checkpoint_id)}`, id: "job-output" },
        result.checkpoint_id), result.target ? [" at ", el("span", { class: "path" }, result.target)] : ""));
  }
  const summary = result.verify_summary || (typeof result.summary === "string" ? result.summary : "");
  if (summary) output.push(el("p", { class: "result-summary" }, summary));
  const pairs = Object.entries(result).filter(([k, v]) => !RESULT_SKIP.has(k) && !(Array.isArray(v) && !v.length)
    && v !== null).map(([k, v]) => field(k, v));
  output.push(el("div", { id: "job-result" }, facts(pairs)));
  if (Array.isArray(result.outputs) && result.outputs.length) {
    const files = [...result.outputs].sort((a, b) => a.name.localeCompare(b.name));
    output.push(el("h2", {}, "Files"), table(["File", "Size"], files.map((f) => ({
      attrs: { "data-file": f.name }, cells: [el("span", { class: "path" }, f.name), bytes(f.bytes)] })),
    { id: "job-files" }));
  }
  return output;
}

// The spec as fields: source, target and the options that apply to the job's kind (unset ones left out).
function renderSpec(job) {
  const applies = appliesTo(job.kind);
  const pairs = [["source", el("span", { class: "path" }, job.spec.source)]];
  if (job.spec.target) pairs.push(["target", el("span", { class: "path" }, job.spec.target)]);
  for (const [k, v] of Object.entries(job.spec.options || {})) {
    if (applies.has(k) && v !== null && !(Array.isArray(v) && !v.length)) pairs.push(field(k, v));
  }
  if (job.spec.callback_url) pairs.push(["callback url", job.spec.callback_url]);
  return [el("h2", {}, "Spec"), el("div", { id: "job-spec" }, facts(pairs))];
}

function renderLogs(logs) {
  const body = logs.text ? el("pre", { id: "job-log" }, logs.text)
    : el("p", { id: "job-log-empty" }, "Nothing yet: the job's process has not printed anything.");
  return [el("h2", {}, "Log"), logs.truncated ? el("p", { class: "help" }, "Older lines were left out.") : "", body];
}

function retrySpec(job) {
  const applies = appliesTo(job.kind);
  const options = {};
  for (const [k, v] of Object.entries(job.spec.options || {})) {
    if (applies.has(k) && v !== null) options[k] = v;
  }
  const spec = { kind: job.kind, source: job.spec.source, options };
  if (job.spec.target) spec.target = job.spec.target;
  if (job.spec.callback_url) spec.callback_url = job.spec.callback_url;
  return spec;
}

export async function showJob(id, signal, notify) {
  const box = document.getElementById("job-body");
  const title = document.getElementById("job-title");
  const cancel = document.getElementById("job-cancel");
  const retry = document.getElementById("job-retry");
  let job = await api(`/v1/jobs/${encodeURIComponent(id)}`, { signal });
  title.textContent = `${job.kind} job ${job.id}`;
  const timeline = el("ol", { class: "timeline", id: "job-timeline" });
  timeline.append(timelineItem("queued", job.created_at));
  if (job.started_at) timeline.append(timelineItem(`started (attempt ${job.attempt})`, job.started_at));
  const progressItem = el("li", { hidden: true });
  timeline.append(progressItem);
  const buttons = () => {
    cancel.hidden = !(canCancel(job) && !TERMINAL.has(job.state));
    cancel.disabled = job.cancel_requested;
    retry.hidden = !(canWrite() && TERMINAL.has(job.state) && job.state !== "succeeded");
  };
  let logs = { text: "", truncated: false };
  const show = () => {
    renderJob(job, box);
    box.append(el("h2", {}, "Timeline"), timeline, ...renderSpec(job), ...renderLogs(logs));
    buttons();
  };
  const readLogs = async () => {
    try {
      logs = await api(`/v1/jobs/${encodeURIComponent(job.id)}/logs`, { signal });
    } catch (error) {
      if (error.name === "AbortError") return;
      logs = { text: `(the log could not be read: ${error.message})`, truncated: false };
    }
    show();
  };
  cancel.onclick = async () => {
    try {
      job = await api(`/v1/jobs/${encodeURIComponent(job.id)}/cancel`, { method: "POST" });
      show();
    } catch (error) { notify(error.message); }
  };
  retry.onclick = async () => {
    try {
      const again = await api("/v1/jobs", { method: "POST", body: retrySpec(job) });
      location.hash = `#/jobs/${encodeURIComponent(again.id)}`;
    } catch (error) { notify(error.message); }
  };
  show();
  if (TERMINAL.has(job.state)) {
    if (job.finished_at) timeline.append(timelineItem(`finished: ${job.state}`, job.finished_at));
    await readLogs();
    return;
  }
  readLogs(); // what it printed so far; read again when it ends
  let last = job.state;
  await follow(job.id, (name, data) => {
    job = apply(job, name, data);
    if (name === "progress") {
      const p = data.progress || {};
      progressItem.hidden = false;
      progressItem.replaceChildren(el("time", {}, new Date().toLocaleString()),
        ` progress ${Math.round((p.fraction || 0) * 100)}% · ${bytes(p.done_bytes)} of ${bytes(p.total_bytes)}`);
    } else if (name === "state" && data.state !== last && !TERMINAL.has(data.state)) {
      const label = data.state === "running" ? `started (attempt ${data.attempt})` : data.state;
      timeline.append(timelineItem(label, data.state === "running" ? data.started_at : data.updated_at));
      last = data.state;
    } else if (name === "end") {
      timeline.append(timelineItem(`finished: ${data.state}`, data.finished_at));
    }
    show();
  }, signal);
  await readLogs();
}
