// The checkpoint registry, one checkpoint's page, its tensor table and its lineage graph.

import { api, query } from "./api.js";
import { bytes, clear, el, facts, when } from "./dom.js";
import { drawGraph, lineageGraph } from "./lineage.js";
import { pageSize } from "./session.js";

const MAX_LINEAGE_JOBS = 40;

function ckptRow(c) {
  return el("tr", { "data-checkpoint": c.id },
    el("td", {}, el("a", { href: `#/checkpoints/${encodeURIComponent(c.id)}`, title: c.id }, c.name)),
    el("td", {}, c.format || "–"),
    el("td", {}, c.tensors ?? "–"),
    el("td", {}, bytes(c.total_bytes)),
    el("td", {}, c.world_size ?? "–"),
    el("td", {}, c.tags.map((t) => el("span", { class: "tag" }, t))),
    el("td", {}, c.made_by_job ? el("a", { href: `#/jobs/${encodeURIComponent(c.made_by_job)}` }, c.made_by_job)
      : "registered"),
    el("td", { class: "path" }, c.uri));
}

export async function showCheckpoints(params, signal) {
  const body = document.getElementById("ckpts-body");
  const filters = { name: params.get("name") || "", format: params.get("format") || "", tag: params.get("tag") || "" };
  for (const [k, v] of Object.entries(filters)) document.getElementById(`filter-${k}`).value = v;
  const cursor = params.get("cursor") || "";
  const page = await api(`/v1/checkpoints${query({ ...filters, cursor, limit: pageSize(params) })}`, { signal });
  clear(body);
  if (!page.items.length) body.append(el("tr", {}, el("td", { colspan: "8", class: "empty" }, "No checkpoints.")));
  for (const c of page.items) body.append(ckptRow(c));
  const next = document.getElementById("ckpts-next");
  next.disabled = !page.next_cursor;
  next.dataset.cursor = page.next_cursor || "";
  document.getElementById("ckpts-first").disabled = !cursor;
}

function table(headers, rows, attrs = {}) {
  return el("div", { class: "table-wrap" }, el("table", attrs,
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows.map((r) => el("tr", {}, r.map((v) => el("td", {}, v)))))));
}

function renderCheckpoint(c, box) {
  const s = c.summary || {};
  const parts = [facts([
    ["Id", c.id], ["Name", c.name], ["URI", el("span", { class: "path" }, c.uri)], ["Format", c.format || "–"],
    ["Producer", s.producer || "–"], ["World size", c.world_size ?? "–"], ["Tensors", c.tensors ?? "–"],
    ["Size", bytes(c.total_bytes)], ["Files", s.files ?? "–"],
    ["Dtypes", Object.entries(c.dtypes).map(([k, v]) => `${k}: ${v}`).join(", ") || "–"],
    ["Optimizer state", c.has_optimizer === null ? "–" : c.has_optimizer ? "yes" : "no"],
    ["Shard balance", s.balance ?? "–"],
    ["Tags", c.tags.join(", ") || "–"],
    ["Made by", c.made_by_job ? el("a", { href: `#/jobs/${encodeURIComponent(c.made_by_job)}` }, c.made_by_job)
      : "registered by hand"],
    ["Registered", when(c.created_at)],
  ])];
  if (s.bytes_per_file) {
    parts.push(el("h2", {}, "Files"), table(["File", "Bytes"],
      Object.entries(s.bytes_per_file).map(([f, b]) => [el("span", { class: "path" }, f), bytes(b)])));
  }
  if (Object.keys(c.metadata).length) {
    parts.push(el("h2", {}, "Metadata"), facts(Object.entries(c.metadata).map(([k, v]) => [k, String(v)])));
  }
  parts.push(el("details", {}, el("summary", {}, "inspect summary"),
    el("pre", { id: "ckpt-summary" }, JSON.stringify(s, null, 2))));
  clear(box).append(...parts);
}

async function drawLineage(id, signal) {
  const box = clear(document.getElementById("lineage"));
  const lineage = await api(`/v1/checkpoints/${encodeURIComponent(id)}/lineage`, { signal });
  const ids = [...new Set([...lineage.ancestors, ...lineage.descendants].map((e) => e.job_id).filter(Boolean))];
  const jobs = new Map();
  await Promise.all(ids.slice(0, MAX_LINEAGE_JOBS).map((jobId) =>
    api(`/v1/jobs/${encodeURIComponent(jobId)}`, { signal }).then((j) => jobs.set(jobId, j), () => {})));
  if (!lineage.ancestors.length && !lineage.descendants.length) {
    box.append(el("p", {}, "No lineage: this checkpoint was registered by hand and nothing was made from it yet."));
  }
  box.append(drawGraph(lineageGraph(lineage, jobs)));
}

export async function showCheckpoint(id, signal) {
  const c = await api(`/v1/checkpoints/${encodeURIComponent(id)}`, { signal });
  document.getElementById("ckpt-title").textContent = `Checkpoint ${c.name}`;
  renderCheckpoint(c, document.getElementById("ckpt-body"));
  const tensors = clear(document.getElementById("tensor-table"));
  const button = document.getElementById("ckpt-tensors");
  button.disabled = false;
  button.onclick = async () => {
    button.disabled = true;
    try {
      const full = await api(`/v1/checkpoints/${encodeURIComponent(id)}?tensors=true`, { signal });
      const rows = (full.summary.tensor_table || []).map((t) => [el("code", {}, t.name), t.dtype,
        `[${t.shape.join(", ")}]`, t.chunks]);
      clear(tensors).append(table(["Name", "Dtype", "Shape", "Chunks"], rows, { id: "tensors" }));
    } catch (error) {
      clear(tensors).append(el("p", { class: "field-error" }, error.message));
      button.disabled = false;
    }
  };
  await drawLineage(id, signal);
}
