// walbox console: a small page over /ui/api (no framework, no build step).
"use strict";

const $ = (id) => document.getElementById(id);
const readOnly = document.body.dataset.readonly === "true";
const hasRelay = document.body.dataset.relay === "true";

// el builds an element: el("td", {class: "x"}, "text", child...).
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k instanceof Node ? k : String(k));
  return e;
}

function bytes(n) {
  if (n === undefined || n === null) return "–";
  if (n < 0) return "-" + bytes(-n);
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + u[i];
}

function secs(s) {
  if (s === undefined || s === null) return "–";
  if (s < 1) return Math.round(s * 1000) + " ms";
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}

function ago(t) {
  if (!t) return "–";
  const d = (Date.now() - new Date(t).getTime()) / 1000;
  return d >= 0 ? secs(d) + " ago" : "in " + secs(-d);
}

function facts(dl, pairs) {
  dl.replaceChildren();
  for (const [k, v, cls] of pairs) {
    if (v === undefined) continue;
    dl.append(el("dt", {}, k), el("dd", cls ? { class: cls } : {}, v));
  }
}

async function api(path, opts) {
  const r = await fetch("/ui/api/" + path, opts);
  let body = {};
  try { body = await r.json(); } catch (e) { body = { error: r.status + " " + r.statusText }; }
  if (!r.ok) throw Object.assign(new Error(body.error || r.statusText), { status: r.status });
  return body;
}

// ---- navigation ----
const pages = ["overview", "tail", "dlq", "doctor"];
function show() {
  const name = pages.includes(location.hash.slice(1)) ? location.hash.slice(1) : "overview";
  for (const p of pages) {
    $("page-" + p).hidden = p !== name;
    $("nav-" + p).classList.toggle("on", p === name);
  }
  if (name === "dlq") loadDLQ();
  if (name === "doctor" && !doctorLoaded) runDoctor();
}
window.addEventListener("hashchange", show);

// ---- overview ----
function slotState(rep, ov) {
  const s = rep.replication_slot;
  if (!s.exists) return ["missing", "bad"];
  if (s.wal_status === "lost") return ["lost", "bad"];
  if (s.active) return ["streaming", "good"];
  if (ov.ready && ov.ready.why.startsWith("standby")) return ["standby", "warn"];
  return ["inactive", "warn"];
}

async function loadOverview() {
  let ov;
  try { ov = await api("overview"); } catch (e) {
    $("overview-error").hidden = false; $("overview-error").textContent = e.message; return;
  }
  $("overview-error").hidden = !ov.error;
  $("overview-error").textContent = ov.error || "";
  const rep = ov.report;
  if (rep) {
    const s = rep.replication_slot;
    const [state, cls] = slotState(rep, ov);
    $("slot-state").textContent = state;
    $("slot-state").className = "big " + cls;
    facts($("slot-facts"), [
      ["slot", s.slot], ["wal_status", s.wal_status || "–"], ["active pid", s.active_pid || "–"],
      ["failover / synced", s.failover || s.synced ? (s.failover ? "failover" : "–") + " / " + (s.synced ? "synced" : "–") : undefined],
      ["invalidated", s.invalidation_reason || undefined, "bad"],
    ]);
    $("wal-retained").textContent = bytes(s.retained_bytes) + " retained";
    const headroom = s.safe_wal_size < 0 ? "unlimited (max_slot_wal_keep_size = -1)" : bytes(s.safe_wal_size);
    facts($("wal-facts"), [
      ["confirmed", s.confirmed_flush_lsn || "–"], ["server at", s.current_lsn || "–"],
      ["behind", bytes(s.lag_bytes)],
      ["headroom", headroom, s.safe_wal_size >= 0 && s.safe_wal_size < s.retained_bytes ? "bad" : ""],
    ]);
    const r = rep.relay;
    const last = ov.history.length ? ov.history[ov.history.length - 1] : null;
    if (r.state !== "running") $("lag").textContent = "relay " + r.state;
    else if (last && last.commit_to_ack_p99_seconds >= 0) $("lag").textContent = secs(last.commit_to_ack_p99_seconds) + " p99 commit→ack";
    else $("lag").textContent = r.events_per_second.toFixed(1) + " events/s";
    facts($("relay-facts"), [
      ["events/s", r.state === "running" ? r.events_per_second.toFixed(1) : "–"],
      ["commit→ack", last && last.commit_to_ack_mean_seconds >= 0 ? "mean " + secs(last.commit_to_ack_mean_seconds) + ", p99 ≤ " + secs(last.commit_to_ack_p99_seconds) : undefined],
      ["oldest unacked", r.state === "running" ? (r.lag_seconds > 0 ? secs(r.lag_seconds) : "none: caught up") : undefined],
      ["relay", r.state + (r.leader ? " (" + r.leader + ")" : "")],
      ["status written", r.updated_at ? ago(r.updated_at) : "never"],
      ["note", r.note || undefined, "warn"],
    ]);
    const total = rep.outboxes.reduce((a, o) => a + Math.max(o.unprocessed, 0), 0);
    $("unprocessed").textContent = total + " unprocessed";
    const of = [];
    for (const o of rep.outboxes) {
      of.push([o.table, (o.unprocessed < 0 ? "?" : o.unprocessed) + " unprocessed" +
        (o.oldest_unprocessed_seconds > 0 ? ", oldest " + secs(o.oldest_unprocessed_seconds) : "") +
        (o.dead_lettered > 0 ? ", " + o.dead_lettered + " dead-lettered" : "")]);
    }
    facts($("outbox-facts"), of);
    const dlq = rep.dlq;
    facts($("sink-facts"), [
      ["sink", ov.sink],
      [dlq ? dlq.stream : "dead letters", dlq ? (dlq.error ? "unreadable: " + dlq.error : dlq.messages + " dead letters") : undefined],
      ["errors", rep.errors && rep.errors.length ? rep.errors.join("; ") : undefined, "bad"],
    ]);
  }
  if (ov.ready) {
    $("sink-health").textContent = ov.ready.ok ? "ready" : "not ready";
    $("sink-health").className = "big " + (ov.ready.ok ? "good" : "bad");
    $("sink-health").title = ov.ready.why;
    const f = $("sink-facts");
    f.append(el("dt", {}, "/readyz"), el("dd", {}, ov.ready.why));
  } else if (rep && rep.dlq) {
    $("sink-health").textContent = rep.dlq.error ? "unreachable" : "reachable";
    $("sink-health").className = "big " + (rep.dlq.error ? "bad" : "good");
  }
  const mf = [];
  if (ov.maintenance) {
    for (const m of ov.maintenance) {
      if (!m.schedule) { mf.push([m.table, "not run yet (or sweeper.maintain: false)"]); continue; }
      mf.push([m.table, "last " + ago(m.schedule.last) + ", next " + ago(m.schedule.next)]);
      if (m.schedule.error) mf.push(["", m.schedule.error, "warn"]);
    }
  } else {
    mf.push(["", "shown where walbox run serves the console (its sweepers keep the schedule)"]);
  }
  facts($("maint-facts"), mf);
  drawChart(ov.history);
}

// drawChart draws the last hour (or since the console started): events/s
// and the commit → ack latency (p99 of walbox_commit_to_ack_seconds over
// each sample where walbox run serves the console, else the age of the
// oldest unacked event as walbox.relay_status has it), each scaled to its
// own maximum, as an inline SVG.
function drawChart(pts) {
  const W = 900, H = 180, P = 30;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("id", "chart-svg");
  svg.dataset.points = pts.length;
  const now = Date.now();
  const first = pts.length ? new Date(pts[0].t).getTime() : now;
  const span = Math.min(3600e3, Math.max(now - first, 60e3));
  const from = now - span;
  const x = (t) => P + (W - 2 * P) * (new Date(t).getTime() - from) / span;
  const mk = (tag, attrs, txt) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (txt !== undefined) e.textContent = txt;
    svg.append(e);
    return e;
  };
  const useP99 = pts.some((p) => p.commit_to_ack_p99_seconds >= 0);
  const lagOf = (p) => useP99 ? p.commit_to_ack_p99_seconds : p.lag_seconds;
  $("lag-legend").textContent = useP99 ? "commit → ack p99" : "oldest unacked (s)";
  // series draws one line; a point without a value (-1) breaks it.
  const series = (get, cls, fmt, anchorRight) => {
    const vals = pts.map(get);
    const max = Math.max(...vals, 1e-9);
    const y = (v) => H - P - (H - 2 * P) * (v / max);
    let seg = [];
    const flush = () => { if (seg.length) mk("polyline", { points: seg.join(" "), class: cls }); seg = []; };
    pts.forEach((p, i) => {
      if (vals[i] < 0) { flush(); return; }
      seg.push(`${x(p.t).toFixed(1)},${y(vals[i]).toFixed(1)}`);
    });
    flush();
    mk("text", { x: anchorRight ? W - 2 : 2, y: 12, class: "lab " + cls, "text-anchor": anchorRight ? "end" : "start" }, "max " + fmt(max));
  };
  mk("line", { x1: P, x2: W - P, y1: H - P, y2: H - P, class: "axis" });
  const ago = (ms) => ms >= 120e3 ? "-" + Math.round(ms / 60e3) + " min" : "-" + Math.round(ms / 1e3) + " s";
  for (const [label, pos] of [[ago(span), P], [ago(span / 2), W / 2], ["now", W - P]]) {
    mk("text", { x: pos, y: H - 8, "text-anchor": "middle", class: "lab" }, label);
  }
  if (pts.length) {
    series((p) => p.events_per_second, "eps", (v) => v.toFixed(1) + "/s", false);
    series(lagOf, "lagc", secs, true);
    const last = pts[pts.length - 1];
    svg.dataset.lastEps = last.events_per_second;
    svg.dataset.lastT = last.t;
  }
  $("chart").replaceChildren(svg);
}

// ---- live tail ----
const tail = { es: null, paused: false, events: [], held: [], max: 500, opens: 0, skipped: 0, skippedBase: 0, selected: null, refilter: null };

function subjectMatch(filter, subject) {
  if (!filter) return true;
  const f = filter.split("."), s = subject.split(".");
  for (let i = 0; i < f.length; i++) {
    if (f[i] === ">") return i < s.length;
    if (i >= s.length) return false;
    if (f[i] !== "*" && f[i] !== s[i]) return false;
  }
  return f.length === s.length;
}

function tailVisible(ev) {
  const subj = $("tail-subject").value.trim();
  const text = $("tail-text").value.trim().toLowerCase();
  if (subj && !subjectMatch(subj, ev.subject) && !subjectMatch(subj, ev.stream)) return false;
  if (text && !(ev.id + " " + ev.preview + " " + ev.subject).toLowerCase().includes(text)) return false;
  return true;
}

function tailRow(ev) {
  const where = ev.stream + (document.body.dataset.sink === "kafka" ? " [" + ev.partition + "]" : "");
  const tr = el("tr", { class: ev.dead_letter ? "dead" : "", "data-id": ev.id, onclick: () => tailOpen(ev) },
    el("td", { class: "dim" }, new Date(ev.acked_at_ms).toLocaleTimeString()),
    el("td", {}, where),
    el("td", { class: "num" }, document.body.dataset.sink === "kafka" ? ev.seq - 1 : ev.seq),
    el("td", {}, ev.subject),
    el("td", { class: "mono" }, ev.id),
    el("td", { class: "num" }, ev.commit_to_ack_ms !== null ? ev.commit_to_ack_ms.toFixed(1) + " ms" : "–"),
    el("td", { class: "mono preview" }, (ev.dead_letter ? "DEAD LETTER: " + ev.reason + ": " : "") + ev.preview.slice(0, 120)));
  tr.hidden = !tailVisible(ev);
  return tr;
}

function tailAdd(ev) {
  tail.events.push(ev);
  const rows = $("tail-rows");
  rows.prepend(tailRow(ev));
  while (tail.events.length > tail.max) { tail.events.shift(); rows.lastChild.remove(); }
  tailCounts();
}

function tailCounts() {
  const shown = [...$("tail-rows").children].filter((r) => !r.hidden).length;
  $("tail-counts").textContent = `${shown} shown of ${tail.events.length}` +
    (tail.held.length ? `, ${tail.held.length} held while paused` : "") +
    (tail.skipped ? `, ${tail.skipped} more not shown (the tail sends at most 200 events a second: narrow the filter)` : "");
}

function tailFilter() {
  const rows = [...$("tail-rows").children];
  const evs = [...tail.events].reverse();
  rows.forEach((r, i) => { r.hidden = !tailVisible(evs[i]); });
  tailCounts();
}

function pretty(s) {
  try { return JSON.stringify(JSON.parse(s), null, 2); } catch (e) { return s; }
}

function kv(obj) {
  const t = el("table", { class: "kv" });
  for (const k of Object.keys(obj || {}).sort()) t.append(el("tr", {}, el("th", {}, k), el("td", { class: "mono" }, typeof obj[k] === "object" ? JSON.stringify(obj[k]) : obj[k])));
  return t;
}

// tailOpen shows one event as its stream (topic) stores it, read back
// from there, and its outbox row.
async function tailOpen(ev) {
  const d = $("tail-detail");
  d.hidden = false;
  const where = document.body.dataset.sink === "kafka" ? `${ev.stream} [${ev.partition}] offset ${ev.seq - 1}` : `${ev.stream} seq ${ev.seq}`;
  const stored = el("div", { id: "tail-stored" }, "reading the stored message…");
  const rowBox = el("div", { id: "tail-row" }, "reading the row…");
  d.replaceChildren(
    el("button", { type: "button", class: "close", onclick: () => { d.hidden = true; } }, "×"),
    el("h3", {}, "Event ", el("span", { class: "mono" }, ev.id)),
    el("p", {}, `${where} · ${ev.subject} · commit→ack ${ev.commit_to_ack_ms !== null ? ev.commit_to_ack_ms.toFixed(1) + " ms" : "–"} · ${ev.size} bytes`),
    el("p", { class: "bad" }, ev.dead_letter ? "Dead letter: " + ev.reason : ""),
    stored,
    el("h4", {}, "Row"), rowBox);
  const q = `stream=${encodeURIComponent(ev.stream)}&seq=${ev.seq}&partition=${ev.partition}`;
  api("event?" + q).then((m) => {
    stored.replaceChildren(
      el("h4", {}, "Headers"), kv(Object.fromEntries(Object.entries(m.headers || {}).map(([k, v]) => [k, v.join(", ")]))),
      el("h4", {}, "Payload"), el("pre", { id: "tail-payload" }, pretty(m.payload)));
  }).catch((e) => { stored.replaceChildren(el("h4", {}, "Payload (preview)"), el("pre", {}, pretty(ev.preview)), el("p", { class: "warn" }, e.message)); });
  if (!ev.table) { rowBox.textContent = "a table-less event: it has no row"; return; }
  try {
    const r = await api("row?table=" + encodeURIComponent(ev.table) + "&id=" + encodeURIComponent(ev.id));
    rowBox.replaceChildren(r.row ? kv(r.row) : "not in " + ev.table + " (archived?)");
  } catch (e) { rowBox.textContent = e.message; }
}

function tailConnect() {
  if (!hasRelay) {
    $("tail-status").textContent = "no relay in this process: run walbox run for the live tail";
    $("tail-status").className = "badge warn";
    return;
  }
  // The filter is applied by the relay too, so that the 200 events a
  // second a viewer is sent are ones it asked for; the rows already listed
  // are filtered here (tailFilter).
  const q = new URLSearchParams();
  const subj = $("tail-subject").value.trim(), text = $("tail-text").value.trim();
  if (subj) q.set("subject", subj);
  if (text) q.set("text", text);
  if (tail.es) tail.es.close();
  const es = new EventSource("/ui/api/tail" + (q.size ? "?" + q : ""));
  tail.es = es;
  es.onopen = () => {
    tail.opens++;
    tail.skippedBase = tail.skipped; // the relay counts per connection
    $("tail-status").dataset.filter = q.toString();
    $("tail-status").textContent = "live";
    $("tail-status").className = "badge good";
    $("tail-status").dataset.opens = tail.opens;
  };
  es.onerror = () => {
    $("tail-status").textContent = "reconnecting";
    $("tail-status").className = "badge warn";
    if (es.readyState === EventSource.CLOSED && es === tail.es) setTimeout(() => { if (es === tail.es) tailConnect(); }, 1000);
  };
  es.addEventListener("event", (m) => {
    const ev = JSON.parse(m.data);
    if (tail.paused) { tail.held.push(ev); if (tail.held.length > tail.max) tail.held.shift(); tailCounts(); return; }
    tailAdd(ev);
  });
  es.addEventListener("skipped", (m) => { tail.skipped = tail.skippedBase + Number(m.data); tailCounts(); });
}

// ---- dead letters ----
let dlqData = null;

function dlqSelected() {
  return [...document.querySelectorAll("#dlq-rows input:checked")].map((c) => Number(c.value));
}

function dlqButtons() {
  const n = dlqSelected().length;
  $("dlq-retry").disabled = n === 0;
  $("dlq-retry").textContent = n ? `Retry ${n} selected` : "Retry selected";
  if (readOnly) $("dlq-retry").title = "read-only: set console.token to allow retries";
}

// The list's reads are numbered: one answered after a newer one was
// shown is dropped, so an older list never replaces a newer one (and a
// read still in flight never starves the page of answers).
let dlqAsked = 0, dlqShown = 0;

async function loadDLQ() {
  const mine = ++dlqAsked;
  $("dlq-summary").textContent = "reading…";
  let data;
  try { data = await api("dlq"); } catch (e) { if (mine > dlqShown) $("dlq-summary").textContent = e.message; return; }
  if (mine < dlqShown) return;
  dlqShown = mine;
  dlqData = data;
  // The rows the operator selected stay selected where they are still
  // listed: a refresh must not undo a selection about to be retried.
  const keep = new Set(dlqSelected());
  const rows = $("dlq-rows");
  rows.replaceChildren();
  for (const d of dlqData.dead_letters) {
    const to = d.destination ? `${d.destination} (${d.retry_subject})` : "nowhere: " + (d.why || "no " + dlqData.terms.Stream + " captures it");
    const box = el("input", { type: "checkbox", value: d.seq, onchange: dlqButtons });
    box.checked = keep.has(d.seq);
    rows.append(el("tr", { "data-seq": d.seq },
      el("td", {}, box),
      el("td", { class: "num" }, d.seq),
      el("td", {}, ago(d.time).replace(" ago", "")),
      el("td", {}, d.original_subject || "–"),
      el("td", { class: "mono link", onclick: () => dlqOpen(d) }, d.id || "–"),
      el("td", { class: "reason" }, d.reason),
      el("td", { class: "num" }, d.attempts < 0 ? "–" : d.attempts),
      el("td", { class: d.destination ? "" : "warn" }, to)));
  }
  const n = dlqData.dead_letters.length;
  $("dlq-summary").textContent = n === 0 ? `${dlqData.name} is empty: no dead letters` :
    `${dlqData.total} in ${dlqData.name}` + (n < dlqData.total ? ` (${n} shown)` : "");
  $("dlq-all").checked = false;
  dlqButtons();
}

function dlqOpen(d) {
  const box = $("dlq-detail");
  box.hidden = false;
  box.replaceChildren(
    el("button", { type: "button", class: "close", onclick: () => { box.hidden = true; } }, "×"),
    el("h3", {}, "Dead letter ", d.seq),
    el("p", {}, el("b", {}, "Reason: "), d.reason),
    el("p", {}, el("b", {}, "A retry goes to: "), d.destination ? `${d.destination} as ${d.retry_subject}` : "nowhere: " + d.why),
    el("h4", {}, "Headers"), kv(Object.fromEntries(Object.entries(d.headers || {}).map(([k, v]) => [k, v.join(", ")]))),
    el("h4", {}, "Payload"), el("pre", {}, pretty(d.payload)));
}

function dlqAskRetry() {
  const seqs = dlqSelected();
  if (!seqs.length) return;
  const by = new Map(dlqData.dead_letters.map((d) => [d.seq, d]));
  const list = $("dlq-confirm-list");
  list.replaceChildren();
  for (const s of seqs) {
    const d = by.get(s);
    list.append(el("li", {}, `seq ${s} → ` + (d && d.destination ? `${d.destination} (${d.retry_subject}), event ${d.id}` : "nowhere: " + (d ? d.why : "?") + " (it stays)")));
  }
  $("dlq-confirm-text").textContent = `Republish ${seqs.length} dead letter(s) to their original ${dlqData.terms.Subject}s and ${dlqData.terms.Remove} ${dlqData.name}?`;
  $("dlq-confirm").hidden = false;
}

async function dlqRetry() {
  const seqs = dlqSelected();
  $("dlq-confirm").hidden = true;
  const out = $("dlq-result");
  out.hidden = false;
  out.className = "result";
  out.textContent = "retrying…";
  const headers = { "Content-Type": "application/json" };
  const tok = $("token") ? $("token").value : "";
  if (tok) headers["X-Walbox-Token"] = tok;
  try {
    const r = await api("dlq/retry", { method: "POST", headers, body: JSON.stringify({ seqs }) });
    const res = r.result || {};
    out.className = "result " + (r.error ? "bad" : "good");
    out.replaceChildren(el("b", {}, `retried ${res.retried || 0}, already stored ${res.already_stored || 0}, skipped ${res.skipped || 0}`),
      ...(r.output || []).filter((l) => l).map((l) => el("div", { class: "mono" }, l)),
      el("div", {}, r.error || ""));
  } catch (e) {
    out.className = "result bad";
    out.textContent = "refused: " + e.message;
    out.dataset.status = e.status || "";
    return;
  }
  loadDLQ();
}

// ---- doctor ----
let doctorLoaded = false;
async function runDoctor() {
  doctorLoaded = true;
  $("doctor-summary").textContent = "running the checks…";
  let rep;
  try { rep = await api("doctor"); } catch (e) { $("doctor-summary").textContent = e.message; return; }
  const rows = $("doctor-rows");
  rows.replaceChildren();
  for (const c of rep.checks) {
    rows.append(el("tr", { class: c.status },
      el("td", {}, el("span", { class: "badge " + ({ ok: "good", warn: "warn", fail: "bad" }[c.status] || "") }, c.status)),
      el("td", {}, c.name), el("td", {}, c.detail), el("td", { class: "fix" }, c.fix || "")));
  }
  $("doctor-summary").textContent = rep.ok ? `all good (${rep.warned} warning(s))` : `${rep.failed} failed, ${rep.warned} warning(s)`;
}

// ---- start ----
document.addEventListener("DOMContentLoaded", () => {
  if ($("token")) {
    $("token").value = sessionStorage.getItem("walbox-token") || "";
    $("token").addEventListener("input", () => sessionStorage.setItem("walbox-token", $("token").value));
  }
  // A changed filter reconnects the feed with it (after typing pauses).
  const refilter = () => {
    tailFilter();
    clearTimeout(tail.refilter);
    tail.refilter = setTimeout(() => { if (tail.es) tailConnect(); }, 300);
  };
  $("tail-subject").addEventListener("input", refilter);
  $("tail-text").addEventListener("input", refilter);
  $("tail-pause").addEventListener("click", () => {
    tail.paused = !tail.paused;
    $("tail-pause").textContent = tail.paused ? "Resume" : "Pause";
    if (!tail.paused) { const h = tail.held; tail.held = []; h.forEach(tailAdd); }
    tailCounts();
  });
  $("tail-clear").addEventListener("click", () => { tail.events = []; $("tail-rows").replaceChildren(); tailCounts(); });
  $("dlq-refresh").addEventListener("click", loadDLQ);
  $("dlq-retry").addEventListener("click", dlqAskRetry);
  $("dlq-confirm-yes").addEventListener("click", dlqRetry);
  $("dlq-confirm-no").addEventListener("click", () => { $("dlq-confirm").hidden = true; });
  $("dlq-all").addEventListener("change", (e) => {
    document.querySelectorAll("#dlq-rows input").forEach((c) => { c.checked = e.target.checked; });
    dlqButtons();
  });
  $("doctor-run").addEventListener("click", runDoctor);
  show();
  loadOverview();
  setInterval(() => { if (!$("page-overview").hidden) loadOverview(); }, 2000);
  tailConnect();
});
