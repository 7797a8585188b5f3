// miles dashboard page: polls the JSON API of miles_host/dashboard/app.py and draws with uPlot.
// window.milesDashboard holds the page's state (runs, their records, the uPlot charts), so
// that tests can read back what is plotted.
"use strict";

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#a16207", "#db2777"];
const PHASE_COLORS = {generate: "#2563eb", reward: "#16a34a", teacher: "#0891b2", train: "#dc2626",
                      sync: "#9333ea", offload: "#a16207", eval: "#db2777", other: "#9ca3af"};
const params = new URLSearchParams(location.search);
const state = {
  key: params.get("key"),
  pollMs: Number(params.get("poll") || 2000),
  runs: {},          // id -> summary from /api/runs
  records: {},       // id -> metrics records in file order
  offsets: {},       // id -> byte offset of metrics.jsonl read so far
  selected: new Set(),
  charts: {},        // metric -> {plot, runIds}
  samples: [],       // records of the step shown in the rollout browser
  view: "metrics",
};
window.milesDashboard = state;

async function api(path) {
  const headers = state.key ? {Authorization: "Bearer " + state.key} : {};
  const response = await fetch("api/" + path, {headers});
  if (!response.ok) throw new Error(path + ": HTTP " + response.status);
  return response.json();
}

function color(runId) {
  return PALETTE[Object.keys(state.runs).indexOf(runId) % PALETTE.length];
}

// -- runs and metrics -----------------------------------------------------------

async function refreshRuns() {
  const runs = await api("runs");
  let added = false;
  for (const run of runs) {
    if (!(run.id in state.runs)) {
      state.records[run.id] = [];
      state.offsets[run.id] = 0;
      state.selected.add(run.id);
      added = true;
    }
    state.runs[run.id] = run;
  }
  if (added) renderRunList();
}

function renderRunList() {
  const list = document.getElementById("run-list");
  list.innerHTML = "";
  for (const id of Object.keys(state.runs)) {
    const row = document.createElement("label");
    row.className = "run-row";
    row.title = state.runs[id].path;
    const box = document.createElement("input");
    box.type = "checkbox";
    box.checked = state.selected.has(id);
    box.dataset.run = id;
    box.onchange = () => { box.checked ? state.selected.add(id) : state.selected.delete(id); drawCharts(true); };
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = color(id);
    row.append(box, swatch, document.createTextNode(id));
    list.append(row);
  }
  for (const select of ["sample-run", "timeline-run"].map(id => document.getElementById(id))) {
    const current = select.value;
    select.innerHTML = Object.keys(state.runs).map(id => `<option>${escapeHtml(id)}</option>`).join("");
    if (current) select.value = current;
  }
}

async function pollMetrics() {
  let changed = false;
  for (const id of Object.keys(state.runs)) {
    const reply = await api(`runs/${encodeURIComponent(id)}/metrics?offset=${state.offsets[id]}`);
    if (reply.offset < state.offsets[id]) state.records[id] = [];  // the file was replaced
    state.offsets[id] = reply.offset;
    if (reply.records.length) {
      state.records[id].push(...reply.records);
      changed = true;
    }
  }
  return changed;
}

function metricNames() {
  const names = new Set();
  for (const id of state.selected)
    for (const record of state.records[id] || [])
      for (const [key, value] of Object.entries(record))
        if (key !== "rollout_id" && typeof value === "number") names.add(key);
  return [...names].sort();
}

// x: every rollout_id that has the metric in a selected run; one y series per run (null where absent)
function seriesData(metric, runIds) {
  const perRun = runIds.map(id => {
    const points = new Map();
    for (const record of state.records[id]) if (typeof record[metric] === "number") points.set(record.rollout_id, record[metric]);
    return points;
  });
  const xs = [...new Set(perRun.flatMap(points => [...points.keys()]))].sort((a, b) => a - b);
  return [xs, ...perRun.map(points => xs.map(x => (points.has(x) ? points.get(x) : null)))];
}

function drawCharts(rebuild) {
  const runIds = [...state.selected].filter(id => id in state.records);
  const filter = document.getElementById("metric-filter").value.trim().toLowerCase();
  const container = document.getElementById("metric-groups");
  if (rebuild) {
    for (const chart of Object.values(state.charts)) chart.plot.destroy();
    state.charts = {};
    container.innerHTML = "";
  }
  const width = Math.max(260, Math.min(420, (container.clientWidth || 900) / 3 - 14));
  for (const metric of metricNames()) {
    const data = seriesData(metric, runIds);
    const existing = state.charts[metric];
    if (existing && existing.runIds.join("\n") === runIds.join("\n")) {
      existing.plot.setData(data);
    } else {
      if (existing) { existing.plot.destroy(); existing.element.remove(); }
      const element = document.createElement("div");
      element.className = "chart";
      element.dataset.metric = metric;
      groupElement(metric).append(element);
      const plot = new uPlot({
        title: metric, width, height: 180, scales: {x: {time: false}},
        series: [{label: "rollout"}, ...runIds.map(id => ({label: id, stroke: color(id), width: 1.5, spanGaps: true,
                                                            points: {size: 4}}))],
        axes: [{}, {size: 60}],
        legend: {show: runIds.length > 1},
      }, data, element);
      state.charts[metric] = {plot, runIds, element};
    }
    state.charts[metric].element.classList.toggle("hidden", Boolean(filter) && !metric.toLowerCase().includes(filter));
  }
}

function groupElement(metric) {
  const group = metric.includes("/") ? metric.split("/")[0] : "other";
  let element = document.querySelector(`.metric-group[data-group="${CSS.escape(group)}"] .charts`);
  if (!element) {
    const wrapper = document.createElement("div");
    wrapper.className = "metric-group";
    wrapper.dataset.group = group;
    wrapper.innerHTML = `<h3>${escapeHtml(group)}</h3><div class="charts"></div>`;
    const groups = [...document.querySelectorAll(".metric-group")];
    const after = groups.find(g => g.dataset.group > group);
    document.getElementById("metric-groups").insertBefore(wrapper, after || null);
    element = wrapper.querySelector(".charts");
  }
  return element;
}

// -- rollout browser ----------------------------------------------------------------

async function loadSampleSteps() {
  const runId = document.getElementById("sample-run").value;
  if (!runId) return;
  const steps = await api(`runs/${encodeURIComponent(runId)}/samples`);
  const select = document.getElementById("sample-step");
  const current = select.value;
  select.innerHTML = steps.map(step => `<option>${step}</option>`).join("");
  if (steps.includes(Number(current))) select.value = current;
  else if (steps.length) { select.value = String(steps[steps.length - 1]); await loadSamples(); }
}

async function loadSamples() {
  const runId = document.getElementById("sample-run").value;
  const step = document.getElementById("sample-step").value;
  if (!runId || step === "") return;
  state.samples = await api(`runs/${encodeURIComponent(runId)}/samples/${step}`);
  const body = document.querySelector("#sample-table tbody");
  body.innerHTML = "";
  state.samples.forEach((sample, i) => {
    const row = document.createElement("tr");
    row.dataset.position = i;
    const reward = sample.reward === null ? "-" : sample.reward.toFixed(3);
    row.innerHTML = `<td>${sample.index}</td><td>${sample.group_index}</td><td>${reward}</td>` +
                    `<td>${sample.tokens.length}</td><td>${escapeHtml(sample.status)}</td>`;
    row.onclick = () => showSample(i);
    body.append(row);
  });
  if (state.samples.length) showSample(0);
}

function tokenDiffs(sample) {
  if (!sample.train_log_probs || !sample.rollout_log_probs) return null;
  return sample.train_log_probs.map((lp, i) => Math.abs(lp - sample.rollout_log_probs[i]));
}

function showSample(position) {
  const sample = state.samples[position];
  state.shownSample = position;
  document.querySelectorAll("#sample-table tr").forEach(row => row.classList.toggle("selected", row.dataset.position == position));
  const diffs = tokenDiffs(sample);
  const scale = diffs && diffs.length ? Math.max(...diffs, 1e-6) : 0;
  document.getElementById("heat-scale").textContent = diffs ? `white 0 \u2192 red ${scale.toPrecision(3)}` : "no training log-probs recorded";
  const detail = document.getElementById("sample-detail");
  detail.innerHTML = `<div><b>reward</b> ${sample.reward} &nbsp; <b>status</b> ${escapeHtml(sample.status)} &nbsp; ` +
    `<b>prompt tokens</b> ${sample.prompt_length} &nbsp; <b>weight versions</b> ${escapeHtml(sample.weight_versions.join(", "))}</div>` +
    `<h4>prompt</h4><pre class="prompt">${escapeHtml(sample.prompt)}</pre>` +
    `<h4>response</h4><pre class="response">${escapeHtml(sample.response)}</pre><h4>tokens</h4>`;
  const strip = document.createElement("div");
  strip.className = "tokens";
  sample.tokens.forEach((token, i) => {
    const element = document.createElement("span");
    element.className = "tok" + (sample.loss_mask[i] ? "" : " masked");
    element.dataset.diff = diffs ? diffs[i] : "";
    const text = document.createElement("span");
    text.className = "text";
    text.textContent = sample.token_text[i];
    if (diffs) text.style.background = heat(diffs[i] / scale);
    element.append(text);
    const agreement = sample.routed_expert_agreement;
    if (agreement) {
      const bar = document.createElement("span");
      bar.className = "agree";
      bar.style.background = `hsl(${120 * agreement[i]}, 70%, 45%)`;
      element.append(bar);
    }
    const rollout = sample.rollout_log_probs ? sample.rollout_log_probs[i] : null;
    const train = sample.train_log_probs ? sample.train_log_probs[i] : null;
    element.title = `id ${token}\nrollout log-prob ${rollout}\ntrain log-prob ${train}` +
      (diffs ? `\n|diff| ${diffs[i]}` : "") + `\nloss mask ${sample.loss_mask[i]}` +
      (agreement ? `\nexpert agreement ${agreement[i]}` : "");
    strip.append(element);
  });
  detail.append(strip);
}

function heat(fraction) {  // 0: white, 1: red
  const f = Math.max(0, Math.min(1, fraction || 0));
  const other = Math.round(255 * (1 - f));
  return `rgb(255, ${other}, ${other})`;
}

// -- timeline ------------------------------------------------------------------------

async function loadTimeline() {
  const runId = document.getElementById("timeline-run").value;
  if (!runId) return;
  const steps = await api(`runs/${encodeURIComponent(runId)}/timeline`);
  state.timeline = steps;
  const longest = Math.max(...steps.map(step => step.step_time_s), 1e-9);
  const container = document.getElementById("timeline");
  container.innerHTML = "";
  for (const step of steps) {
    const row = document.createElement("div");
    row.className = "timeline-row";
    row.innerHTML = `<span>step ${step.rollout_id} (${step.step_time_s.toFixed(2)} s)</span>`;
    const bar = document.createElement("div");
    bar.className = "timeline-bar";
    for (const [phase, seconds] of Object.entries(step.phases)) {
      const part = document.createElement("div");
      part.dataset.phase = phase;
      part.style.width = (100 * seconds / longest) + "%";
      part.style.background = PHASE_COLORS[phase] || "#6b7280";
      part.title = `${phase}: ${seconds.toFixed(3)} s`;
      bar.append(part);
    }
    row.append(bar);
    container.append(row);
  }
  document.getElementById("timeline-legend").innerHTML = Object.entries(PHASE_COLORS).map(([phase, c]) =>
    `<span class="phase-key"><span class="swatch" style="background:${c}"></span>${phase}</span>`).join("");
}

// -- page -----------------------------------------------------------------------------

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

function showView(view) {
  state.view = view;
  document.querySelectorAll("nav button").forEach(b => b.classList.toggle("active", b.dataset.view === view));
  document.querySelectorAll(".view").forEach(v => v.classList.toggle("hidden", v.id !== "view-" + view));
  if (view === "rollouts") loadSampleSteps();
  if (view === "timeline") loadTimeline();
  if (view === "metrics") drawCharts(false);
}

async function tick() {
  try {
    await refreshRuns();
    const changed = await pollMetrics();
    if (changed && state.view === "metrics") drawCharts(false);
    if (changed && state.view === "timeline") await loadTimeline();
    if (changed && state.view === "rollouts") await loadSampleSteps();
    state.lastPoll = Date.now();
    document.getElementById("status").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (error) {
    document.getElementById("status").textContent = String(error);
  } finally {
    setTimeout(tick, state.pollMs);
  }
}

document.querySelectorAll("nav button").forEach(b => (b.onclick = () => showView(b.dataset.view)));
document.getElementById("metric-filter").oninput = () => drawCharts(false);
document.getElementById("sample-run").onchange = loadSampleSteps;
document.getElementById("sample-step").onchange = loadSamples;
document.getElementById("timeline-run").onchange = loadTimeline;
tick();
