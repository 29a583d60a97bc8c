// Building DOM nodes. Every value goes in as text (textContent / attributes), never as markup.

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = String(v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// An SVG element (charts, the lineage graph), attributes and text set the same way.
export function svg(tag, attrs = {}, text) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

export function clear(node) {
  node.replaceChildren();
  return node;
}

export function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Number(n);
  let i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${i ? v.toFixed(1) : v} ${units[i]}`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

export function age(iso) {
  if (!iso) return "–";
  return `${duration((Date.now() - Date.parse(iso)) / 1000)} ago`;
}

export function when(iso) {
  return iso ? new Date(iso).toLocaleString() : "–";
}

// State as text and colour: a badge whose class picks the colour and whose text names the state.
export function stateBadge(job) {
  const text = job.cancel_requested && job.state === "running" ? "cancelling" : job.state;
  return el("span", { class: `state state-${job.state}`, "data-state": job.state }, text);
}

// A progress bar (<progress>, so assistive technology reads it) with bytes and tensors as text.
export function progressCell(job) {
  const p = job.progress;
  const done = job.state === "succeeded";
  const fraction = p && p.fraction !== null && p.fraction !== undefined ? p.fraction : done ? 1 : 0;
  const percent = Math.round(fraction * 100);
  const bar = el("progress", { max: "100", value: String(percent), "aria-label": `${percent}%` });
  const label = el("span", { class: "percent", "data-percent": String(percent) }, `${percent}%`);
  const detail = p ? `${bytes(p.done_bytes)} / ${bytes(p.total_bytes)} · ${p.done_tensors}/${p.total_tensors} tensors`
    : "";
  return el("div", { class: "progress" }, bar, label, el("span", { class: "detail" }, detail));
}

export function facts(pairs) {
  const dl = el("dl", { class: "facts" });
  for (const [k, v] of pairs) dl.append(el("dt", {}, k), el("dd", {}, v));
  return dl;
}

// A table; `rows` are arrays of cell values (text or nodes), or {attrs, cells} for a row with attributes.
export function table(headers, rows, attrs = {}) {
  return el("div", { class: "table-wrap" }, el("table", attrs,
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", { scope: "col" }, h)))),
    el("tbody", {}, rows.map((r) => Array.isArray(r) ? el("tr", {}, r.map((v) => el("td", {}, v)))
      : el("tr", r.attrs, r.cells.map((v) => el("td", {}, v)))))));
}

export function jobLink(id) {
  return el("a", { href: `#/jobs/${encodeURIComponent(id)}` }, id);
}

export function checkpointLink(id, label) {
  return el("a", { href: `#/checkpoints/${encodeURIComponent(id)}` }, label || id);
}

// A button that calls `action` and shows its error beside it (an <output> after the button).
export function actionButton(label, action, attrs = {}) {
  const message = el("span", { class: "field-error", role: "alert" });
  const button = el("button", { type: "button", ...attrs }, label);
  button.addEventListener("click", async () => {
    button.disabled = true;
    message.textContent = "";
    try {
      await action();
    } catch (error) {
      message.textContent = error.message;
    } finally {
      button.disabled = false;
    }
  });
  return el("span", { class: "action" }, button, message);
}
