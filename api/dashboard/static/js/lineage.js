// The lineage graph as an SVG picture: checkpoints and the jobs between them, in layers from the oldest
// ancestor (left) to the newest descendant (right). Built with DOM calls; every label is text.

import { svg } from "./dom.js";

const BOX_W = 190;
const BOX_H = 44;
const COL_W = 250;
const ROW_H = 64;

function shorten(text, n) {
  return text.length > n ? `${text.slice(0, n - 1)}…` : text;
}

// graph: {nodes: [{id, kind: "checkpoint"|"job", label, sub, href, column, current}], edges: [[fromId, toId]]}
export function drawGraph(graph) {
  const columns = new Map();
  for (const node of graph.nodes) {
    if (!columns.has(node.column)) columns.set(node.column, []);
    columns.get(node.column).push(node);
  }
  const order = [...columns.keys()].sort((a, b) => a - b);
  const height = Math.max(...[...columns.values()].map((c) => c.length), 1) * ROW_H + 16;
  const width = order.length * COL_W;
  const where = new Map();
  order.forEach((column, i) => {
    const nodes = columns.get(column);
    const top = (height - nodes.length * ROW_H) / 2;
    nodes.forEach((node, j) => where.set(node.id, { x: i * COL_W + 10, y: top + j * ROW_H + 10 }));
  });
  const root = svg("svg", { viewBox: `0 0 ${width} ${height}`, width, height, role: "img",
    class: "lineage-graph", "aria-labelledby": "lineage-desc" });
  root.append(svg("desc", { id: "lineage-desc" },
    `Lineage: ${graph.nodes.filter((n) => n.kind === "checkpoint").length} checkpoints, ` +
    `${graph.nodes.filter((n) => n.kind === "job").length} jobs`));
  const defs = svg("defs");
  const marker = svg("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 8,
    markerHeight: 8, orient: "auto-start-reverse" });
  marker.append(svg("path", { d: "M 0 0 L 10 5 L 0 10 z", class: "arrow-head" }));
  defs.append(marker);
  root.append(defs);
  for (const [from, to] of graph.edges) {
    const a = where.get(from);
    const b = where.get(to);
    if (!a || !b) continue;
    const x1 = a.x + BOX_W;
    const y1 = a.y + BOX_H / 2;
    const x2 = b.x;
    const y2 = b.y + BOX_H / 2;
    const mid = (x1 + x2) / 2;
    root.append(svg("path", { d: `M ${x1} ${y1} C ${mid} ${y1}, ${mid} ${y2}, ${x2} ${y2}`, class: "edge",
      "marker-end": "url(#arrow)", "data-from": from, "data-to": to }));
  }
  for (const node of graph.nodes) {
    const { x, y } = where.get(node.id);
    const group = svg("a", { href: node.href, class: `node node-${node.kind}${node.current ? " current" : ""}`,
      "data-node": node.id, "aria-label": `${node.kind} ${node.label}${node.sub ? `, ${node.sub}` : ""}` });
    group.append(svg("title", {}, `${node.label}${node.sub ? `\n${node.sub}` : ""}`));
    group.append(svg("rect", { x, y, width: BOX_W, height: BOX_H, rx: node.kind === "job" ? 22 : 4 }));
    group.append(svg("text", { x: x + 10, y: y + 18, class: "label" }, shorten(node.label, 26)));
    if (node.sub) group.append(svg("text", { x: x + 10, y: y + 35, class: "sub" }, shorten(node.sub, 30)));
    root.append(group);
  }
  return root;
}

// From GET /v1/checkpoints/{id}/lineage and the jobs it names (a map id -> job document, as far as readable),
// the graph: source checkpoint -> job -> output, for every hop.
export function lineageGraph(lineage, jobs) {
  const byId = new Map();
  const byUri = new Map();
  const column = new Map();
  const root = lineage.checkpoint;
  const add = (ckpt, col) => {
    if (byId.has(ckpt.id)) return;
    byId.set(ckpt.id, ckpt);
    byUri.set(ckpt.uri, ckpt);
    column.set(ckpt.id, col);
  };
  add(root, 0);
  for (const e of lineage.ancestors) add(e.checkpoint, -2 * e.depth);
  for (const e of lineage.descendants) add(e.checkpoint, 2 * e.depth);
  const nodes = [...byId.values()].map((c) => ({
    id: c.id, kind: "checkpoint", label: c.name, sub: [c.format, c.tensors !== null ? `${c.tensors} tensors` : ""]
      .filter(Boolean).join(" · "), href: `#/checkpoints/${encodeURIComponent(c.id)}`, column: column.get(c.id),
    current: c.id === root.id,
  }));
  const edges = [];
  const seenJobs = new Set();
  const link = (parent, child, jobId) => {
    if (!parent || !child) return;
    if (!jobId) { edges.push([parent.id, child.id]); return; }
    const nodeId = `job:${jobId}`;
    if (!seenJobs.has(jobId)) {
      seenJobs.add(jobId);
      const job = jobs.get(jobId);
      nodes.push({ id: nodeId, kind: "job", label: job ? `${job.kind} job` : "job", sub: jobId,
        href: `#/jobs/${encodeURIComponent(jobId)}`, column: (column.get(parent.id) + column.get(child.id)) / 2 });
    }
    edges.push([parent.id, nodeId], [nodeId, child.id]);
  };
  const atDepth = (edgesList, depth) => [root, ...edgesList.filter((e) => e.depth === depth).map((e) => e.checkpoint)];
  for (const e of lineage.ancestors) {
    // e.checkpoint is a parent; e.job_id made a checkpoint one hop nearer to the root from it
    const job = jobs.get(e.job_id);
    const nearer = e.depth === 1 ? [root] : atDepth(lineage.ancestors, e.depth - 1);
    const child = (job && job.spec.target && byUri.get(job.spec.target)) ||
      nearer.find((c) => c.made_by_job === e.job_id) || nearer[0];
    link(e.checkpoint, child, e.job_id);
  }
  for (const e of lineage.descendants) {
    const job = jobs.get(e.job_id);
    const nearer = e.depth === 1 ? [root] : atDepth(lineage.descendants, e.depth - 1).slice(1);
    const parent = (job && byUri.get(job.spec.source)) || nearer[0];
    link(parent, e.checkpoint, e.job_id);
  }
  return { nodes, edges };
}

// The line saying how many checkpoints the server left out of the lineage (`hidden`: under storage roots
// the signed-in caller may not read); "" when none were.
export function hiddenNote(lineage) {
  const n = lineage.hidden || 0;
  if (!n) return "";
  return n === 1 ? "1 checkpoint under roots you cannot read is not shown."
    : `${n} checkpoints under roots you cannot read are not shown.`;
}
