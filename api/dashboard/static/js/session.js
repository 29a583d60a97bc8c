// Who is signed in (GET /v1/whoami), and what that lets them do.

export const session = { who: null };

export function canWrite() {
  return Boolean(session.who) && session.who.scope !== "read";
}

// Cancelling is for the token name that submitted the job and for admins (the API enforces the same).
export function canCancel(job) {
  const who = session.who;
  if (!who || who.scope === "read") return false;
  return who.scope === "admin" || job.submitted_by === who.name;
}

export const TERMINAL = new Set(document.body.dataset.terminal.split(" "));  // the server's jobs.TERMINAL

// The options each kind takes, from the form the server rendered from the API's own table.
export function appliesTo(kind) {
  const names = new Set();
  for (const field of document.querySelectorAll("#job-form [data-kinds] [name^='options.']")) {
    if (field.closest("[data-kinds]").dataset.kinds.split(" ").includes(kind)) names.add(field.name.slice(8));
  }
  return names;
}

// Rows per page: `limit=` in the address (1 to 200, the API's bounds), 50 without it.
export function pageSize(params) {
  const n = Number.parseInt(params.get("limit") || "", 10);
  return n >= 1 && n <= 200 ? n : 50;
}
