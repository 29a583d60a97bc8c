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

export async function showRuns(signal) {
  const box = document.getElementById("runs-body");
  const runs = await api("/v1/runs", { signal });
  clear(box);
  if (!runs.length) {
    box.append(empty("No runs yet: checkpoints under a folder named by a rule's {run}, or registered with "
      + "metadata run=…, are grouped here."));
    return;
  }
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
  const box = document.getElementById("rules-body");
  const rules = await api("/v1/rules", { signal });
  clear(box);
  if (!rules.length) {
    box.append(empty("No rules. Add one with ckptctl rules add NAME PATTERN --kind export --target "
      + "'…/{run}/{step}' (or POST /v1/rules)."));
    return;
  }
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

export async function showRetention(signal) {
  const [policies, plan, deletions] = await Promise.all([api("/v1/policies", { signal }),
    api("/v1/gc", { method: "POST", body: { dry_run: true }, signal }), api("/v1/deletions", { signal })]);
  clear(document.getElementById("policies-body")).append(policies.length ? table(
    ["Policy", "Covers", "Applies to", "Rule", "Added by"], policies.map((p) => ({
      attrs: { "data-policy": p.id },
      cells: [p.spec.name, p.spec.run ? `run ${p.spec.run}` : el("span", { class: "path" }, p.spec.prefix || "–"),
        p.spec.applies_to, policyRule(p.spec), p.created_by],
    })), { id: "policies" }) : empty("No retention policies: nothing is deleted. Add one with "
      + "ckptctl policies add (admin)."));
  const planBox = clear(document.getElementById("gc-plan"));
  planBox.append(el("p", { id: "gc-total" }, plan.plan.length
    ? `${plan.plan.length} checkpoint(s), ${bytes(plan.bytes)} would be deleted now.` : "Nothing would be deleted now."));
  if (plan.plan.length) {
    planBox.append(table(["Checkpoint", "Run", "Step", "Size", "Policy", "Why"], plan.plan.map((i) => ({
      attrs: { "data-plan": i.checkpoint_id },
      cells: [checkpointLink(i.checkpoint_id, i.uri), i.run ?? "–", i.step ?? "–", bytes(i.bytes), i.policy, i.reason],
    })), { id: "gc" }));
  }
  clear(document.getElementById("deletions-body")).append(deletions.length ? table(
    ["Checkpoint", "Size", "Policy", "Why", "State", "By", "Planned", "Done"], deletions.map((d) => ({
      attrs: { "data-deletion": d.id },
      cells: [el("span", { class: "path", title: d.checkpoint_id }, d.uri), bytes(d.bytes), d.policy, d.reason,
        d.error ? `${d.state}: ${d.error}` : d.state, d.requested_by, when(d.planned_at), when(d.done_at)],
    })), { id: "deletions" }) : empty("No deletions yet."));
}
