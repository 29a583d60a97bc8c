// The diff view of a run page: pick two steps, submit a `diff` job (A = the older step, B = the newer), and show
// its result: each layer's relative L2 change ‖a−b‖/‖b‖ as a bar chart and a table, the layers that moved most,
// those that did not move at all (frozen, or a resume that loaded nothing) and the tensors on one side only.
// Everything is put in the page as text, the chart built with DOM calls.

import { api } from "./api.js";
import { clear, el, jobLink, svg, table } from "./dom.js";

const FINISHED = new Set(["succeeded", "failed", "cancelled"]);
const MOST = 5; // layers listed as "moved most"
const BAR = { left: 190, width: 330, row: 18, top: 8 };

const enc = encodeURIComponent;

// rel_l2 is a number, or "inf" (a change against all zeros) written as a string: JSON has no infinity
function rel(layer) {
  return typeof layer.rel_l2 === "number" ? layer.rel_l2 : Number.POSITIVE_INFINITY;
}

function short(value) {
  if (!Number.isFinite(value)) return "∞";
  if (value === 0) return "0";
  return Math.abs(value) < 1e-3 || Math.abs(value) >= 1e4 ? value.toExponential(2) : String(Number(value.toPrecision(3)));
}

// Layers with a change, largest first (those with an unmatched NaN/Inf before the others), as the CLI sorts them.
export function movedMost(layers) {
  return layers.filter((l) => l.changed > 0).sort((a, b) => {
    const infA = a.max_abs_diff === "inf" ? 1 : 0;
    const infB = b.max_abs_diff === "inf" ? 1 : 0;
    return infB - infA || rel(b) - rel(a);
  });
}

// Optimizer state (`optim.state.layers.3`): its step counters always move, so it is drawn apart from the model.
function isOptimizer(layer) {
  return layer.name.startsWith("optim.");
}

// One bar per layer (moved ones by size, then the unmoved), the widest bar the largest finite change.
function barChart(id, what, layers) {
  const ordered = [...movedMost(layers), ...layers.filter((l) => l.changed === 0)];
  const finite = ordered.map(rel).filter(Number.isFinite);
  const top = Math.max(...finite, 0);
  const height = BAR.top * 2 + ordered.length * BAR.row;
  const width = BAR.left + BAR.width + 80;
  const root = svg("svg", { id, viewBox: `0 0 ${width} ${height}`, width, height, role: "img",
    class: "diff-chart", "aria-labelledby": `${id}-desc` });
  const moved = ordered.filter((l) => l.changed > 0).length;
  root.append(svg("desc", { id: `${id}-desc` },
    `Relative L2 change ‖a−b‖/‖b‖ of each ${what} layer: ${moved} of ${ordered.length} changed`));
  ordered.forEach((layer, i) => {
    const y = BAR.top + i * BAR.row;
    const value = rel(layer);
    const still = layer.changed === 0;
    const length = still ? 0 : Number.isFinite(value) && top > 0 ? Math.max(1, (value / top) * BAR.width) : BAR.width;
    const group = svg("g", { class: still ? "bar unchanged" : "bar", "data-layer": layer.name });
    group.append(svg("text", { x: BAR.left - 8, y: y + 12, class: "label", "text-anchor": "end" },
      layer.name.length > 28 ? `…${layer.name.slice(-27)}` : layer.name));
    const rect = svg("rect", { x: BAR.left, y: y + 2, width: length.toFixed(1), height: BAR.row - 5 });
    rect.append(svg("title", {}, `${layer.name}: ${still ? "unchanged" : `relative change ${short(value)}`}`));
    group.append(rect);
    group.append(svg("text", { x: BAR.left + length + 6, y: y + 12, class: "value" }, still ? "unchanged" : short(value)));
    root.append(group);
  });
  return root;
}

function nameList(id, title, names, empty) {
  const box = el("div", { class: "diff-list", id });
  box.append(el("h3", {}, title));
  if (!names.length) box.append(el("p", { class: "empty-note" }, empty));
  else box.append(el("ul", {}, names.map((n) => el("li", { "data-name": n }, el("code", {}, n)))));
  return box;
}

// The result of a diff job: `r` is DiffResult.to_dict() plus its one-line summary.
export function renderDiff(r, labels) {
  const layers = r.layers || [];
  const model = layers.filter((l) => !isOptimizer(l));
  const optimizer = layers.filter(isOptimizer);
  const moved = movedMost(layers);
  const parts = [el("p", { id: "diff-summary", class: r.differs ? "diff-differs" : "diff-equal" },
    `${labels.a} → ${labels.b}: ${r.differs ? "the checkpoints differ" : "no difference beyond the tolerances"} `
    + `(rtol ${r.rtol}, atol ${r.atol}); ${moved.length} of ${layers.length} layers changed.`)];
  for (const [id, what, group] of [["diff-chart", "model", model], ["diff-chart-optim", "optimizer state", optimizer]]) {
    if (!group.length) continue;
    const chart = barChart(id, what, group);
    parts.push(el("figure", {}, chart, el("figcaption", {}, chart.querySelector("desc").textContent)));
  }
  const most = movedMost(model.length ? model : layers).slice(0, MOST).map((l) => l.name);
  parts.push(el("div", { class: "diff-lists" },
    nameList("diff-moved", model.length ? "Moved most (model)" : "Moved most", most, "No layer changed."),
    nameList("diff-unchanged", "Did not move (frozen?)", r.unchanged_layers || [], "Every layer changed."),
    nameList("diff-only-a", `Only in ${labels.a}`, r.only_a || [], "None."),
    nameList("diff-only-b", `Only in ${labels.b}`, r.only_b || [], "None.")));
  if ((r.shape_mismatch || []).length) parts.push(nameList("diff-shapes", "Shapes differ (not compared)", r.shape_mismatch, ""));
  parts.push(table(["Layer", "Tensors", "Changed", "Beyond tolerance", "Relative L2 change", "Largest |a−b|"],
    layers.map((l) => ({
      attrs: { "data-layer": l.name, "data-rel": String(l.rel_l2), class: l.changed ? "" : "unchanged" },
      cells: [el("code", {}, l.name), l.tensors, l.changed, l.differs, l.changed ? short(rel(l)) : "unchanged",
        typeof l.max_abs_diff === "number" ? short(l.max_abs_diff) : String(l.max_abs_diff)],
    })), { id: "diff-layers" }));
  return parts;
}

async function finished(jobId, signal) {
  for (;;) {
    const job = await api(`/v1/jobs/${enc(jobId)}`, { signal });
    if (FINISHED.has(job.state)) return job;
    await new Promise((resolve) => { setTimeout(resolve, 1000); });
    if (signal.aborted) throw new DOMException("aborted", "AbortError");
  }
}

// Show diff job `jobId` in `box` (waiting for it to finish); `stepOf` names a URI by its step in this run.
export async function showDiff(box, jobId, stepOf, signal) {
  clear(box).append(el("h2", {}, "Diff"), el("p", { id: "diff-state" }, ["Diff job ", jobLink(jobId), " is running…"]));
  const job = await finished(jobId, signal);
  const label = (uri) => (stepOf(uri) !== undefined ? `step ${stepOf(uri)}` : uri);
  const labels = { a: label(job.spec.source), b: label(job.spec.target) };
  clear(box).append(el("h2", {}, `Diff: ${labels.a} → ${labels.b}`),
    el("p", { id: "diff-state" }, ["Diff job ", jobLink(jobId), `: ${job.state}`]));
  if (job.result && Array.isArray(job.result.layers)) box.append(...renderDiff(job.result, labels));
  else box.append(el("p", { class: "field-error", id: "diff-error" }, job.error ? job.error.message : job.state));
}

// The form: two steps of the run (the older as A, the newer as B) and a button that submits the diff job.
export function compareForm(steps, run, onSubmitted) {
  const options = (selected) => steps.map((m, i) => el("option", { value: m.checkpoint.uri,
    ...(i === selected ? { selected: "" } : {}) }, `step ${m.step ?? "–"} (${m.checkpoint.name})`));
  const a = el("select", { id: "diff-a", name: "a" }, options(Math.max(0, steps.length - 2)));
  const b = el("select", { id: "diff-b", name: "b" }, options(steps.length - 1));
  const error = el("p", { class: "field-error", role: "alert", id: "diff-form-error" });
  const form = el("form", { class: "inline-form", id: "diff-form", "aria-label": "Compare two steps" },
    el("label", { for: "diff-a" }, "Step A"), a, el("label", { for: "diff-b" }, "Step B"), b,
    el("button", { type: "submit" }, "Compare"), error);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    if (a.value === b.value) {
      error.textContent = "Pick two different steps.";
      return;
    }
    try {
      const job = await api("/v1/jobs", { method: "POST", body: { kind: "diff", source: a.value, target: b.value } });
      onSubmitted(job.id);
    } catch (e) {
      error.textContent = e.message;
    }
  });
  return el("section", { id: "run-compare", "aria-label": `Compare two steps of ${run}` },
    el("h2", {}, "Compare two steps"), form);
}
