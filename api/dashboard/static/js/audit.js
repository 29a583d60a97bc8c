// The audit log (GET /v1/audit, admins): who changed what and when, each refusal with the line the caller got.
// Filters and the page's cursor live in the address (#/audit?principal=…&action=…&object=…&outcome=…).

import { api, query } from "./api.js";
import { clear, el, table } from "./dom.js";

const FILTERS = ["principal", "action", "object", "outcome"];

// The object before and after, as JSON text in a <details> (put in the page as text, never as HTML).
function change(entry) {
  if (entry.before === null && entry.after === null) return "–";
  const text = (value) => (value === null ? "(none)" : JSON.stringify(value, null, 2));
  return el("details", {}, el("summary", {}, "before / after"),
    el("pre", { class: "audit-json", "data-side": "before" }, text(entry.before)),
    el("pre", { class: "audit-json", "data-side": "after" }, text(entry.after)));
}

export async function showAudit(params, signal) {
  const form = document.getElementById("audit-filters");
  for (const name of FILTERS) form.elements[name].value = params.get(name) || "";
  const page = await api(`/v1/audit${query({ ...Object.fromEntries(FILTERS.map((n) => [n, params.get(n)])),
    cursor: params.get("cursor"), limit: 100 })}`, { signal });
  clear(document.getElementById("audit-body")).append(page.items.length ? table(
    ["When", "Who", "Action", "Object", "Outcome", "Detail", "Change"], page.items.map((e) => ({
      attrs: { "data-audit": String(e.seq), "data-outcome": e.outcome },
      cells: [new Date(e.at * 1000).toLocaleString(), e.principal, e.action, el("span", { class: "path" }, e.object),
        el("span", { class: `state state-${e.outcome === "done" ? "succeeded" : "failed"}` }, e.outcome),
        e.detail || "–", change(e)],
    })), { id: "audit" }) : el("p", { class: "empty-note" }, "Nothing recorded matches."));
  const older = document.getElementById("audit-older");
  older.hidden = !page.next_cursor;
  older.dataset.cursor = page.next_cursor || "";
}
