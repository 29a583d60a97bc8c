// The job form: the server rendered its fields; this shows those that apply to the chosen kind, sends the
// spec to POST /v1/jobs, and puts the API's field errors next to their fields.

import { api } from "./api.js";

const form = () => document.getElementById("job-form");

export function showKindFields() {
  const kind = document.getElementById("f-kind").value;
  for (const field of form().querySelectorAll("[data-kinds]")) {
    const applies = field.dataset.kinds.split(" ").includes(kind);
    field.hidden = !applies;
    for (const input of field.querySelectorAll("input, select, textarea")) input.disabled = !applies;
  }
}

function value(input) {
  const widget = input.dataset.widget;
  if (widget === "check") return input.checked ? true : undefined;
  const text = input.value.trim();
  if (text === "") return undefined;
  if (widget === "bool") return text === "true";
  if (widget === "lines") return text.split("\n").map((l) => l.trim()).filter(Boolean);
  if (widget === "number" && /^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$/.test(text)) return Number(text);
  return text; // the server validates and names the field when it is wrong
}

export function formSpec() {
  const spec = { options: {} };
  for (const input of form().querySelectorAll("input, select, textarea")) {
    if (input.disabled || !input.name) continue;
    const v = value(input);
    if (v === undefined) continue;
    if (input.name.startsWith("options.")) spec.options[input.name.slice(8)] = v;
    else spec[input.name] = v;
  }
  return spec;
}

function clearErrors() {
  for (const node of form().querySelectorAll(".field-error")) node.textContent = "";
  for (const node of form().querySelectorAll("[aria-invalid]")) node.removeAttribute("aria-invalid");
}

// The error element for an API field name such as `options.max_shard_size.int`: the longest known prefix.
function errorSlot(field) {
  const parts = String(field).split(".");
  for (let n = parts.length; n > 0; n -= 1) {
    const slot = document.getElementById(`error-${parts.slice(0, n).join(".")}`);
    if (slot) return slot;
  }
  return document.getElementById("error-form");
}

// Without a `fields` list, a message that starts with a field path (`target: …`, `options.overwrite: …`) still
// goes next to that field; anything else goes at the top of the form.
function fieldsOf(error) {
  if (error.fields.length) return error.fields;
  const named = /^([a-z_]+(?:\.[a-z_]+)*): /.exec(error.message);
  return [{ field: named ? named[1] : "form", message: error.message }];
}

function showErrors(error) {
  const fields = fieldsOf(error);
  for (const { field, message } of fields) {
    const slot = errorSlot(field);
    slot.textContent = slot.textContent ? `${slot.textContent}; ${message}` : message;
    const input = slot.closest(".field")?.querySelector("input, select, textarea");
    if (input) input.setAttribute("aria-invalid", "true");
  }
  const first = form().querySelector("[aria-invalid]");
  if (first) first.focus();
}

export function setupForm() {
  document.getElementById("f-kind").addEventListener("change", showKindFields);
  form().addEventListener("submit", async (event) => {
    event.preventDefault();
    clearErrors();
    const button = document.getElementById("job-submit");
    button.disabled = true;
    try {
      const job = await api("/v1/jobs", { method: "POST", body: formSpec() });
      location.hash = `#/jobs/${encodeURIComponent(job.id)}`;
    } catch (error) {
      showErrors(error);
    } finally {
      button.disabled = false;
    }
  });
  showKindFields();
}
