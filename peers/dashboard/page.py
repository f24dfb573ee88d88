"""The dashboard's one HTML page: swarm map, charts, peer table and event log.

Rendered in the browser from `/api/swarm` (first paint) and `/api/events` (server-sent
snapshots, one a second); plotly.js comes from `/static/plotly.min.js`, never from a CDN.
Kept as a string so it installs with the package without package-data settings.
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
          --serving: #1f9d55; --joining: #d69e2e; --draining: #c53030; }
  * { box-sizing: border-box; }
  body { margin: 0; font: 14px/1.4 system-ui, sans-serif; background: var(--bg); color: var(--ink); }
  header { display: flex; flex-wrap: wrap; gap: 4px 16px; align-items: baseline; padding: 10px 16px;
           background: var(--card); border-bottom: 1px solid var(--line); }
  header h1 { font-size: 18px; margin: 0; }
  header .meta { color: var(--muted); }
  main { padding: 12px 16px; display: grid; gap: 12px; }
  section { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px;
            min-width: 0; }
  section h2 { font-size: 13px; text-transform: uppercase; letter-spacing: .04em; color: var(--muted);
               margin: 0 0 8px; }
  #map { display: flex; flex-wrap: wrap; gap: 8px; }
  .stage { flex: 1 1 160px; border: 1px solid var(--line); border-radius: 6px; padding: 6px; min-width: 150px; }
  .stage.empty { border-color: var(--draining); }
  .stage h3 { margin: 0 0 6px; font-size: 14px; }
  .stage h3 small { color: var(--muted); font-weight: normal; }
  .replica { border-left: 4px solid var(--muted); background: var(--bg); padding: 4px 6px; margin: 4px 0;
             border-radius: 3px; font-size: 12px; overflow-wrap: anywhere; }
  .replica.serving { border-color: var(--serving); } .replica.joining { border-color: var(--joining); }
  .replica.draining { border-color: var(--draining); }
  .replica.stale { opacity: .5; }
  #charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(320px, 100%), 1fr)); gap: 8px; }
  .chart { height: 220px; min-width: 0; }
  .columns { display: grid; grid-template-columns: repeat(auto-fit, minmax(min(420px, 100%), 1fr)); gap: 12px; }
  .scroll { overflow: auto; max-height: 360px; }
  table { border-collapse: collapse; width: 100%; font-size: 12px; }
  th, td { text-align: left; padding: 3px 6px; border-bottom: 1px solid var(--line); white-space: nowrap; }
  th { position: sticky; top: 0; background: var(--card); }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .state { font-weight: 600; } .state.serving { color: var(--serving); }
  .state.joining { color: var(--joining); } .state.draining { color: var(--draining); }
  #events div { font-size: 12px; padding: 2px 0; border-bottom: 1px solid var(--line); }
  #events .kind { display: inline-block; width: 44px; color: var(--muted); }
  #events .leave .kind { color: var(--draining); } #events .join .kind { color: var(--serving); }
  #status.down { color: var(--draining); }
</style>
</head>
<body>
<header>
  <h1>swarmtrain</h1>
  <span class="meta" id="run">waiting for the run manifest&hellip;</span>
  <span class="meta" id="status">connecting&hellip;</span>
</header>
<main>
  <section><h2>Swarm map</h2><div id="map"></div></section>
  <section><h2>Live</h2>
    <div id="charts">
      <div class="chart" id="chart-peers"></div>
      <div class="chart" id="chart-served"></div>
      <div class="chart" id="chart-step"></div>
      <div class="chart" id="chart-loss"></div>
    </div>
  </section>
  <div class="columns">
    <section><h2>Peers</h2><div class="scroll"><table>
      <thead><tr><th>peer</th><th>role</th><th>stage</th><th>state</th><th>device</th>
        <th>served</th><th>mb/s</th><th>step</th><th>TFLOP/s</th><th>up</th></tr></thead>
      <tbody id="peers"></tbody></table></div></section>
    <section><h2>Events</h2><div class="scroll" id="events"></div></section>
  </div>
</main>
<script>
"use strict";
const esc = s => String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;",
  '"': "&quot;", "'": "&#39;"})[c]);
const short = id => id.slice(-8);
const when = t => new Date(t * 1000);
const clock = t => when(t).toLocaleTimeString();
const ago = s => s < 90 ? `${Math.round(s)} s` : s < 5400 ? `${Math.round(s / 60)} min` : `${(s / 3600).toFixed(1)} h`;
const layout = title => ({title: {text: title, font: {size: 13}}, margin: {l: 44, r: 8, t: 28, b: 28},
  showlegend: true, legend: {orientation: "h", y: -0.25, font: {size: 10}}, xaxis: {type: "date"}});
const opts = {displayModeBar: false, responsive: true};

function renderMap(view) {
  const map = document.getElementById("map");
  if (!view.stages.length) { map.textContent = "no manifest yet"; return; }
  map.innerHTML = view.stages.map(s => `
    <div class="stage ${s.num_serving ? "" : "empty"}">
      <h3>stage ${s.stage} <small>blocks ${s.blocks[0]}&ndash;${s.blocks[1] - 1} &middot;
        ${s.num_serving} serving</small></h3>
      ${s.replicas.map(r => `<div class="replica ${esc(r.state)} ${r.missing_polls ? "stale" : ""}"
          title="${esc(r.peer_id)}">${esc(short(r.peer_id))} &middot; ${esc(r.state)}<br>${esc(r.device)}
          ${r.capacity.flops_per_s ? "&middot; " + (r.capacity.flops_per_s / 1e12).toFixed(2) + " TFLOP/s" : ""}
          ${r.capacity.is_spot ? "&middot; spot" : ""}</div>`).join("") || "<em>no replica</em>"}
    </div>`).join("");
}

function renderPeers(view) {
  const now = view.updated_at || Date.now() / 1000;
  document.getElementById("peers").innerHTML = view.peers.map(r => `<tr title="${esc(r.peer_id)}">
    <td>${esc(short(r.peer_id))}</td><td>${esc(r.role)}</td><td class="num">${r.stage >= 0 ? r.stage : ""}</td>
    <td class="state ${esc(r.state)}">${esc(r.state)}</td><td>${esc(r.device)}</td>
    <td class="num">${r.served}</td><td class="num">${r.served_per_s.toFixed(1)}</td>
    <td class="num">${r.step}</td>
    <td class="num">${r.capacity.flops_per_s ? (r.capacity.flops_per_s / 1e12).toFixed(2) : ""}</td>
    <td class="num">${r.since ? ago(now - r.since) : ""}</td></tr>`).join("");
}

function renderEvents(view) {
  const box = document.getElementById("events");
  box.innerHTML = view.events.slice().reverse().map(e => `<div class="${esc(e.kind)}">
    <span class="kind">${esc(e.kind)}</span> ${esc(clock(e.t))} ${esc(e.text)}</div>`).join("")
    || "<em>nothing yet</em>";
}

function renderCharts(view) {
  const s = view.series, x = s.t.map(when);
  const nStages = view.manifest ? view.manifest.num_stages : 0;
  const perStage = [...Array(nStages).keys()].map(k => ({x, y: s.peers_per_stage.map(c => c[k] ?? 0),
    name: `stage ${k}`, mode: "lines", line: {shape: "hv"}}));
  Plotly.react("chart-peers", perStage, layout("serving peers per stage"), opts);
  const peers = Object.entries(s.peers).filter(([, p]) => p.t.length);
  Plotly.react("chart-served", peers.map(([id, p]) => ({x: p.t.map(when), y: p.served_per_s,
    name: short(id), mode: "lines"})), layout("microbatches / s per peer"), opts);
  Plotly.react("chart-step", [{x, y: s.step, name: "step", mode: "lines", line: {shape: "hv"}}],
    layout("optimizer step"), opts);
  const trainers = Object.entries(s.trainers);
  const loss = trainers.map(([n, p]) => ({x: p.t.map(when), y: p.loss, name: `${n} loss`, mode: "lines"}));
  const tps = trainers.map(([n, p]) => ({x: p.t.map(when), y: p.tokens_per_s, name: `${n} tokens/s`,
    mode: "lines", yaxis: "y2"}));
  const l = layout(trainers.length ? "trainer loss and tokens/s" : "trainer loss (no trainer reports yet)");
  l.yaxis2 = {overlaying: "y", side: "right"};
  Plotly.react("chart-loss", loss.concat(tps), l, opts);
}

function render(view) {
  const m = view.manifest;
  document.getElementById("run").textContent = m ? `run ${m.run_id} \u00b7 ${m.model} \u00b7 ` +
    `${m.num_blocks} blocks in ${m.num_stages} stages \u00b7 ${view.peers.length} peers` +
    (m.max_steps ? ` \u00b7 ${m.max_steps} steps planned` : "") : "waiting for the run manifest\u2026";
  renderMap(view); renderPeers(view); renderEvents(view); renderCharts(view);
}

function setStatus(text, down) {
  const el = document.getElementById("status");
  el.textContent = text; el.className = "meta" + (down ? " down" : "");
}

fetch("/api/swarm").then(r => r.json()).then(render).catch(() => {});
const source = new EventSource("/api/events");
source.onmessage = e => { const view = JSON.parse(e.data); render(view);
  setStatus(`live \u00b7 updated ${view.updated_at ? clock(view.updated_at) : "never"}`, false); };
source.onerror = () => setStatus("disconnected, retrying\u2026", true);
</script>
</body>
</html>
"""
