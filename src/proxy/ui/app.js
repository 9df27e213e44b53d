// The operator page: polls this replica's admin endpoints once a second
// (/readyz, /metrics, /top) and draws them. Reads are open as the admin API's
// are; a reset is a DELETE /limits with the admin token typed above, kept in
// this page's memory only. Everything is written with textContent.
"use strict";

const $ = (id) => document.getElementById(id);
const EVERY_MS = 1000;
let last = null; // the previous scrape: { at, counters }
let chosen = null; // the client whose buckets are shown: { query, name }

// Prometheus text: [{ name, labels, value }].
function parseMetrics(text) {
  const out = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = line.match(/^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/);
    if (!m) continue;
    const labels = {};
    for (const l of (m[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    out.push({ name: m[1], labels, value: Number(m[3]) });
  }
  return out;
}

function cell(text, numeric) {
  const td = document.createElement("td");
  td.textContent = text;
  if (numeric) td.className = "n";
  return td;
}

function fill(tableId, rows, onClick) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren(...rows.map((r) => {
    const tr = document.createElement("tr");
    for (const [text, numeric] of r.cells) tr.appendChild(cell(text, numeric));
    if (onClick) tr.addEventListener("click", () => onClick(r));
    return tr;
  }));
}

function rate(now, before, secs) {
  return before === undefined || secs <= 0 ? 0 : Math.max(0, (now - before) / secs);
}

function drawDecisions(metrics, at) {
  const counters = new Map();
  for (const m of metrics) {
    if (m.name === "gateway_requests_total" || m.name === "gateway_ratelimit_decisions_total") {
      counters.set(m.name + JSON.stringify(m.labels), m);
    }
  }
  const secs = last ? (at - last.at) / 1000 : 0;
  const routes = new Map();
  const route = (name) => {
    if (!routes.has(name)) routes.set(name, { answered: 0, refused: 0, by: new Map() });
    return routes.get(name);
  };
  for (const [key, m] of counters) {
    const before = last ? last.counters.get(key)?.value : undefined;
    const r = rate(m.value, before, secs);
    if (m.name === "gateway_requests_total") {
      const e = route(m.labels.route || "-");
      if (m.labels.status === "429") e.refused += r; else e.answered += r;
    } else if (m.labels.decision === "rejected" && r > 0) {
      const e = route(m.labels.route || "-");
      e.by.set(m.labels.tier, (e.by.get(m.labels.tier) || 0) + r);
    }
  }
  last = { at, counters };
  const rows = [...routes.entries()].sort().map(([name, e]) => ({
    cells: [
      [name], [e.answered.toFixed(1), true], [e.refused.toFixed(1), true],
      [[...e.by.entries()].map(([t, r]) => `${t} ${r.toFixed(1)}`).join(", ") || "-"],
    ],
  }));
  fill("decisions", rows);
}

// How /limits names a client: an address (the per-IP tier, or a client
// with no key), a JWT's subject, or an API key's id.
function limitsQuery(c) {
  const name = c.client;
  const address = /^[0-9.]+$/.test(name) || (name.includes(":") && !name.startsWith("jwt:"));
  if (c.tier === "ip" || address) return "ip=" + encodeURIComponent(name.replace(/\/\d+$/, ""));
  if (name.startsWith("jwt:")) return "sub=" + encodeURIComponent(name.slice(4));
  return "key=" + encodeURIComponent(name);
}

// `top`: /top's answer; off (`[admin] top = false`) it says so instead.
function drawTop({ status, body: top }) {
  $("top-note").textContent = status === 200 ? "" : top.error || `/top answered ${status}`;
  fill("top", (top.clients || []).map((c) => ({
    client: c,
    cells: [[c.client], [c.route], [c.tier], [String(c.refused), true], [String(c.admitted), true],
      [c.last_seen.slice(11, 19)]],
  })), (r) => choose(r.client));
}

function drawBackend(ready, metrics) {
  const get = (name, labels) => metrics.find((m) => m.name === name &&
    Object.entries(labels || {}).every(([k, v]) => m.labels[k] === v))?.value;
  const state = $("state");
  const onFallback = ready.fallback_secs !== undefined;
  state.textContent = onFallback ? `fallback ${ready.fallback_secs} s` : ready.backend;
  state.className = "pill " + (onFallback ? "fallback" : ready.backend);
  const rows = [
    ["backend", ready.backend],
    ["replicas sharing the limit", String(ready.replicas)],
    ["breaker", onFallback ? `open for ${ready.fallback_secs} s: ${ready.redis_error || ""}` : "closed"],
    ["leased tokens held", String(get("gateway_lease_tokens_held") ?? "-")],
    ["standing shares", get("gateway_shares_usable") ? `on, ${get("gateway_shares_entries")} held` : "off"],
  ];
  $("backend").replaceChildren(...rows.flatMap(([k, v]) => {
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = k;
    dd.textContent = v;
    return [dt, dd];
  }));
  const gates = metrics.filter((m) => m.name === "gateway_in_flight").map((m) => {
    const l = { kind: m.labels.kind, name: m.labels.name };
    return { cells: [[l.kind], [l.name], [String(m.value), true],
      [String(get("gateway_in_flight_limit", l) ?? "-"), true],
      [String(get("gateway_in_flight_queued", l) ?? "-"), true]] };
  });
  fill("gates", gates);
}

async function json(url, init) {
  const r = await fetch(url, init);
  const body = await r.json().catch(() => ({}));
  return { status: r.status, body };
}

async function showClient() {
  if (!chosen) return;
  const { status, body } = await json("/limits?" + chosen.query);
  $("client").hidden = false;
  $("client-name").textContent = chosen.name;
  if (status !== 200) {
    fill("buckets", [{ cells: [[`${status}: ${body.error || ""}`]] }]);
    return;
  }
  fill("buckets", (body.buckets || []).map((b) => ({
    cells: [[b.tier], [b.route || "-"], [String(b.limit), true], [String(b.remaining), true],
      [`${b.reset_ms ?? "-"} ms`, true]],
  })));
}

function choose(c) {
  chosen = { query: limitsQuery(c), name: `${c.client} (${c.tier} on ${c.route})` };
  $("reset-result").textContent = "";
  showClient();
}

async function reset() {
  if (!chosen) return;
  const token = $("token").value;
  const headers = token ? { authorization: "Bearer " + token } : {};
  const { status, body } = await json("/limits?" + chosen.query, { method: "DELETE", headers });
  $("reset-result").textContent = status === 200 ? "reset" : `refused (${status}): ${body.error || ""}`;
  $("reset-result").dataset.status = String(status);
  await showClient();
}

async function tick() {
  try {
    const at = Date.now();
    const [ready, metrics, top] = await Promise.all([
      json("/readyz").then((r) => r.body),
      fetch("/metrics").then((r) => r.text()).then(parseMetrics),
      json("/top?limit=20"),
    ]);
    drawDecisions(metrics, at);
    drawTop(top);
    drawBackend(ready, metrics);
    await showClient();
    $("updated").textContent = "updated " + new Date(at).toLocaleTimeString();
    $("problems").textContent = "";
  } catch (e) {
    $("problems").textContent = "cannot reach the admin listener: " + e;
  }
}

$("reset").addEventListener("click", reset);
tick();
setInterval(tick, EVERY_MS);
