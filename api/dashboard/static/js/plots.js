// Line charts of a run across its steps, as SVG pictures built with DOM calls (every label is text): one line
// per series, one circle per point (data-step on each), the axes' extremes written at their ends.

import { svg } from "./dom.js";

const W = 560;
const H = 220;
const PAD = { left: 64, right: 150, top: 14, bottom: 30 };
const MAX_SERIES = 8; // the rest are summed up in the legend

function short(value) {
  if (!Number.isFinite(value)) return String(value);
  return Math.abs(value) >= 1e4 || (value !== 0 && Math.abs(value) < 1e-3) ? value.toExponential(2)
    : String(Number(value.toPrecision(4)));
}

// series: [{name, points: [[step, value], ...]}]; the busiest series (largest last value) are drawn first
export function lineChart(id, title, series) {
  const drawn = [...series].filter((s) => s.points.length)
    .sort((a, b) => b.points[b.points.length - 1][1] - a.points[a.points.length - 1][1]).slice(0, MAX_SERIES);
  const xs = drawn.flatMap((s) => s.points.map((p) => p[0]));
  const ys = drawn.flatMap((s) => s.points.map((p) => p[1]));
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  const [y0, y1] = [Math.min(0, ...ys), Math.max(...ys, 0)];
  const sx = (x) => PAD.left + (x1 === x0 ? 0.5 : (x - x0) / (x1 - x0)) * (W - PAD.left - PAD.right);
  const sy = (y) => H - PAD.bottom - (y1 === y0 ? 0.5 : (y - y0) / (y1 - y0)) * (H - PAD.top - PAD.bottom);
  const root = svg("svg", { id, viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img", class: "run-plot",
    "aria-labelledby": `${id}-desc` });
  root.append(svg("desc", { id: `${id}-desc` }, `${title}: ${drawn.length} series over ${new Set(xs).size} steps`));
  root.append(svg("line", { x1: PAD.left, y1: H - PAD.bottom, x2: W - PAD.right, y2: H - PAD.bottom, class: "axis" }));
  root.append(svg("line", { x1: PAD.left, y1: PAD.top, x2: PAD.left, y2: H - PAD.bottom, class: "axis" }));
  root.append(svg("text", { x: PAD.left - 6, y: sy(y1) + 4, class: "tick", "text-anchor": "end" }, short(y1)));
  root.append(svg("text", { x: PAD.left - 6, y: sy(y0) + 4, class: "tick", "text-anchor": "end" }, short(y0)));
  root.append(svg("text", { x: sx(x0), y: H - 10, class: "tick", "text-anchor": "middle" }, `step ${x0}`));
  if (x1 !== x0) root.append(svg("text", { x: sx(x1), y: H - 10, class: "tick", "text-anchor": "middle" }, `step ${x1}`));
  drawn.forEach((s, i) => {
    const group = svg("g", { class: `series series-${i}`, "data-series": s.name });
    const path = s.points.map(([x, y], j) => `${j ? "L" : "M"} ${sx(x).toFixed(1)} ${sy(y).toFixed(1)}`).join(" ");
    group.append(svg("path", { d: path, class: "line" }));
    for (const [x, y] of s.points) {
      const dot = svg("circle", { cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: 3, "data-step": x });
      dot.append(svg("title", {}, `${s.name} at step ${x}: ${short(y)}`));
      group.append(dot);
    }
    group.append(svg("text", { x: W - PAD.right + 8, y: PAD.top + 12 + i * 16, class: "legend" },
      s.name.length > 22 ? `${s.name.slice(0, 21)}…` : s.name));
    root.append(group);
  });
  const left = series.filter((s) => s.points.length).length - drawn.length;
  if (left > 0) {
    root.append(svg("text", { x: W - PAD.right + 8, y: PAD.top + 12 + drawn.length * 16, class: "legend more" },
      `+${left} more`));
  }
  return root;
}

// points: GET /v1/runs/{run}/stats
export function runPlots(points) {
  const layers = [...new Set(points.flatMap((p) => Object.keys(p.norms)))];
  const per = (field) => layers.map((name) => ({
    name, points: points.filter((p) => p[field][name] !== undefined).map((p) => [p.step, p[field][name]]),
  }));
  return [
    lineChart("plot-norms", "Weight norm by layer", per("norms")),
    lineChart("plot-change", "Relative change of each layer's norm from the step before", per("norm_change")),
    lineChart("plot-nonfinite", "NaN and Inf values", [{ name: "NaN/Inf", points: points.map((p) => [p.step, p.nonfinite]) }]),
  ];
}
