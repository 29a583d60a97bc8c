// A checkpoint's archives on its page: "archived in STORE, stored X of Y bytes" for each archive store that holds it
// (GET /v1/checkpoints/{id} `archives`), and for a token that may write, a Restore button that submits a restore job
// (the archive id in that store -> a new target) and opens the job.

import { api } from "./api.js";
import { actionButton, bytes, el } from "./dom.js";
import { canWrite } from "./session.js";

function restoreForm(c, a, n) {
  const id = `restore-target-${n}`;
  const input = el("input", { id, type: "text", spellcheck: "false", value: `${c.uri.replace(/\/+$/, "")}-restored`,
    "aria-label": "Restore to" });
  const button = actionButton("Restore", async () => {
    const job = await api("/v1/jobs", { method: "POST", body: {
      kind: "restore", source: a.store, target: input.value.trim(), options: { archive_id: a.archive_id } } });
    location.hash = `#/jobs/${encodeURIComponent(job.id)}`;
  }, { "data-restore": a.archive_id });
  return [el("label", { for: id }, " to "), input, " ", button];
}

export function archivedSection(c) {
  const archives = c.archives || [];
  if (!archives.length) return [];
  const gone = c.deleted_at ? " Its files were deleted; restore it from an archive." : "";
  const items = archives.map((a, n) => el("li", { "data-archive": a.archive_id },
    "archived in ", el("span", { class: "path" }, a.store), `, stored ${bytes(a.stored_bytes)} of `,
    `${bytes(a.logical_bytes)} (archive ${a.archive_id}, ${a.origin})`,
    ...(canWrite() ? restoreForm(c, a, n) : [])));
  return [el("h2", {}, "Archived"), el("p", { class: "empty-note" }, `Restorable byte for byte.${gone}`),
    el("ul", { id: "ckpt-archives" }, items)];
}
