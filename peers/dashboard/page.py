"""The dashboard's one HTML page: swarm map, charts, peer table and event log; for an RL run
(the snapshot's `rl`), a panel of its own: figures, reward/accuracy, samples/s, policy lag and
dropped-completion charts, and the rollout peers.

Rendered in the browser from `/api/swarm` (first paint) and `/api/events` (server-sent
snapshots, one a second); plotly.js comes from `/static/plotly.min.js`, never from a CDN.
Kept as a string so it installs with the package without package-data settings. Elements
carry `data-peer`, `data-status`, `data-col` and `data-fig` attributes that the browser tests
read.
"""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>swarmtrain dashboard</title>
<script src="/static/plotly.min.js"></script>
<style>
  :root { --bg: #f6f7f9; --card: #fff; --ink: #1d2330; --muted: #6b7280; --line: #e2e5ea;
          --serving: #1f9d55; --joining: #d69e2e; --draining: #dd6b20; --lost: #6b46c1; --finished: #2b6cb0; --banned: #c53030; --gone: #a0a6b1; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, sans-serif; background: var(--bg); color: var(--ink); }
  header { display: flex; flex-wrap: wrap; gap: 4px 16px; align-items: baseline; padding: 10px 16px;
           background: var(--card); border-bottom: 1px solid var(--line); }
  header h1 { font-size: 18px; margin: 0; }
  .meta { color: var(--muted); overflow-wrap: anywhere; }
  main { padding: 12px 16px; display: grid; gap: 12px; }
  section { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px;
            min-width: 0; }
  section h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted);
               margin: 0 0 8px; display: flex; flex-wrap: wrap; gap: 4px 12px; align-items: baseline; }
  .legend { font-size: 11px; text-transform: none; letter-spacing: 0; font-weight: normal; }
  .legend span { white-space: nowrap; margin-right: 8px; }
  .legend i { display: inline-block; width: 9px; height: 9px; border-radius: 2px; margin-right: 3px; }
  #map { display: flex; flex-wrap: wrap; gap: 8px; }
  .stage { flex: 1 1 220px; border: 1px solid var(--line); border-radius: 6px; padding: 6px; min-width: 0; }
  .stage.empty { border-color: var(--banned); }
  .stage h3 { margin: 0 0 6px; font-size: 14px; }
  .stage h3 small { color: var(--muted); font-weight: normal; }
  .stage .codecs { font-size: 12px; color: var(--muted); margin: -2px 0 6px; }
  .stage .codecs span { margin-right: 8px; white-space: nowrap; }
  .replica { border-left: 5px solid var(--muted); background: var(--bg); padding: 4px 6px; margin: 4px 0;
             border-radius: 3px; font-size: 12px; overflow-wrap: anywhere; }
  .replica b { font-family: ui-monospace, monospace; }
  .replica .st { float: right; font-weight: 600; margin-left: 6px; }
  .replica .sub { color: var(--muted); }
  .replica.stale { opacity: .6; }
  .replica.gone { opacity: .55; background: repeating-linear-gradient(135deg, var(--bg) 0 6px, #eceef1 6px 12px); }
  .serving { --c: var(--serving); } .joining { --c: var(--joining); } .draining { --c: var(--draining); }
  .lost { --c: var(--lost); } .finished { --c: var(--finished); } .banned { --c: var(--banned); } .gone { --c: var(--gone); }
  .replica { border-left-color: var(--c, var(--muted)); } .replica .st, td.state { color: var(--c); }
  .legend i { background: var(--c); }
  .charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(340px, 100%), 1fr)); gap: 8px; }
  .chart { height: 230px; min-width: 0; }
  .scroll { overflow: auto; max-height: 380px; }
  table { border-collapse: collapse; width: 100%; font-size: 12px; }
  th, td { text-align: left; padding: 3px 6px; border-bottom: 1px solid var(--line); white-space: nowrap; }
  th { position: sticky; top: 0; background: var(--card); z-index: 1; }
  td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
  td.id { font-family: ui-monospace, monospace; }
  td.state { font-weight: 600; }
  tr.gone td { color: var(--gone); }
  #events div { font-size: 12px; padding: 2px 0; border-bottom: 1px solid var(--line); overflow-wrap: anywhere; }
  #events .kind { display: inline-block; min-width: 52px; font-weight: 600; color: var(--muted); }
  #events .join .kind, #events .step .kind { color: var(--serving); }
  #events .leave .kind, #events .ban .kind, #events .drop .kind { color: var(--banned); }
  #events .replay .kind, #events .move .kind, #events .layout .kind { color: var(--draining); }
  #events .rollback .kind { color: var(--lost); }
  #events .count { color: var(--muted); }
  #event-kinds { font-size: 12px; color: var(--muted); margin-bottom: 4px; }
  #event-kinds label { margin-right: 8px; white-space: nowrap; }
  #status.down { color: var(--banned); }
  #rl-figures { display: grid; grid-template-columns: repeat(auto-fill, minmax(118px, 1fr)); gap: 8px; margin-bottom: 8px; }
  .charts.four { grid-template-columns: repeat(auto-fit, minmax(min(280px, 100%), 1fr)); }
  .fig { border: 1px solid var(--line); border-radius: 6px; padding: 5px 8px; min-width: 0; }
  .fig b { display: block; font-size: 20px; font-weight: 600; font-variant-numeric: tabular-nums; }
  .fig span { color: var(--muted); font-size: 12px; }
  .fig.bad b { color: var(--banned); }
  section h3 { font-size: 12px; color: var(--muted); font-weight: 600; margin: 10px 0 4px; }
  @media (max-width: 600px) {
    main { padding: 8px; gap: 8px; } header { padding: 8px; } section { padding: 8px; }
    .chart { height: 200px; }
  }
</style>
</head>
<body>
<header>
  <h1>swarmtrain</h1>
  <span class="meta" id="run">waiting for the run manifest&hellip;</span>
  <span class="meta" id="progress"></span>
  <span class="meta" id="layout"></span>
  <span class="meta" id="status">connecting&hellip;</span>
</header>
<main>
  <section><h2>Swarm map <span class="legend">
    <span class="serving"><i></i>serving</span><span class="joining"><i></i>joining</span>
    <span class="draining"><i></i>draining</span><span class="lost"><i></i>lost</span><span class="finished"><i></i>finished</span>
    <span class="banned"><i></i>banned</span>
    <span class="gone"><i></i>gone</span></span></h2>
    <div id="map"></div></section>
  <section><h2>Live</h2>
    <div class="charts" id="charts">
      <div class="chart" id="chart-loss"></div>
      <div class="chart" id="chart-tokens"></div>
      <div class="chart" id="chart-bytes"></div>
      <div class="chart" id="chart-served"></div>
      <div class="chart" id="chart-peers"></div>
    </div>
  </section>
  <section id="rl" hidden><h2>Reinforcement learning <span class="legend" id="rl-run"></span></h2>
    <div id="rl-figures"></div>
    <div class="charts four">
      <div class="chart" id="chart-reward"></div>
      <div class="chart" id="chart-samples"></div>
      <div class="chart" id="chart-lag"></div>
      <div class="chart" id="chart-dropped"></div>
    </div>
    <h3>Rollout peers</h3>
    <div class="scroll"><table>
      <thead><tr><th>peer</th><th>state</th><th>device</th><th class="num">version</th><th class="num">lag</th>
        <th class="num">samples</th><th class="num">samples/s</th><th class="num">time/sample</th>
        <th class="num">refused</th><th class="num">updates</th></tr></thead>
      <tbody id="rollouts"></tbody></table></div></section>
  <section><h2>Peers</h2><div class="scroll"><table>
    <thead><tr><th>peer</th><th>role</th><th class="num">stage</th><th>state</th><th>device</th>
      <th class="num">memory</th><th class="num">queue</th><th class="num">service</th>
      <th class="num">served</th><th class="num">replayed</th><th class="num">failed</th>
      <th class="num">sent</th><th class="num">received</th><th class="num">compr.</th>
      <th class="num">step</th><th class="num">up</th></tr></thead>
    <tbody id="peers"></tbody></table></div></section>
  <section><h2>Events</h2><div id="event-kinds"></div><div class="scroll" id="events"></div></section>
</main>
<script>
"use strict";
const esc = s => String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
  '"': "&quot;", "'": "&#39;"})[c]);
const short = id => id.slice(-8);
const when = t => new Date(t * 1000);
const clock = t => when(t).toLocaleTimeString();
const ago = s => s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
const bytes = n => { if (!n) return "0"; const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  const i = Math.min(u.length - 1, Math.floor(Math.log(n) / Math.log(1024)));
  return `${(n / 1024 ** i).toFixed(i ? 1 : 0)} ${u[i]}`; };
const flops = f => f >= 1e12 ? `${(f / 1e12).toFixed(2)} TFLOP/s` : `${(f / 1e9).toFixed(1)} GFLOP/s`;
const ms = s => s ? (s < 1 ? `${(s * 1000).toFixed(1)} ms` : `${s.toFixed(2)} s`) : "";
const memory = r => r.memory_used_bytes || r.memory_total_bytes ?
  `${bytes(r.memory_used_bytes)} / ${r.memory_total_bytes ? bytes(r.memory_total_bytes) : "?"}` : "";
const device = r => (r.capacity.device_name && r.device === "cpu" ? `cpu (${r.capacity.device_name})` : r.device) +
  (r.quantize ? ` (${r.quantize})` : "");
const fixed = (x, digits) => x === null || x === undefined ? "n/a" : x.toFixed(digits);
const MIN_SPAN_S = 60;  // every chart shows the same window, at least this wide, so the times line up
let xrange = null;
const layout = (title, y) => ({title: {text: title, font: {size: 13}}, margin: {l: 52, r: 8, t: 28, b: 28},
  showlegend: true, legend: {orientation: "h", y: -0.18, font: {size: 10}},
  xaxis: {type: "date", range: xrange, tickformat: "%H:%M:%S", tickangle: 0, nticks: 6},
  yaxis: {title: {text: y || "", font: {size: 11}}, rangemode: "tozero"}});
const opts = {displayModeBar: false};
// Charts follow their box, whatever resized it (the window, the grid reflowing, a zoom).
const resized = new ResizeObserver(boxes => boxes.forEach(b => b.target.data && Plotly.Plots.resize(b.target)));
document.querySelectorAll(".chart").forEach(chart => resized.observe(chart));

function renderMap(view) {
  const map = document.getElementById("map");
  if (!view.stages.length) { map.textContent = "no manifest yet"; return; }
  map.innerHTML = view.stages.map(s => `
    <div class="stage ${s.num_serving ? "" : "empty"}" data-stage="${s.stage}">
      <h3>stage ${s.stage} <small>blocks ${s.blocks[0]}&ndash;${s.blocks[1] - 1} &middot;
        ${s.num_serving} serving</small></h3>
      ${view.manifest.compressed ? `<div class="codecs">${[["forward", "&rarr;"], ["backward", "&larr;"],
        ["averaging", "&harr;"]].filter(([d]) => s.codecs[d]).map(([d, arrow]) =>
        `<span title="${d}">${arrow} ${esc(s.codecs[d])}</span>`).join(" ")}</div>` : ""}
      ${s.replicas.map(r => `<div class="replica ${esc(r.status)} ${r.missing_polls ? "stale" : ""}"
          data-peer="${esc(r.peer_id)}" data-status="${esc(r.status)}" title="${esc(r.peer_id)}">
          <span class="st">${esc(r.status)}</span><b>${esc(short(r.peer_id))}</b><br>
          <span class="sub">${esc(device(r))}
          ${r.capacity.flops_per_s ? "&middot; " + flops(r.capacity.flops_per_s) : ""}
          ${r.capacity.memory_bytes ? "&middot; " + bytes(r.capacity.memory_bytes) : ""}
          ${r.capacity.is_spot ? "&middot; spot" : ""}<br>
          ${r.status === "gone" ? `left ${ago(view.updated_at - r.left_at)} ago` :
            `served ${r.served} &middot; queue ${r.queue_depth}` +
            (r.banned_by.length ? ` &middot; banned by ${r.banned_by.map(short).map(esc).join(", ")}` : "")}
          </span></div>`).join("") || "<em>no replica</em>"}
    </div>`).join("");
}

function peerRow(r, now) {
  const stage = r.role === "stage";
  const works = stage || r.role === "rollout";  // a rollout peer: completions sampled, policy version
  return `<tr class="${esc(r.status)}" data-peer="${esc(r.peer_id)}" title="${esc(r.peer_id)}">
    <td class="id">${esc(short(r.peer_id))}</td><td>${esc(r.role)}</td>
    <td class="num">${r.stage >= 0 ? r.stage : ""}</td>
    <td class="state" data-col="status">${esc(r.status)}</td><td>${esc(device(r))}</td>
    <td class="num">${memory(r)}</td><td class="num">${stage ? r.queue_depth : ""}</td>
    <td class="num">${ms(r.service_s)}</td>
    <td class="num" data-col="served">${works ? r.served : ""}</td><td class="num">${stage ? r.replayed : ""}</td>
    <td class="num">${stage ? r.failed : ""}</td><td class="num">${stage ? bytes(r.bytes_sent) : ""}</td>
    <td class="num">${works ? bytes(r.bytes_received) : ""}</td>
    <td class="num">${r.compression ? r.compression.toFixed(2) + "&times;" : ""}</td>
    <td class="num">${works ? r.step : ""}</td>
    <td class="num">${r.status === "gone" ? "gone" : r.since ? ago(now - r.since) : ""}</td></tr>`;
}

function renderPeers(view) {
  const now = view.updated_at || Date.now() / 1000;
  document.getElementById("peers").innerHTML = view.peers.concat(view.gone).map(r => peerRow(r, now)).join("");
}

const hiddenKinds = new Set();  // event kinds the viewer unticked

function toggleKind(kind, shown) {
  if (shown) hiddenKinds.delete(kind); else hiddenKinds.add(kind);
  if (lastView) renderEvents(lastView);
}

function renderEvents(view) {
  const counts = {};
  for (const e of view.events) counts[e.kind] = (counts[e.kind] || 0) + 1;
  document.getElementById("event-kinds").innerHTML = Object.keys(counts).sort().map(k =>
    `<label class="${esc(k)}"><input type="checkbox" data-kind="${esc(k)}" ${hiddenKinds.has(k) ? "" : "checked"}
      onchange="toggleKind(this.dataset.kind, this.checked)"> ${esc(k)} (${counts[k]})</label>`).join(" ");
  const box = document.getElementById("events");
  box.innerHTML = view.events.filter(e => !hiddenKinds.has(e.kind)).reverse().map(e => `<div class="${esc(e.kind)}">
    <span class="kind">${esc(e.kind)}</span> ${esc(clock(e.t))} ${esc(e.text)}${e.count > 1 ? ` <span class="count">(${e.count} updates)</span>` : ""}</div>`).join("")
    || "<em>nothing yet</em>";
}

function renderCharts(view) {
  const s = view.series, x = s.t.map(when), trainers = Object.entries(s.trainers);
  const times = s.t.concat(...trainers.map(([, p]) => p.t));
  if (times.length) {
    const last = Math.max(...times);
    xrange = [when(Math.min(Math.min(...times), last - MIN_SPAN_S)), when(last)];
  }
  const line = (t, y, name, extra) => Object.assign({x: t.map(when), y, name, mode: "lines+markers",
    marker: {size: 5}}, extra || {});
  Plotly.react("chart-loss", trainers.map(([n, p]) => line(p.t, p.loss, `loss ${short(n)}`)),
    layout(trainers.length ? "training loss" : "training loss (no trainer reports yet)", "loss"), opts);
  const tokens = trainers.map(([n, p]) => line(p.t, p.tokens_per_s, `tokens/s ${short(n)}`));
  const predicted = s.predicted_tokens_per_s || [];
  if (predicted.some(v => v !== null))  // the cost model on the live layout, beside what trainers measure
    tokens.push({x, y: predicted, name: "predicted (cost model)", mode: "lines", connectgaps: false,
      line: {dash: "dash", color: "#7f7f7f"}});
  Plotly.react("chart-tokens", tokens,
    layout(predicted.some(v => v !== null) ? "throughput: measured and predicted" : "throughput", "tokens / s"), opts);
  const anyBytes = s.bytes_sent_per_s.some(v => v > 0);
  const bytesLayout = layout(anyBytes ? "bytes on the wire" : "bytes on the wire (none reported yet)", "bytes / s");
  bytesLayout.yaxis.ticksuffix = "B";
  Plotly.react("chart-bytes", [{x, y: s.bytes_sent_per_s, name: "sent (on the wire)", mode: "lines"},
    {x, y: s.raw_bytes_sent_per_s, name: "before compression", mode: "lines", line: {dash: "dot"}}],
    bytesLayout, opts);
  const peers = Object.entries(s.peers).filter(([, p]) => p.t.length && p.role === "stage");
  Plotly.react("chart-served", peers.map(([id, p]) => ({x: p.t.map(when), y: p.served_per_s,
    name: short(id), mode: "lines"})), layout("microbatches / s per peer", "microbatches / s"), opts);
  const nStages = view.manifest ? view.manifest.num_stages : 0;
  Plotly.react("chart-peers", [...Array(nStages).keys()].map(k => ({x, y: s.peers_per_stage.map(c => c[k] ?? 0),
    name: `stage ${k}`, mode: "lines", line: {shape: "hv"}})), layout("serving peers per stage", "peers"), opts);
}

let lastView = null;  // the latest view, redrawn when a filter changes

function render(view) {
  lastView = view;
  const m = view.manifest;
  document.getElementById("run").textContent = m ? `run ${m.run_id} \\u00b7 ${m.model} \\u00b7 ` +
    `${m.num_blocks} blocks in ${m.num_stages} stages \\u00b7 ${view.peers.length} peers` +
    (m.loss ? ` \\u00b7 loss ${m.loss}` : "") +
    (m.max_steps ? ` \\u00b7 ${m.max_steps} steps planned` : "") : "waiting for the run manifest\\u2026";
  // the layout when it was planned (or is pending), and what a re-plan would predict
  const layout = !m ? [] : m.layout_version === 0 ? [`layout ${m.layout_note}`] :
    m.layout_note ? [`layout ${m.layout_version}: ${m.layout_note}`] : [];
  const r = view.replan;
  if (r && r.gain !== null)
    layout.push(`a re-plan would predict ${Math.round(r.planned_tokens_per_s)} tokens/s ` +
      `(${r.gain >= 0 ? "+" : ""}${Math.round(100 * r.gain)}%, held ${r.streak}/${r.patience} polls)`);
  document.getElementById("layout").textContent = layout.join(" \u00b7 ");
  const t = view.trainers[0], step = view.series.step;
  document.getElementById("progress").textContent = (step.length ? `step ${step[step.length - 1]}` : "") +
    (view.finished ? " \\u00b7 run finished" : "") +
    (t ? ` \\u00b7 loss ${t.loss === null ? "n/a" : t.loss.toFixed(3)} \\u00b7 ` +
      `${Math.round(t.tokens_per_s)} tokens/s` : "");
  if (view.rl && view.rl.reward !== null) {
    document.getElementById("progress").textContent += ` \\u00b7 reward ${view.rl.reward.toFixed(3)}`;
  }
  renderMap(view); renderPeers(view); renderEvents(view); renderCharts(view); renderRL(view);
}

function renderRL(view) {
  const panel = document.getElementById("rl"), rl = view.rl;
  panel.hidden = !rl;
  if (!rl) return;
  const m = view.manifest && view.manifest.rl;
  document.getElementById("rl-run").textContent = (m ? `task ${m.task} \\u00b7 ${m.samples_per_prompt} samples a prompt ` +
    `\\u00b7 max staleness ${m.max_staleness}` : "") + (rl.step !== null ? ` \\u00b7 last RL step ${rl.step}` : "");
  const figures = [
    ["version", "policy version", rl.policy_version ?? "n/a"],
    ["reward", "mean reward", fixed(rl.reward, 3)],
    ["accuracy", "accuracy", rl.accuracy === null ? "n/a" : `${(rl.accuracy * 100).toFixed(1)}%`],
    ["lag", "policy lag (steps)", fixed(rl.policy_lag, 2)],
    ["samples", "samples / s", rl.samples_per_s.toFixed(1)],
    ["rollouts", "rollout peers", rl.rollout_peers],
    ["stale", "stale", rl.stale],  // normal when sampling runs ahead; rejections and bans are not
    ["rejected", "rejected", rl.rejected, rl.rejected > 0],
    ["banned", "banned peers", rl.banned, rl.banned > 0],
  ];
  document.getElementById("rl-figures").innerHTML = figures.map(([key, label, value, bad]) =>
    `<div class="fig ${bad ? "bad" : ""}" data-fig="${key}"><b>${esc(value)}</b><span>${label}</span></div>`).join("");
  const now = view.updated_at || Date.now() / 1000;
  document.getElementById("rollouts").innerHTML = view.peers.concat(view.gone).filter(r => r.role === "rollout")
    .map(r => `<tr class="${esc(r.status)}" data-peer="${esc(r.peer_id)}" title="${esc(r.peer_id)}">
      <td class="id">${esc(short(r.peer_id))}</td><td class="state" data-col="status">${esc(r.status)}</td>
      <td>${esc(device(r))}</td><td class="num" data-col="version">${r.step}</td>
      <td class="num" data-col="lag">${r.policy_lag ?? ""}</td><td class="num">${r.served}</td>
      <td class="num">${r.served_per_s.toFixed(1)}</td><td class="num">${ms(r.service_s)}</td>
      <td class="num">${r.failed}</td><td class="num">${bytes(r.bytes_received)}</td></tr>`).join("")
    || `<tr><td colspan="10"><em>no rollout peer announced</em></td></tr>`;
  renderRLCharts(view);
}

function renderRLCharts(view) {
  const s = view.series, trainers = Object.entries(s.trainers).filter(([, p]) => p.reward.some(v => v !== null));
  const line = (t, y, name, extra) => Object.assign({x: t.map(when), y, name, mode: "lines+markers",
    marker: {size: 5}, connectgaps: false}, extra || {});
  const narrow = (title, y) => { const l = layout(title, y); l.xaxis.nticks = 4; return l; };  // four to a row
  const rewardLayout = narrow("reward and accuracy", "per step");
  rewardLayout.yaxis.range = [0, 1.05];
  Plotly.react("chart-reward", trainers.flatMap(([n, p]) => [line(p.t, p.reward, `reward ${short(n)}`),
    line(p.t, p.accuracy, `accuracy ${short(n)}`, {line: {dash: "dot"}, marker: {size: 5, symbol: "x"}})]),
    rewardLayout, opts);
  const rollouts = Object.entries(s.peers).filter(([, p]) => p.t.length && p.role === "rollout");
  Plotly.react("chart-samples", trainers.map(([n, p]) => line(p.t, p.samples_per_s, `trained ${short(n)}`))
    .concat(rollouts.map(([id, p]) => ({x: p.t.map(when), y: p.served_per_s, name: `sampled ${short(id)}`,
      mode: "lines", line: {dash: "dot"}}))), narrow("samples / s", "samples / s"), opts);
  const stageAt = new Map(s.t.map((t, i) => [t, s.step[i]]));
  Plotly.react("chart-lag", trainers.map(([n, p]) => line(p.t, p.policy_lag, `trained ${short(n)}`))
    .concat(rollouts.map(([id, p]) => ({x: p.t.map(when), y: p.t.map((t, i) => stageAt.has(t) ? stageAt.get(t) - p.step[i] : null),
      name: `rollout ${short(id)}`, mode: "lines", line: {shape: "hv", dash: "dot"}}))),
    narrow("policy lag", "versions behind"), opts);
  Plotly.react("chart-dropped", trainers.flatMap(([n, p]) => [line(p.t, p.stale, `stale ${short(n)}`),
    line(p.t, p.rejected, `rejected ${short(n)}`, {line: {dash: "dash"}})]),
    narrow("stale and rejected completions", "completions (total)"), opts);
}

function setStatus(text, down) {
  const el = document.getElementById("status");
  el.textContent = text; el.className = "meta" + (down ? " down" : "");
}

fetch("/api/swarm").then(r => r.json()).then(render).catch(() => {});
const source = new EventSource("/api/events");
source.onmessage = e => { const view = JSON.parse(e.data); render(view);
  setStatus(`live \\u00b7 updated ${view.updated_at ? clock(view.updated_at) : "never"}`, false); };
source.onerror = () => setStatus("disconnected, retrying\\u2026", true);
</script>
</body>
</html>
"""
