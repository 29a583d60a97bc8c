// The checkpoint registry, one checkpoint's page, its tensor table and its lineage graph.

import { api, query } from "./api.js";
import { archivedSection } from "./archived.js";
import { actionButton, bytes, clear, el, facts, jobLink, table, when } from "./dom.js";
import { showIntegrity } from "./integrity.js";
import { drawGraph, hiddenNote, lineageGraph } from "./lineage.js";
import { canWrite, pageSize } from "./session.js";

const MAX_LINEAGE_JOBS = 40;

// A badge for a checkpoint an archive store holds (restorable byte for byte), naming the stores.
function archivedBadge(c) {
  const archives = c.archives || [];
  if (!archives.length) return "";
  return el("span", { class: "tag archived", "data-archived": archives.length,
    title: `restorable from ${archives.map((a) => a.store).join(", ")}` },
  c.deleted_at ? "archived, files deleted" : "archived");
}

function ckptRow(c) {
  return el("tr", { "data-checkpoint": c.id },
    el("td", {}, el("a", { href: `#/checkpoints/${encodeURIComponent(c.id)}`, title: c.id }, c.name), " ",
      archivedBadge(c)),
    el("td", {}, c.format || "–"),
    el("td", {}, c.tensors ?? "–"),
    el("td", {}, bytes(c.total_bytes)),
    el("td", {}, c.world_size ?? "–"),
    el("td", {}, c.tags.map((t) => el("span", { class: "tag" }, t))),
    el("td", {}, c.made_by_job ? jobLink(c.made_by_job) : "registered"),
    el("td", { class: "path" }, c.uri));
}

export async function showCheckpoints(params, signal) {
  const body = document.getElementById("ckpts-body");
  const filters = { name: params.get("name") || "", format: params.get("format") || "", tag: params.get("tag") || "",
    archived: params.get("archived") || "" };
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

// Who made it: a job (and the rule that submitted it), or how the service came to register it (recorded in
// `registered_via`: as a job's source, found by a rule's scan, pushed by a token, or registered by a token).
function madeBy(c, managed) {
  if (c.made_by_job) {
    return [jobLink(c.made_by_job), managed && managed.rule_id ? ` (submitted by rule ${managed.rule_id})` : ""];
  }
  const via = c.registered_via || {};
  const where = managed && managed.run ? ` in run ${managed.run}${managed.step !== null ? `, step ${managed.step}` : ""}`
    : "";
  if (via.how === "source" && via.job) return ["registered as the source of job ", jobLink(via.job)];
  if (via.how === "discovered") return `discovered by a rule's scan${where}`;
  if (via.how === "notified") return `registered on a notify from ${via.by}${where}`;
  if (via.how === "registered" && via.by) return `registered by ${via.by}${where}`;
  return `registered${where}`;
}

// Every file with its size on disk (`file_bytes`); older summaries have only the tensor bytes of data files.
function filesTable(s) {
  const sizes = s.file_bytes || s.bytes_per_file;
  if (!sizes || !Object.keys(sizes).length) return [];
  const head = s.file_bytes ? "Size" : "Tensor bytes";
  return [el("h2", {}, "Files"), table(["File", head], Object.entries(sizes).map(([f, b]) => ({
    attrs: { "data-file": f }, cells: [el("span", { class: "path" }, f), bytes(b)] })), { id: "ckpt-files" })];
}

function renderCheckpoint(c, box) {
  const s = c.summary || {};
  const onDisk = s.file_bytes ? Object.values(s.file_bytes).reduce((a, b) => a + (b || 0), 0) : null;
  const parts = [facts([
    ["Id", c.id], ["Name", c.name], ["URI", el("span", { class: "path" }, c.uri)], ["Format", c.format || "–"],
    ["Producer", s.producer || "–"], ["World size", c.world_size ?? "–"], ["Tensors", c.tensors ?? "–"],
    ["Tensor bytes", bytes(c.total_bytes)], ["Size on disk", onDisk === null ? "–" : bytes(onDisk)],
    ["Files", s.files ?? "–"],
    ["Dtypes", Object.entries(c.dtypes).map(([k, v]) => `${k}: ${v}`).join(", ") || "–"],
    ["Optimizer state", c.has_optimizer === null ? "–" : c.has_optimizer ? "yes" : "no"],
    ["Shard balance", s.balance ?? "–"],
    ["Tags", c.tags.join(", ") || "–"],
    ["Made by", el("span", { id: "ckpt-made-by" }, c.made_by_job ? jobLink(c.made_by_job) : "registered")],
    ["Registered", when(c.created_at)],
  ])];
  parts.push(...filesTable(s));
  parts.push(...archivedSection(c));
  if (Object.keys(c.metadata).length) {
    parts.push(el("h2", {}, "Metadata"), facts(Object.entries(c.metadata).map(([k, v]) => [k, String(v)])));
  }
  parts.push(el("details", {}, el("summary", {}, "inspect summary"),
    el("pre", { id: "ckpt-summary" }, JSON.stringify(s, null, 2))));
  clear(box).append(...parts);
}

// Aliases and tags, with actions to set, move and remove them for a token that may write.
function renderManage(c, managed, reload) {
  const box = clear(document.getElementById("ckpt-manage"));
  const write = canWrite();
  const enc = encodeURIComponent;
  const aliasRows = managed.aliases.map((a) => {
    const [name, namespace] = a.split("@");
    return { attrs: { "data-alias": a }, cells: [name, namespace, write ? actionButton("Remove", async () => {
      await api(`/v1/aliases/${enc(namespace)}/${enc(name)}`, { method: "DELETE" });
      await reload();
    }, { "data-remove-alias": a }) : ""] };
  });
  const tagRows = c.tags.map((t) => ({ attrs: { "data-tag": t }, cells: [t, write ? actionButton("Remove", async () => {
    await api(`/v1/checkpoints/${enc(c.id)}/tags`, { method: "POST", body: { remove: [t.split("=")[0]] } });
    await reload();
  }, { "data-remove-tag": t }) : ""] }));
  box.append(facts([["Run", managed.run || "–"], ["Step", managed.step ?? "–"]]));
  box.append(aliasRows.length ? table(["Alias", "Namespace", ""], aliasRows, { id: "ckpt-aliases" })
    : el("p", { class: "empty-note" }, "No aliases."));
  box.append(tagRows.length ? table(["Tag", ""], tagRows, { id: "ckpt-tags" }) : el("p", { class: "empty-note" },
    "No tags."));
  if (!write) return;
  const namespace = managed.run || "default";
  box.append(inlineForm("alias", "Set or move an alias here", [["alias-name", "Alias", "e.g. prod"],
    ["alias-namespace", "Namespace", namespace]], async (v) => {
    await api(`/v1/aliases/${enc(v["alias-namespace"] || namespace)}/${enc(v["alias-name"])}`,
      { method: "PUT", body: { checkpoint_id: c.id } });
    await reload();
  }));
  box.append(inlineForm("tag", "Set a tag", [["tag-key", "Key", "e.g. pin or stage"], ["tag-value", "Value",
    "optional"]], async (v) => {
    await api(`/v1/checkpoints/${enc(c.id)}/tags`, { method: "POST", body: { set: { [v["tag-key"]]: v["tag-value"] } } });
    await reload();
  }));
}

// A one-line form (inputs and a submit button) whose error shows in the form itself.
function inlineForm(name, label, inputs, submit) {
  const error = el("p", { class: "field-error", role: "alert", id: `${name}-error` });
  const form = el("form", { class: "inline-form", id: `${name}-form`, "aria-label": label },
    inputs.flatMap(([id, text, placeholder]) => [el("label", { for: id }, text),
      el("input", { id, name: id, type: "text", spellcheck: "false", placeholder })]),
    el("button", { type: "submit" }, label), error);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    const values = Object.fromEntries(inputs.map(([id]) => [id, form.elements[id].value.trim()]));
    try {
      await submit(values);
    } catch (e) {
      error.textContent = e.message;
    }
  });
  return form;
}

async function drawLineage(id, signal) {
  const box = clear(document.getElementById("lineage"));
  const lineage = await api(`/v1/checkpoints/${encodeURIComponent(id)}/lineage`, { signal });
  const ids = [...new Set([...lineage.ancestors, ...lineage.descendants].map((e) => e.job_id).filter(Boolean))];
  const jobs = new Map();
  await Promise.all(ids.slice(0, MAX_LINEAGE_JOBS).map((jobId) =>
    api(`/v1/jobs/${encodeURIComponent(jobId)}`, { signal }).then((j) => jobs.set(jobId, j), () => {})));
  const note = hiddenNote(lineage);
  if (!lineage.ancestors.length && !lineage.descendants.length && !note) {
    box.append(el("p", {}, "No lineage: this checkpoint was registered by hand and nothing was made from it yet."));
  }
  if (note) box.append(el("p", { id: "lineage-hidden", class: "empty-note" }, note));
  box.append(drawGraph(lineageGraph(lineage, jobs)));
}

export async function showCheckpoint(id, signal) {
  const c = await api(`/v1/checkpoints/${encodeURIComponent(id)}`, { signal });
  document.getElementById("ckpt-title").textContent = `Checkpoint ${c.name}`;
  renderCheckpoint(c, document.getElementById("ckpt-body"));
  await showIntegrity(id, document.getElementById("ckpt-body"), signal);
  const managed = await api(`/v1/checkpoints/${encodeURIComponent(id)}/managed`, { signal });
  const reload = () => showCheckpoint(id, signal);
  renderManage(c, managed, reload);
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
  clear(document.getElementById("ckpt-made-by")).append(...[madeBy(c, managed)].flat());
}
