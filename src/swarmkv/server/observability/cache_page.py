"""GET /cache: one self-contained HTML page (inline CSS and JS, nothing fetched but the JSON) drawing the tree.

Every second the page reads `/v1/cache/tree` (see `cache_tree.py` for its nodes) and draws each node as a
bar: x is the token position, the width its tokens, and each branch gets its own lane, so the shared head
is the trunk at the top left and every session's tail runs to the right of where it left the head. Colour:
hue by tenant and cache salt, darker with more holders (pale: cached, no request holds it). Host-tier nodes are
hatched, pinned ones outlined in black, aggregates faded. Each node's `<g>` carries `data-tokens`,
`data-holders`, `data-kind`, `data-tier`, `data-pinned`, and `data-role="trunk"` on a root's largest child.
With an API key, open `/cache#key=KEY` (the fragment never leaves the browser).
"""

from __future__ import annotations

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>swarmkv prefix cache</title>
<style>
  body { font: 13px system-ui, sans-serif; margin: 16px 20px; color: #1d2430; background: #fbfbfc; }
  h1 { font-size: 17px; margin: 0 0 8px; }
  #pool { display: flex; flex-wrap: wrap; gap: 4px 18px; align-items: center; margin-bottom: 6px; }
  #bar { display: flex; width: 360px; height: 14px; border: 1px solid #8a93a3; background: #eef0f4; }
  #bar div { height: 100%; }
  .stat b { font-variant-numeric: tabular-nums; }
  #legend { color: #566070; margin: 4px 0 10px; }
  #legend span { display: inline-block; width: 12px; height: 10px; margin: 0 3px 0 10px; vertical-align: -1px; }
  #status { color: #8a93a3; font-size: 12px; margin-bottom: 6px; }
  svg text { font-size: 11px; pointer-events: none; }
  .node rect { stroke: #ffffff; stroke-width: 1; }
  .node.pinned rect { stroke: #000000; stroke-width: 2; }
  .node.aggregate rect { fill-opacity: 0.45; stroke-dasharray: 4 2; stroke: #566070; }
  .link { stroke: #9aa3b2; stroke-width: 1; }
</style>
</head>
<body>
<h1>swarmkv prefix cache</h1>
<div id="pool"></div>
<div id="legend">
  <span style="background:hsl(215,65%,86%)"></span>cached, unheld
  <span style="background:hsl(215,65%,66%)"></span>held once
  <span style="background:hsl(215,65%,42%)"></span>held 8+ times
  <span style="background:repeating-linear-gradient(45deg,#7a8699 0 2px,#fff 2px 4px)"></span>host tier
  <span style="border:2px solid #000;height:6px;width:8px"></span>pinned
  &nbsp; x: token position &middot; width: tokens &middot; one lane per branch
</div>
<div id="status">loading&hellip;</div>
<svg id="tree" xmlns="http://www.w3.org/2000/svg" width="1160" height="40">
  <defs>
    <pattern id="hatch" width="5" height="5" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">
      <rect width="5" height="5" fill="#ffffff" fill-opacity="0.35"></rect>
      <line x1="0" y1="0" x2="0" y2="5" stroke="#1d2430" stroke-width="2"></line>
    </pattern>
  </defs>
  <g id="nodes"></g>
</svg>
<script>
"use strict";
const WIDTH = 1160, ROW = 24, BAR = 18, TOP = 4, SVG = "http://www.w3.org/2000/svg";
const key = new URLSearchParams(location.hash.slice(1)).get("key");

function say(text) { document.getElementById("status").textContent = text; }

function el(name, attrs, parent) {
  const node = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (parent) parent.appendChild(node);
  return node;
}

function hue(n) {
  if (n.salt === null && n.tenant === null) return 215;
  let h = 0;
  const name = (n.tenant === null ? "" : n.tenant + "/") + (n.salt === null ? "" : n.salt);
  for (const c of name) h = (h * 31 + c.charCodeAt(0)) % 360;
  return h;
}

function size(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  for (; bytes >= 1024 && i < units.length - 1; i++) bytes /= 1024;
  return (i ? bytes.toFixed(1) : bytes) + " " + units[i];
}

function drawPool(pool) {
  const box = document.getElementById("pool");
  box.textContent = "";
  const bar = document.createElement("div");
  bar.id = "bar";
  const parts = [["pages_in_use", "#2f5d9e"], ["pages_cached", "#9dbbe3"], ["pages_free", "#eef0f4"]];
  for (const [field, colour] of parts) {
    const part = document.createElement("div");
    part.style.width = (100 * pool[field] / Math.max(1, pool.pages_total)) + "%";
    part.style.background = colour;
    part.title = field.replace("_", " ") + ": " + pool[field];
    bar.appendChild(part);
  }
  box.appendChild(bar);
  const rate = pool.hit_rate === null ? "n/a" : (100 * pool.hit_rate).toFixed(1) + "%";
  const stats = [
    ["pages", pool.pages_total], ["in use", pool.pages_in_use], ["cached", pool.pages_cached],
    ["free", pool.pages_free], ["offloaded", size(pool.offloaded_bytes)], ["pinned", size(pool.pinned_bytes)],
    ["hit rate", pool.prompt_tokens === null ? rate
      : rate + " (" + pool.prefix_hit_tokens + " of " + pool.prompt_tokens + " prompt tokens)"],
  ];
  for (const [name, value] of stats) {
    const s = document.createElement("span");
    s.className = "stat";
    s.append(name + " ");
    const b = document.createElement("b");
    b.textContent = value;
    s.appendChild(b);
    box.appendChild(s);
  }
}

function label(n) {
  if (n.kind === "aggregate") return n.aggregated + " more leaves, " + n.tokens + " tokens";
  const head = "shared head" + (n.tenant === null ? "" : " of " + n.tenant)
    + (n.salt === null ? "" : " (salt " + n.salt + ")");
  const who = n.trunk ? head : (n.num_sessions ? n.sessions.slice(0, 2).join(", ") : "no session");
  const more = n.num_sessions > 2 && !n.trunk ? " +" + (n.num_sessions - 2) : "";
  return who + more + " \\u00b7 " + n.tokens + " tok \\u00b7 " + n.holders + " held";
}

function drawTree(tree) {
  const group = document.getElementById("nodes");
  group.textContent = "";
  const nodes = tree.nodes;
  const end = Math.max(1, ...nodes.map(n => n.start + n.span));
  const x = t => 8 + (WIDTH - 16) * t / end;
  const lane = new Map(), continued = new Set();
  let lanes = 0;
  for (const n of nodes) {  // parents come first, children largest first: a first child keeps its parent's lane
    if (n.parent === null || continued.has(n.parent)) lane.set(n.id, lanes++);
    else { lane.set(n.id, lane.get(n.parent)); continued.add(n.parent); }
  }
  const y = n => TOP + ROW * lane.get(n.id);
  for (const n of nodes) {
    if (n.parent === null) continue;  // a salt's root holds no tokens
    if (lane.get(n.id) !== lane.get(n.parent)) {
      el("line", {class: "link", x1: x(n.start), x2: x(n.start), y1: y(nodes[n.parent]) + BAR, y2: y(n)}, group);
    }
    const g = el("g", {
      class: "node " + n.kind + (n.pinned ? " pinned" : ""), "data-id": n.id, "data-tokens": n.tokens,
      "data-holders": n.holders, "data-kind": n.kind, "data-tier": n.tier, "data-pinned": n.pinned,
    }, group);
    if (n.trunk) g.setAttribute("data-role", "trunk");
    const left = x(n.start), width = Math.max(2, x(n.start + n.span) - left);
    const light = n.holders === 0 ? 86 : 66 - 8 * Math.log2(Math.min(n.holders, 8));  // any holder shows
    el("rect", {x: left, y: y(n), width: width, height: BAR, fill: `hsl(${hue(n)},65%,${light}%)`}, g);
    if (n.tier !== "device") el("rect", {x: left, y: y(n), width: width, height: BAR, fill: "url(#hatch)"}, g);
    el("title", {}, g).textContent = [
      label(n), n.pages + " pages, tier " + n.tier + (n.pinned ? ", pinned" : ""),
      "tokens " + n.start + "\\u2013" + (n.start + n.span),
      "sessions: " + (n.sessions.join(", ") || "none") + (n.num_sessions > n.sessions.length ? ", \\u2026" : ""),
    ].join("\\n");
    const text = label(n);
    if (width > 40) {
      const t = el("text", {x: left + 4, y: y(n) + 13, fill: light < 55 ? "#ffffff" : "#1d2430"}, g);
      t.textContent = text.length * 6.2 > width - 8 ? text.slice(0, Math.max(0, (width - 8) / 6.2 - 1)) + "\\u2026" : text;
    }
  }
  document.getElementById("tree").setAttribute("height", TOP + ROW * Math.max(1, lanes) + 8);
  if (!nodes.length) say("the cache is empty (or prefix caching is off)");
}

async function refresh() {
  try {
    const headers = key ? {Authorization: "Bearer " + key} : {};
    const response = await fetch("/v1/cache/tree", {headers: headers, cache: "no-store"});
    if (response.status === 401) { say("this server needs its API key: open /cache#key=YOUR_KEY"); return; }
    if (!response.ok) { say("GET /v1/cache/tree answered " + response.status); return; }
    const tree = await response.json();
    drawPool(tree.pool);
    drawTree(tree);
    if (tree.nodes.length) say(tree.num_indexed_pages + " pages indexed, " + tree.nodes.length +
      " nodes drawn \\u00b7 updated " + new Date().toLocaleTimeString());
  } catch (error) {
    say("cannot reach the server: " + error);
  }
}

refresh();
setInterval(refresh, 1000);
</script>
</body>
</html>
"""
