// Checkpoint management: runs and their steps, rules (pause/resume, what each fired for), retention
// (policies, the GC plan as a dry run, the deletion log). All from the public REST API.

import { api } from "./api.js";
import { compareForm, showDiff } from "./diff.js";
import { actionButton, bytes, checkpointLink, clear, el, facts, jobLink, table, when } from "./dom.js";
import { runPlots } from "./plots.js";
import { canWrite, session } from "./session.js";

// Pausing a rule is for the token that added it and for admins (the API enforces the same).
function canChange(rule) {
  const who = session.who;
  return Boolean(who) && (who.scope === "admin" || (who.scope === "write" && rule.created_by === who.name));
}

const enc = encodeURIComponent;

function empty(text) {
  return el("p", { class: "empty-note" }, text);
}

// A list view: its rows fetched, then its box emptied; with no rows, the box says `none` instead.
async function listing(boxId, path, signal, none) {
  const box = document.getElementById(boxId);
  const rows = await api(path, { signal });
  clear(box);
  if (!rows.length) box.append(empty(none));
  return { box, rows };
}

export async function showRuns(signal) {
  const { box, rows: runs } = await listing("runs-body", "/v1/runs", signal, "No runs yet: checkpoints under a "
    + "folder named by a rule's {run}, or registered with metadata run=…, are grouped here.");
  if (!runs.length) return;
  box.append(table(["Run", "Checkpoints", "Latest step", "Latest"], runs.map((r) => ({
    attrs: { "data-run": r.run },
    cells: [el("a", { href: `#/runs/${enc(r.run)}` }, r.run), r.checkpoints, r.latest_step ?? "–",
      r.latest_id ? checkpointLink(r.latest_id) : "–"],
  })), { id: "runs" }));
}

// The diff view under the step table: a form to compare two steps (tokens that may write), and the result of
// the diff job named by `?diff=JOB` in the address.
async function runDiff(run, steps, params, signal) {
  const body = document.getElementById("run-body");
  if (canWrite() && steps.length > 1) {
    body.append(compareForm(steps, run, (jobId) => { location.hash = `#/runs/${enc(run)}?diff=${enc(jobId)}`; }));
  }
  const jobId = params ? params.get("diff") : null;
  if (!jobId) return;
  const box = el("section", { id: "run-diff", "aria-label": "Diff between two steps" });
  body.append(box);
  const stepOf = (uri) => steps.find((m) => m.checkpoint.uri === uri)?.step ?? undefined;
  await showDiff(box, jobId, stepOf, signal);
}

export async function showRun(run, signal, params) {
  document.getElementById("run-title").textContent = `Run ${run}`;
  const steps = await api(`/v1/runs/${enc(run)}`, { signal });
  clear(document.getElementById("run-body")).append(table(["Step", "Checkpoint", "Format", "Size", "Aliases",
    "Tags", "Made by"], steps.map((m) => ({
    attrs: { "data-step": m.step ?? "" },
    cells: [m.step ?? "–", checkpointLink(m.checkpoint.id, m.checkpoint.name), m.checkpoint.format || "–",
      bytes(m.checkpoint.total_bytes), m.aliases.join(", ") || "–", m.checkpoint.tags.join(", ") || "–",
      m.checkpoint.made_by_job ? jobLink(m.checkpoint.made_by_job) : m.rule_id ? `rule ${m.rule_id}` : "training"],
  })), { id: "steps" }));
  const points = await api(`/v1/runs/${enc(run)}/stats`, { signal });
  const box = el("section", { id: "run-plots", "aria-label": "Statistics across steps" });
  document.getElementById("run-body").append(box);
  if (!points.length) {
    box.append(empty("No statistics yet: scan the steps (ckptctl submit scan URI, or a scan job from the form) "
      + "to plot each layer's weight norm, its change from step to step, and NaN/Inf counts."));
  } else {
    box.append(el("h2", {}, "Across steps"), ...runPlots(points).map((plot) => el("figure", {}, plot,
      el("figcaption", {}, plot.querySelector("desc").textContent))));
  }
  await runDiff(run, steps, params, signal);
}

// A rule's period (seconds) in the largest unit that divides it: 86400 -> 1d, 5400 -> 90m.
function every(seconds) {
  for (const [unit, size] of [["w", 604800], ["d", 86400], ["h", 3600], ["m", 60]]) {
    if (seconds % size === 0) return `${seconds / size}${unit}`;
  }
  return `${seconds}s`;
}

function triggerCounts(rule) {
  const parts = Object.entries(rule.triggers).map(([state, n]) => `${state} ${n}`);
  return parts.join(", ") || "none yet";
}

export async function showRules(signal, reload) {
  const { box, rows: rules } = await listing("rules-body", "/v1/rules", signal, "No rules. Add one with ckptctl "
    + "rules add NAME PATTERN --kind export --target '…/{run}/{step}' (or POST /v1/rules).");
  if (!rules.length) return;
  const toggle = (rule) => actionButton(rule.paused ? "Resume" : "Pause", async () => {
    await api(`/v1/rules/${enc(rule.id)}/${rule.paused ? "resume" : "pause"}`, { method: "POST" });
    await reload();
  }, { "data-toggle": rule.id });
  box.append(table(["Rule", "Pattern", "Job", "Target", "State", "Fired", ""], rules.map((r) => ({
    attrs: { "data-rule": r.id },
    cells: [el("a", { href: `#/rules/${enc(r.id)}` }, r.spec.name), el("span", { class: "path" }, r.spec.pattern),
      r.spec.job.kind + (r.spec.every ? ` every ${every(r.spec.every)}` : ""),
      el("span", { class: "path" }, r.spec.job.target ?? "–"), r.paused ? "paused" : "active",
      triggerCounts(r), canChange(r) ? toggle(r) : ""],
  })), { id: "rules" }));
}

export async function showRule(id, signal) {
  const [rule, triggers] = await Promise.all([api(`/v1/rules/${enc(id)}`, { signal }),
    api(`/v1/rules/${enc(id)}/triggers`, { signal })]);
  document.getElementById("rule-title").textContent = `Rule ${rule.spec.name}`;
  const box = clear(document.getElementById("rule-body"));
  box.append(facts([["Id", rule.id], ["Pattern", rule.spec.pattern], ["Job", rule.spec.job.kind],
    ["Target", rule.spec.job.target ?? "–"], ["Every", rule.spec.every ? every(rule.spec.every) : "once per checkpoint"],
    ["State", rule.paused ? "paused" : "active"],
    ["Latest only", rule.spec.latest_only ? "yes" : "no"], ["Skip existing", rule.spec.skip_existing ? "yes" : "no"],
    ["At most at once", rule.spec.max_concurrent], ["Added by", rule.created_by], ["Added", when(rule.created_at)]]));
  box.append(el("h2", {}, "Fired for"));
  box.append(triggers.length ? table(["Checkpoint", "State", "Job", "Detail", "When"], triggers.map((t) => ({
    attrs: { "data-trigger": t.checkpoint_id || t.uri },
    cells: [t.checkpoint_id ? checkpointLink(t.checkpoint_id, t.uri) : el("span", { class: "path" }, t.uri), t.state,
      t.job_id ? jobLink(t.job_id) : "–", t.detail || "–", when(t.claimed_at)],
  })), { id: "triggers" }) : empty("Nothing yet: no checkpoint matched the pattern."));
}

function policyRule(spec) {
  const keep = [];
  if (spec.keep_last !== null) keep.push(`the last ${spec.keep_last} steps`);
  if (spec.keep_every !== null) keep.push(`every step divisible by ${spec.keep_every}`);
  if (spec.keep_younger_than !== null) keep.push(`what is younger than ${spec.keep_younger_than} s`);
  return keep.length ? `keep ${keep.join(", ")}` : "keep nothing";
}

// What a policy (or a GC plan's item) does with a checkpoint it does not keep.
function policyAction(spec) {
  if (spec.action !== "archive") return "delete";
  return el("span", {}, "archive to ", el("span", { class: "path" }, spec.store), ", then delete");
}

function field(id, label, input) {
  return [el("label", { for: id }, label), input];
}

// The form that adds a policy (admins: the API enforces the same): what it covers, what it keeps, and what it
// does with the rest: delete it, or archive it to a store first (restorable byte for byte).
function policyForm(reload) {
  const input = (id, attrs = {}) => el("input", { id, type: "text", spellcheck: "false", ...attrs });
  const name = input("policy-name", { required: "" });
  const scope = el("select", { id: "policy-scope" }, el("option", { value: "run" }, "run"),
    el("option", { value: "prefix" }, "prefix"));
  const covers = input("policy-covers", { required: "", placeholder: "run name, or a folder or URI" });
  const appliesTo = el("select", { id: "policy-applies" },
    ["all", "sources", "exports"].map((v) => el("option", { value: v }, v)));
  const keepLast = input("policy-keep-last", { type: "number", min: "0" });
  const keepEvery = input("policy-keep-every", { type: "number", min: "1" });
  const younger = input("policy-keep-younger", { placeholder: "e.g. 7d" });
  const action = el("select", { id: "policy-action" }, el("option", { value: "delete" }, "delete"),
    el("option", { value: "archive" }, "archive, then delete"));
  const store = input("policy-store", { placeholder: "archive store (folder or URI)", disabled: "" });
  action.addEventListener("change", () => { store.disabled = action.value !== "archive"; });
  const error = el("p", { class: "field-error", role: "alert", id: "policy-form-error" });
  const form = el("form", { class: "inline-form", id: "policy-form", "aria-label": "Add a retention policy" },
    ...field("policy-name", "Name", name), ...field("policy-scope", "Covers", scope), covers,
    ...field("policy-applies", "Applies to", appliesTo), ...field("policy-keep-last", "Keep last", keepLast),
    ...field("policy-keep-every", "Keep every", keepEvery), ...field("policy-keep-younger", "Keep younger than", younger),
    ...field("policy-action", "Then", action), ...field("policy-store", "Store", store),
    el("button", { type: "submit" }, "Add policy"), error);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    error.textContent = "";
    const spec = { name: name.value.trim(), [scope.value]: covers.value.trim(), applies_to: appliesTo.value,
      action: action.value };
    if (keepLast.value !== "") spec.keep_last = Number(keepLast.value);
    if (keepEvery.value !== "") spec.keep_every = Number(keepEvery.value);
    if (younger.value.trim()) spec.keep_younger_than = younger.value.trim();
    if (action.value === "archive") spec.store = store.value.trim();
    try {
      await api("/v1/policies", { method: "POST", body: spec });
      await reload();
    } catch (e) {
      error.textContent = e.message;
    }
  });
  return el("section", { id: "policy-add", "aria-label": "Add a retention policy" }, el("h3", {}, "Add a policy"),
    form);
}

function planTotal(plan) {
  if (!plan.plan.length) return "Nothing would be deleted now.";
  const archived = plan.archived_bytes ? ` (${bytes(plan.archived_bytes)} of it archived first, restorable)` : "";
  return `${plan.plan.length} checkpoint(s), ${bytes(plan.bytes)} would be deleted now${archived}.`;
}

export async function showRetention(signal, reload) {
  const [policies, plan, deletions] = await Promise.all([api("/v1/policies", { signal }),
    api("/v1/gc", { method: "POST", body: { dry_run: true }, signal }), api("/v1/deletions", { signal })]);
  const policiesBox = clear(document.getElementById("policies-body"));
  policiesBox.append(policies.length ? table(
    ["Policy", "Covers", "Applies to", "Rule", "Then", "Added by"], policies.map((p) => ({
      attrs: { "data-policy": p.id },
      cells: [p.spec.name, p.spec.run ? `run ${p.spec.run}` : el("span", { class: "path" }, p.spec.prefix || "–"),
        p.spec.applies_to, policyRule(p.spec), policyAction(p.spec), p.created_by],
    })), { id: "policies" }) : empty("No retention policies: nothing is deleted. Add one with "
      + "ckptctl policies add (admin)."));
  if (session.who && session.who.scope === "admin") policiesBox.append(policyForm(reload));
  const planBox = clear(document.getElementById("gc-plan"));
  planBox.append(el("p", { id: "gc-total" }, planTotal(plan)));
  if (plan.plan.length) {
    planBox.append(table(["Checkpoint", "Run", "Step", "Size", "Policy", "Then", "Why"], plan.plan.map((i) => ({
      attrs: { "data-plan": i.checkpoint_id },
      cells: [checkpointLink(i.checkpoint_id, i.uri), i.run ?? "–", i.step ?? "–", bytes(i.bytes), i.policy,
        policyAction(i), i.reason],
    })), { id: "gc" }));
  }
  clear(document.getElementById("deletions-body")).append(deletions.length ? table(
    ["Checkpoint", "Size", "Policy", "Why", "State", "By", "Planned", "Done"], deletions.map((d) => ({
      attrs: { "data-deletion": d.id },
      cells: [el("span", { class: "path", title: d.checkpoint_id }, d.uri), bytes(d.bytes), d.policy, d.reason,
        d.error ? `${d.state}: ${d.error}` : d.state, d.requested_by, when(d.planned_at), when(d.done_at)],
    })), { id: "deletions" }) : empty("No deletions yet."));
}
