// The REST API and its event streams, with the signed-in token.
//
// Why there is no CSRF token: the API authenticates only with an `Authorization: Bearer` header, which this
// script adds from sessionStorage. A browser never attaches that header on its own (unlike a cookie), and
// another origin can neither read this origin's sessionStorage nor send a custom header here without a CORS
// preflight, which the API does not grant. So a forged cross-site request arrives without credentials and
// is refused with 401. The token lives only as long as the tab (sessionStorage, never localStorage or a cookie).

const KEY = "ckpt-token";

export function token() {
  return sessionStorage.getItem(KEY) || "";
}

export function setToken(value) {
  if (value) sessionStorage.setItem(KEY, value);
  else sessionStorage.removeItem(KEY);
}

export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `HTTP ${status}`);
    this.status = status;
    this.type = error.type || "http_error";
    this.fields = Array.isArray(error.fields) ? error.fields : [];
  }
}

function headers(extra) {
  const out = { Accept: "application/json", ...extra };
  const t = token();
  if (t) out.Authorization = `Bearer ${t}`;
  return out;
}

export async function api(path, { method = "GET", body, signal } = {}) {
  const init = { method, headers: headers(body === undefined ? {} : { "Content-Type": "application/json" }), signal };
  if (body !== undefined) init.body = JSON.stringify(body);
  const response = await fetch(path, init);
  let data = null;
  try {
    data = await response.json();
  } catch {
    data = null;
  }
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
  const s = q.toString();
  return s ? `?${s}` : "";
}

// Follow /v1/jobs/{id}/events. EventSource cannot send an Authorization header, so the stream is read with
// fetch and parsed here (the SSE wire format: `event:`/`data:` lines, a blank line ends an event).
// Calls onEvent(name, data) per event; resolves when the stream ends or `signal` aborts it.
export async function follow(jobId, onEvent, signal) {
  const response = await fetch(`/v1/jobs/${encodeURIComponent(jobId)}/events`,
    { headers: headers({ Accept: "text/event-stream" }), signal });
  if (!response.ok) {
    let data = null;
    try { data = await response.json(); } catch { data = null; }
    throw new ApiError(response.status, data);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let name = "message";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let newline;
    while ((newline = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, newline).replace(/\r$/, "");
      buffer = buffer.slice(newline + 1);
      if (line === "") {
        if (data.length) {
          let parsed = null;
          try { parsed = JSON.parse(data.join("\n")); } catch { parsed = null; }
          if (parsed) onEvent(name, parsed);
        }
        name = "message";
        data = [];
      } else if (line.startsWith("event:")) {
        name = line.slice(6).trim();
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).replace(/^ /, ""));
      }
    }
  }
}
