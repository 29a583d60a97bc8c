// A checkpoint's integrity on its page (GET /v1/checkpoints/{id}/integrity, one look-up): the certificate its
// manifest carries and what it covers, the newest scrub and its outcome, and a warning when a scrub found damage.

import { api } from "./api.js";
import { el, facts, jobLink, when } from "./dom.js";

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function certificateText(c, baseline) {
  if (!c && baseline) return `none; ${baseline} by its first scrub, which later scrubs compare with`;
  if (!c) return "none (nothing recorded to check against beyond the format's own checks)";
  return `yes: ${plural(c.tensors, "tensor")}, ${plural(c.files, "output file")} with CRC-32s, `
    + `${plural(c.source_files, "source file")} named${c.stats ? ", statistics side by side" : ""}`;
}

function scrubText(s) {
  if (!s) return ["never scrubbed"];
  const at = s.finished_at ? when(s.finished_at) : "not finished";
  return [jobLink(s.job_id), ` · ${s.state} · ${at}${s.summary ? ` · ${s.summary}` : ""}`];
}

// Appends the integrity facts to `box`; a damaged checkpoint also gets a warning at the top of `box`.
export async function showIntegrity(id, box, signal) {
  const found = await api(`/v1/checkpoints/${encodeURIComponent(id)}/integrity`, { signal });
  const certificate = el("span", { id: "ckpt-certificate" }, certificateText(found.certificate, found.baseline));
  const scrub = el("span", { id: "ckpt-scrub", "data-state": found.last_scrub ? found.last_scrub.state : "" },
    ...scrubText(found.last_scrub));
  box.append(el("h2", {}, "Integrity"), facts([["Certificate", certificate], ["Last scrub", scrub]]));
  if (found.damaged) {
    const where = found.last_scrub && found.last_scrub.damaged.length
      ? `: ${found.last_scrub.damaged.join("; ")}` : "";
    box.prepend(el("p", { class: "warning", id: "ckpt-damaged", role: "alert" },
      `Damaged: a scrub found this checkpoint differs from its recorded checksums${where}. Restore it from a good `
      + "copy or re-convert it, then remove the damaged tag."));
  }
  return found;
}
