// pgbroker console: plain JavaScript, no build step.  Every name and value from the database is put into the
// page as text (textContent, text nodes, SVG <title> text): never as markup.
"use strict";

(function () {
  const SVGNS = "http://www.w3.org/2000/svg";
  const state = {
    info: null,
    tab: "brokers",
    selected: null,            // lease name shown in detail
    brokers: [],
    counts: { at: null, rows: {} },
    lag: [],
    history: {},               // name -> events, oldest first (from /api/history and the lease channel)
    shown: {},                 // "name:epoch:event" -> Date.now() when first drawn (the browser test reads it)
    pagers: {},                // table id -> stack of cursors
    client: null,              // client whose subscriptions are shown
    registryFeed: [],
    kvPrefix: "",
    refreshTimer: null,
    pending: {},
  };
  window.pgbrokerConsole = state;

  // -- DOM helpers: text only ------------------------------------------------------------------------------

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "onclick") node.addEventListener("click", v);
      else node.setAttribute(k, String(v));
    }
    for (const child of children) append(node, child);
    return node;
  }
  function append(node, child) {
    if (child === null || child === undefined || child === false) return;
    if (Array.isArray(child)) { child.forEach((c) => append(node, c)); return; }
    node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  function svg(tag, attrs, ...children) {
    const node = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined) node.setAttribute(k, String(v));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }
  function $(id) { return document.getElementById(id); }

  function text(value) {
    if (value === null || value === undefined) return "";
    if (typeof value === "object") return JSON.stringify(value);
    return String(value);
  }
  function when(value) {
    if (!value) return "";
    const d = new Date(value);
    return isNaN(d) ? String(value) : d.toLocaleString();
  }
  function age(seconds) {
    if (seconds === null || seconds === undefined) return "";
    const s = Number(seconds);
    if (s < 1) return (s * 1000).toFixed(0) + " ms";
    if (s < 120) return s.toFixed(1) + " s";
    if (s < 7200) return (s / 60).toFixed(1) + " min";
    return (s / 3600).toFixed(1) + " h";
  }
  function num(n) { return n === null || n === undefined ? "" : Number(n).toLocaleString("en-US"); }

  // -- talking to the server ------------------------------------------------------------------------------

  async function api(path, params) {
    const query = new URLSearchParams();
    for (const [k, v] of Object.entries(params || {})) if (v !== null && v !== undefined) query.set(k, v);
    const url = "/api/" + path + (query.toString() ? "?" + query.toString() : "");
    let response;
    try {
      response = await fetch(url, { headers: { Accept: "application/json" }, cache: "no-store" });
    } catch (err) {
      showStatus("server", "the console server does not answer: retrying");
      throw err;
    }
    const body = await response.json();
    if (response.status === 503) showStatus("reconnecting", body.message);
    if (!response.ok) throw new Error((body.error || response.status) + ": " + (body.message || ""));
    return body;
  }

  async function post(path, body) {
    const response = await fetch("/api/" + path, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": state.info ? state.info.csrf : "" },
      body: JSON.stringify(body),
    });
    const answer = await response.json();
    if (!response.ok) throw new Error(answer.message || String(response.status));
    return answer;
  }

  function showStatus(kind, detail) {
    const badge = $("db-status");
    badge.dataset.state = kind;
    if (kind === "connected") badge.textContent = "live";
    else if (kind === "server") badge.textContent = detail;
    else {
      const since = state.dbSince ? " since " + new Date(state.dbSince * 1000).toLocaleTimeString() : "";
      badge.textContent = "database unreachable" + since + ", reconnecting" + (detail ? ": " + detail : "");
    }
  }

  function setDb(db) {
    state.dbSince = db.since;
    if (db.state === "connected") showStatus("connected");
    else if (db.state === "connecting") showStatus("reconnecting", "connecting");
    else showStatus("reconnecting", db.error || "");
  }

  // -- pagination: a stack of keyset cursors per table -----------------------------------------------------

  function pager(id, more, lastCursor, reload) {
    const stack = state.pagers[id] || (state.pagers[id] = [null]);
    const box = $(id + "-pager");
    if (!box) return;
    clear(box);
    box.appendChild(el("button", { type: "button", disabled: stack.length <= 1 ? "disabled" : null,
      onclick: () => { stack.pop(); reload(); } }, "‹ previous"));
    box.appendChild(el("span", { class: "page" }, "page " + stack.length));
    box.appendChild(el("button", { type: "button", disabled: more ? null : "disabled",
      onclick: () => { stack.push(lastCursor); reload(); } }, "next ›"));
  }
  function cursor(id) { const s = state.pagers[id] || (state.pagers[id] = [null]); return s[s.length - 1]; }
  function resetPager(id) { state.pagers[id] = [null]; }

  function table(id, columns, rows, rowAttrs) {
    const node = clear($(id));
    const head = el("tr", {}, columns.map((c) => el("th", {}, c[0])));
    node.appendChild(el("thead", {}, head));
    const body = el("tbody");
    if (!rows.length) body.appendChild(el("tr", { class: "empty" }, el("td", { colspan: columns.length }, "none")));
    for (const row of rows) {
      const tr = el("tr", rowAttrs ? rowAttrs(row) : {});
      for (const c of columns) {
        const value = c[1](row);
        tr.appendChild(el("td", { class: c[2] || null }, value instanceof Node ? value : text(value)));
      }
      body.appendChild(tr);
    }
    node.appendChild(body);
  }

  function badge(ok, yes, no) { return el("span", { class: "badge " + (ok ? "ok" : "bad") }, ok ? yes : no); }

  // -- brokers ---------------------------------------------------------------------------------------------

  async function loadBrokers() {
    const page = await api("brokers", { after: cursor("brokers") || "", limit: 50 });
    state.brokers = page.rows;
    state.counts = page.counts || state.counts;
    state.lag = page.lag || [];
    setDb(page.db);
    if (!state.selected || !page.rows.some((b) => b.name === state.selected)) {
      const alive = page.rows.find((b) => b.alive);
      state.selected = (alive || page.rows[0] || { name: null }).name;
    }
    drawBrokers(page.more);
    if (state.selected && !state.history[state.selected]) await loadHistory(state.selected);
    drawDetail();
  }

  function drawBrokers(more) {
    const counts = state.counts.rows || {};
    table("brokers", [
      ["lease", (b) => b.name, "name"],
      ["holder", (b) => badge(b.alive, "alive", b.state === "held" ? "gone" : b.state)],
      ["epoch", (b) => b.epoch, "num"],
      ["pid", (b) => b.holder_pid, "num"],
      ["application", (b) => b.holder_application],
      ["since", (b) => when(b.claimed_at)],
      ["heartbeat age", (b) => age(b.heartbeat_age_s), "num"],
      ["waiting", (b) => b.waiting, "num"],
      ["clients", (b) => num((counts[b.name] || {}).clients), "num"],
      ["subscriptions", (b) => num((counts[b.name] || {}).subscriptions), "num"],
    ], state.brokers, (b) => ({
      class: b.name === state.selected ? "selected clickable" : "clickable",
      "data-name": b.name,
      onclick: () => { state.selected = b.name; loadHistory(b.name).then(() => { drawBrokers(more); drawDetail(); }); },
    }));
    pager("brokers", more, state.brokers.length ? state.brokers[state.brokers.length - 1].name : "", loadBrokers);
    const select = $("clients-broker");
    const current = select.value || state.selected;
    clear(select);
    for (const b of state.brokers) select.appendChild(el("option", { value: b.name }, b.name));
    if (current) select.value = current;
  }

  async function loadHistory(name) {
    const page = await api("history", { name: name, limit: 40 });
    const events = page.rows.slice().reverse();
    state.history[name] = events;
    state.historyMore = state.historyMore || {};
    state.historyMore[name] = page.more;
  }

  function eventKey(name, e) { return name + ":" + e.epoch + ":" + e.event; }

  function drawDetail() {
    const box = clear($("broker-detail"));
    const b = state.brokers.find((x) => x.name === state.selected);
    if (!b) { box.appendChild(el("p", {}, "No lease has been claimed yet.")); return; }
    const c = (state.counts.rows || {})[b.name] || {};
    const countsAge = state.counts.at ? " (counted " + age(Date.now() / 1000 - state.counts.at) + " ago)" : "";
    box.appendChild(el("h2", {}, "Lease ", el("span", { class: "name", id: "detail-name" }, b.name), " ",
      badge(b.alive, "held by a live holder", b.state === "held" ? "holder gone" : b.state)));
    const facts = [
      ["holder pid", b.holder_pid, "holder-pid"], ["application", b.holder_application, "holder-application"],
      ["address", b.holder_address || (b.holder_pid ? "local socket" : ""), "holder-address"],
      ["user", b.holder_user, "holder-user"], ["info", b.holder_info, "holder-info"],
      ["epoch", b.epoch, "holder-epoch"], ["since", when(b.claimed_at), "holder-since"],
      ["heartbeat", age(b.heartbeat_age_s) + " ago", "holder-heartbeat"], ["waiting to claim", b.waiting, "holder-waiting"],
      ["clients", num(c.clients) + countsAge, "count-clients"], ["subscriptions", num(c.subscriptions), "count-subscriptions"],
      ["takeovers", num(c.takeovers), "count-takeovers"], ["left to sweep", num(c.sweep_backlog), "count-sweep"],
    ];
    const dl = el("dl", { class: "facts" });
    for (const [label, value, id] of facts) { dl.appendChild(el("dt", {}, label)); dl.appendChild(el("dd", { id: id }, text(value))); }
    box.appendChild(dl);
    if (state.info && state.info.admin) {
      // kept across redraws, so that what the operator is typing survives the page's refreshes
      state.handOver = state.handOver || {};
      box.appendChild(state.handOver[b.name] || (state.handOver[b.name] = handOver(b)));
    }
    box.appendChild(el("h3", {}, "Epochs: how the lease moved"));
    box.appendChild(timeline(b));
    box.appendChild(el("h3", {}, "Outbox: backlog and delivery lag, last minutes"));
    box.appendChild(lagChart(b.name));
    box.appendChild(el("h3", {}, "History"));
    const events = (state.history[b.name] || []).slice().reverse();
    const hist = el("table", { class: "grid", id: "history" });
    box.appendChild(hist);
    table("history", [
      ["at", (e) => when(e.at)], ["event", (e) => e.event, "event"], ["epoch", (e) => e.epoch, "num"],
      ["pid", (e) => e.pid, "num"], ["application", (e) => e.application], ["reason", (e) => e.reason || e.info],
    ], events.slice(0, 20));
  }

  const EVENT_COLOURS = { claim: "#2e7d32", takeover: "#c62828", stale_takeover: "#ef6c00", release: "#616161", expired: "#6a1b9a" };

  function timeline(b) {
    const events = state.history[b.name] || [];
    const step = 56, left = 20, width = Math.max(600, left * 2 + 40 + step * Math.max(1, events.length));
    const root = svg("svg", { id: "timeline", width: width, height: 118, viewBox: "0 0 " + width + " 118",
      role: "img", "aria-label": "lease epochs of " + b.name });
    root.appendChild(svg("line", { x1: left, y1: 60, x2: width - left, y2: 60, class: "axis" }));
    events.forEach((e, i) => {
      const x = left + i * step + step / 2;
      const holds = e.event === "claim" || e.event === "takeover" || e.event === "stale_takeover";
      if (holds) {
        const next = i + 1 < events.length ? left + (i + 1) * step + step / 2 : width - left;
        root.appendChild(svg("rect", { x: x, y: 50, width: Math.max(4, next - x), height: 20,
          class: "epoch " + (e.epoch % 2 ? "odd" : "even") }));
        root.appendChild(svg("text", { x: x + 4, y: 44, class: "epoch-label" }, "epoch " + e.epoch));
      }
      const key = eventKey(b.name, e);
      if (!state.shown[key]) state.shown[key] = Date.now();
      const g = svg("g", { class: "tl-event", "data-event": e.event, "data-epoch": e.epoch, "data-key": key,
        "data-at-ms": Date.parse(e.at), "data-shown-ms": state.shown[key] });
      g.appendChild(svg("circle", { cx: x, cy: 60, r: 7, fill: EVENT_COLOURS[e.event] || "#000" }));
      g.appendChild(svg("text", { x: x, y: 88, class: "tl-kind" }, e.event.replace("_", " ")));
      g.appendChild(svg("text", { x: x, y: 102, class: "tl-time" }, new Date(e.at).toLocaleTimeString()));
      g.appendChild(svg("title", {}, e.event + " of epoch " + e.epoch + " at " + when(e.at) + " by pid " + text(e.pid)
        + (e.application ? " (" + e.application + ")" : "") + (e.reason ? ": " + e.reason : "")));
      root.appendChild(g);
    });
    const wrap = el("div", { class: "timeline-wrap" }, root);
    setTimeout(() => { wrap.scrollLeft = wrap.scrollWidth; }, 0);
    return wrap;
  }

  function lagChart(name) {
    const w = 600, h = 90, samples = state.lag;
    const root = svg("svg", { id: "lag-chart", width: w, height: h, viewBox: "0 0 " + w + " " + h, role: "img",
      "aria-label": "outbox backlog of " + name });
    if (!samples.length) { root.appendChild(svg("text", { x: 10, y: 40 }, "no sample yet")); return root; }
    const t0 = samples[0].t, t1 = samples[samples.length - 1].t, span = Math.max(1, t1 - t0);
    const lags = samples.map((s) => (s.brokers[name] || { lag_s: 0 }).lag_s || 0);
    const pend = samples.map((s) => (s.brokers[name] || { pending: 0 }).pending || 0);
    const maxLag = Math.max(1, ...lags), maxPend = Math.max(1, ...pend);
    const pts = (vals, max) => samples.map((s, i) => ((s.t - t0) / span * (w - 20) + 10).toFixed(1) + ","
      + (h - 15 - vals[i] / max * (h - 30)).toFixed(1)).join(" ");
    root.appendChild(svg("polyline", { points: pts(pend, maxPend), class: "pending" }));
    root.appendChild(svg("polyline", { points: pts(lags, maxLag), class: "lag" }));
    const last = samples.length - 1;
    root.appendChild(svg("text", { x: 10, y: 12, class: "legend", id: "lag-now" },
      "backlog " + num(pend[last]) + " (max " + num(maxPend) + "), oldest " + age(lags[last]) + " (max " + age(maxLag) + ")"));
    root.appendChild(svg("text", { x: 10, y: h - 2, class: "legend" }, age(span) + " ago"));
    root.appendChild(svg("text", { x: w - 40, y: h - 2, class: "legend" }, "now"));
    return root;
  }

  function handOver(b) {
    const box = el("div", { class: "admin" });
    const input = el("input", { type: "text", id: "handover-confirm", placeholder: "type " + b.name + " to confirm" });
    const result = el("span", { id: "handover-result" });
    box.appendChild(el("span", {}, "Hand the lease over (terminate its holder; a waiting standby claims): "));
    box.appendChild(input);
    box.appendChild(el("button", { type: "button", id: "handover", onclick: async () => {
      result.textContent = "…";
      try {
        const r = await post("admin/takeover", { name: b.name, confirm: input.value });
        result.textContent = "done: took epoch " + r.epoch + " and released it";
      } catch (err) { result.textContent = "refused: " + err.message; }
    } }, "Hand over"));
    box.appendChild(result);
    return box;
  }

  function onLease(event, received) {
    const name = event.name;
    const events = state.history[name] || (state.history[name] = []);
    if (!events.some((e) => e.epoch === event.epoch && e.event === event.event)) {
      events.push({ id: null, name: name, epoch: event.epoch, event: event.event, at: event.at, pid: event.pid,
        application: event.application, info: event.info, reason: null });
      if (events.length > 60) events.splice(0, events.length - 60);
    }
    if (state.tab === "brokers" && (name === state.selected || !state.selected)) {
      if (!state.selected) state.selected = name;
      drawDetail();
    }
    later("brokers", 150, async () => {
      await loadHistory(name);
      if (state.tab === "brokers") await loadBrokers();
    });
  }

  // -- clients and subscriptions ---------------------------------------------------------------------------

  async function fillBrokerSelect() {
    const select = $("clients-broker");
    if (select.options.length) return;
    const page = await api("brokers", { limit: 200 });
    for (const b of page.rows) select.appendChild(el("option", { value: b.name }, b.name));
    const alive = page.rows.find((b) => b.alive);
    if (state.selected || alive) select.value = state.selected || alive.name;
  }

  async function loadClients() {
    await fillBrokerSelect();
    const name = $("clients-broker").value || state.selected || "default";
    const page = await api("clients", { name: name, after: cursor("clients") || "", prefix: $("clients-search").value, limit: 50 });
    $("clients-epoch").textContent = page.epoch === null ? "no such lease" : "epoch " + page.epoch;
    table("clients", [
      ["client", (c) => c.client_id, "name"], ["info", (c) => c.info], ["subscriptions", (c) => c.subscriptions, "num"],
      ["registered", (c) => when(c.registered_at)], ["updated", (c) => when(c.updated_at)],
    ], page.rows, (c) => ({ class: "clickable" + (state.client === c.client_id ? " selected" : ""), "data-client": c.client_id,
      onclick: () => { state.client = c.client_id; resetPager("subscriptions"); loadSubscriptions(); loadClients(); } }));
    pager("clients", page.more, page.rows.length ? page.rows[page.rows.length - 1].client_id : "", loadClients);
    if (state.client) await loadSubscriptions();
  }

  async function loadSubscriptions() {
    const name = $("clients-broker").value || "default";
    const c = cursor("subscriptions") || ["", ""];
    const page = await api("subscriptions", { name: name, client: state.client, after_table: c[0], after_key: c[1], limit: 50 });
    $("subscriptions-title").textContent = "Subscriptions of " + state.client;
    // A subscription by filter shows one point of its filter (a filter with "in" has one row per value).
    table("subscriptions", [["table", (s) => s.table],
      ["key", (s) => s.key !== null ? s.key : (s.filter ? "filter " + JSON.stringify(s.filter) : "(the whole table)")],
      ["since", (s) => when(s.subscribed_at)]], page.rows);
    const last = page.rows[page.rows.length - 1];
    pager("subscriptions", page.more, last ? [last.table, last.cursor] : null, loadSubscriptions);
  }

  function onRegistry(message) {
    for (const e of message.events) {
      state.registryFeed.unshift({ at: new Date(), name: message.name, e: e });
    }
    if (message.changes > message.events.length) {
      state.registryFeed.unshift({ at: new Date(), name: message.name, e: { event: "(" + (message.changes - message.events.length) + " more changes)" } });
    }
    state.registryFeed.length = Math.min(state.registryFeed.length, 30);
    const feed = clear($("registry-feed"));
    for (const item of state.registryFeed) {
      const e = item.e;
      feed.appendChild(el("li", {}, item.at.toLocaleTimeString() + " " + item.name + ": " + e.event + " "
        + text(e.client_id) + (e.table ? " " + e.table + " " + text(e.key) : "") + (e.info ? " " + text(e.info) : "")));
    }
    if (state.tab === "clients" && message.name === ($("clients-broker").value || "default")) later("clients", 500, loadClients);
  }

  // -- locks, semaphores, squatters ------------------------------------------------------------------------

  async function loadLocks() {
    const c = cursor("locks") || ["", -1];
    const page = await api("locks", { after: c[0], after_pid: c[1], limit: 50 });
    table("locks", [["lock", (l) => l.name, "name"], ["mode", (l) => l.mode], ["holder pid", (l) => l.holder_pid, "num"],
      ["application", (l) => l.application], ["holder session since", (l) => when(l.holder_since)],
      ["waiting", (l) => l.waiting, "num"], ["waiting since", (l) => when(l.waiting_since)]], page.rows);
    const last = page.rows[page.rows.length - 1];
    pager("locks", page.more, last ? [last.name, last.holder_pid] : null, loadLocks);
    const sem = await api("semaphores", { after: cursor("semaphores") || "", limit: 50 });
    table("semaphores", [["semaphore", (s) => s.name, "name"], ["permits", (s) => s.permits, "num"], ["held", (s) => s.held, "num"],
      ["holders (pids)", (s) => (s.holders || []).join(", ")], ["waiting", (s) => s.waiting, "num"]], sem.rows);
    pager("semaphores", sem.more, sem.rows.length ? sem.rows[sem.rows.length - 1].name : "", loadLocks);
    const squat = await api("unaccounted", { limit: 100 });
    table("unaccounted", [["pid", (u) => u.pid, "num"], ["role", (u) => u.role], ["application", (u) => u.application],
      ["state", (u) => u.session_state], ["lock", (u) => u.lock_class + " " + u.key], ["why", (u) => u.why]], squat.rows);
  }

  // -- key-value store: a tree by prefix --------------------------------------------------------------------

  async function loadKV() {
    const prefix = state.kvPrefix;
    if ((prefix === "" || prefix.endsWith("/")) && state.kvTree !== false) {
      const tree = await api("kv/tree", { prefix: prefix, after: cursor("kv") || "", limit: 100 });
      if (tree.supported) { drawKVTree(prefix, tree); return; }
      state.kvTree = false;  // the keys do not sort in byte order here: group a flat page instead
    }
    const page = await api("kv", { prefix: prefix, after: cursor("kv") || "", limit: 100 });
    $("kv-note").textContent = page.values_visible ? "" : "values hidden: the console's role is not a member of pgbroker_user";
    drawCrumbs(prefix);
    const rows = [];
    const folders = new Map();
    for (const r of page.rows) {
      const rest = r.key.slice(prefix.length);
      const cut = rest.indexOf("/");
      if (cut >= 0 && cut < rest.length - 1) {
        const folder = prefix + rest.slice(0, cut + 1);
        if (!folders.has(folder)) {
          folders.set(folder, { folder: folder, label: rest.slice(0, cut + 1), n: 0 });
          rows.push(folders.get(folder));
        }
        folders.get(folder).n += 1;
      } else rows.push(r);
    }
    table("kv", [
      ["key", (r) => r.folder ? el("a", { href: "#kv", class: "folder", onclick: (ev) => { ev.preventDefault(); setPrefix(r.folder); } }, "▸ " + r.label)
        : el("span", { class: "kv-key" }, r.key.slice(prefix.length) || r.key), "name"],
      ["value", (r) => r.folder ? r.n + (page.more && r === rows[rows.length - 1] ? "+" : "") + " key(s) on this page" : el("code", { class: "kv-value" }, page.values_visible ? JSON.stringify(r.value) : "(hidden)")],
      ["version", (r) => r.folder ? "" : r.version, "num"], ["updated", (r) => r.folder ? "" : when(r.updated_at)],
      ["expires", (r) => r.folder ? "" : (r.expires_at ? when(r.expires_at) : "never")],
    ], rows, (r) => ({ "data-key": r.folder || r.key }));
    pager("kv", page.more, page.rows.length ? page.rows[page.rows.length - 1].key : "", loadKV);
  }
  function drawCrumbs(prefix) {
    const crumbs = clear($("kv-crumbs"));
    crumbs.appendChild(el("a", { href: "#kv", class: "crumb", onclick: (ev) => { ev.preventDefault(); setPrefix(""); } }, "(root)"));
    let acc = "";
    for (const part of prefix.split("/").slice(0, -1)) {
      acc += part + "/";
      const target = acc;
      crumbs.appendChild(document.createTextNode(" / "));
      crumbs.appendChild(el("a", { href: "#kv", class: "crumb", onclick: (ev) => { ev.preventDefault(); setPrefix(target); } }, part));
    }
  }

  function drawKVTree(prefix, tree) {
    $("kv-note").textContent = tree.values_visible ? "" : "values hidden: the console's role is not a member of pgbroker_user";
    drawCrumbs(prefix);
    const hidden = !tree.values_visible;
    table("kv", [
      ["key", (r) => r.folder ? el("a", { href: "#kv", class: "folder", onclick: (ev) => { ev.preventDefault(); setPrefix(r.child); } }, "▸ " + r.child.slice(prefix.length))
        : el("span", { class: "kv-key" }, r.child.slice(prefix.length)), "name"],
      ["value", (r) => r.folder ? "folder" : el("code", { class: "kv-value" }, hidden ? "(hidden)" : JSON.stringify(r.value))],
      ["version", (r) => r.folder ? "" : r.version, "num"], ["updated", (r) => r.folder ? "" : when(r.updated_at)],
      ["expires", (r) => r.folder ? "" : (r.expires_at ? when(r.expires_at) : "never")],
    ], tree.rows, (r) => ({ "data-key": r.child }));
    pager("kv", tree.more, tree.rows.length ? tree.rows[tree.rows.length - 1].child : "", loadKV);
  }

  function setPrefix(prefix) { state.kvPrefix = prefix; $("kv-prefix").value = prefix; resetPager("kv"); loadKV(); }

  // -- counters, rate limits, grants, doctor ----------------------------------------------------------------

  async function loadCounters() {
    const page = await api("counters", { after: cursor("counters") || "", limit: 50 });
    table("counters", [["counter", (c) => c.name, "name"], ["value", (c) => num(c.value), "num"], ["updated", (c) => when(c.updated_at)]], page.rows);
    pager("counters", page.more, page.rows.length ? page.rows[page.rows.length - 1].name : "", loadCounters);
    const rl = await api("rate_limits", { after: cursor("rate-limits") || "", limit: 50 });
    table("rate-limits", [["rate limit", (r) => r.name, "name"], ["rate", (r) => r.rate + " per " + age(r.per_s), "num"],
      ["burst", (r) => r.burst, "num"], ["available", (r) => r.available, "num"], ["full at", (r) => r.full_at ? when(r.full_at) : "now"],
      ["allowed", (r) => num(r.allowed), "num"], ["denied", (r) => num(r.denied), "num"], ["updated", (r) => when(r.updated_at)]], rl.rows);
    pager("rate-limits", rl.more, rl.rows.length ? rl.rows[rl.rows.length - 1].name : "", loadCounters);
  }

  async function loadGrants() {
    const c = cursor("grants") || ["", "", ""];
    const page = await api("grants", { after_kind: c[0], after_prefix: c[1], after_role: c[2], limit: 50 });
    const admin = state.info && state.info.admin;
    const columns = [["kind", (g) => g.kind], ["prefix", (g) => g.prefix === "" ? "(every name)" : g.prefix, "name"],
      ["role", (g) => g.role], ["rights", (g) => g.rights], ["granted", (g) => when(g.granted_at)]];
    if (admin) columns.push(["", (g) => el("button", { type: "button", class: "revoke", onclick: () => confirmRevoke(g) }, "Revoke…")]);
    table("grants", columns, page.rows);
    const last = page.rows[page.rows.length - 1];
    pager("grants", page.more, last ? [last.kind, last.prefix, last.role] : null, loadGrants);
  }

  function confirmRevoke(g) {
    const expected = g.kind + ":" + g.prefix + ":" + g.role;
    const box = clear($("grants-confirm"));
    const input = el("input", { type: "text", id: "revoke-confirm", placeholder: expected });
    const result = el("span", { id: "revoke-result" });
    box.appendChild(el("p", {}, "Revoke " + g.rights + " on " + g.kind + " names beginning with “" + g.prefix + "” from " + g.role
      + "? Type " + expected + " to confirm: "));
    box.appendChild(input);
    box.appendChild(el("button", { type: "button", id: "revoke-go", onclick: async () => {
      try {
        const r = await post("admin/revoke", { kind: g.kind, prefix: g.prefix, role: g.role, confirm: input.value });
        result.textContent = r.revoked ? "revoked" : "there was no such grant";
        loadGrants();
      } catch (err) { result.textContent = "refused: " + err.message; }
    } }, "Revoke"));
    box.appendChild(result);
  }

  async function loadDoctor() {
    const page = await api("health");
    $("doctor-note").textContent = page.note;
    table("doctor", [["", (f) => badge(f.ok, "ok", "FAIL")], ["check", (f) => f.check], ["subject", (f) => f.subject],
      ["finding", (f) => f.detail], ["what to do", (f) => f.fix]], page.rows, (f) => ({ class: f.ok ? "" : "failing" }));
  }

  // -- tabs, timers, the event stream ----------------------------------------------------------------------

  const LOADERS = { brokers: loadBrokers, clients: loadClients, locks: loadLocks, kv: loadKV, counters: loadCounters,
    grants: loadGrants, doctor: loadDoctor };
  // What has no channel a reader may LISTEN on is read again while it is shown (seconds).
  const REFRESH = { brokers: 2, clients: 5, locks: 1, kv: 2, counters: 2, grants: 5, doctor: 5 };

  function later(key, ms, job) {
    if (state.pending[key]) return;
    state.pending[key] = setTimeout(async () => {
      state.pending[key] = null;
      try { await job(); } catch (err) { /* shown by api() */ }
    }, ms);
  }

  async function refresh() {
    try { await LOADERS[state.tab](); } catch (err) { /* the status badge says why */ }
  }

  function showTab(tab) {
    if (!LOADERS[tab]) tab = "brokers";
    state.tab = tab;
    for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.tab === tab);
    for (const s of document.querySelectorAll("section.tab")) s.hidden = s.id !== "tab-" + tab;
    clearInterval(state.refreshTimer);
    state.refreshTimer = setInterval(refresh, REFRESH[tab] * 1000);
    refresh();
  }

  function connect() {
    const source = new EventSource("/events");
    source.onmessage = (m) => {
      let msg;
      try { msg = JSON.parse(m.data); } catch (err) { return; }
      if (msg.type === "hello" || msg.type === "db") setDb(msg.db || msg);
      else if (msg.type === "lease") onLease(msg.event, msg.received);
      else if (msg.type === "registry") onRegistry(msg);
      else if (msg.type === "counts") { state.counts = msg; if (state.tab === "brokers") { drawBrokers(false); drawDetail(); } }
      else if (msg.type === "lag") {
        state.lag.push(msg.sample);
        if (state.lag.length > 300) state.lag.shift();
        if (state.tab === "brokers" && state.selected) {
          const chart = $("lag-chart");
          if (chart) chart.replaceWith(lagChart(state.selected));
        }
      } else if (msg.type === "reload") {
        state.history = {};
        refresh();
      }
    };
    source.onerror = () => { showStatus("server", "the console server does not answer: retrying"); };
    source.onopen = () => { refresh(); };
  }

  async function start() {
    for (const a of document.querySelectorAll("#tabs a")) {
      a.addEventListener("click", () => { /* the hash change shows it */ });
    }
    window.addEventListener("hashchange", () => showTab(location.hash.slice(1)));
    $("clients-search").addEventListener("input", () => { resetPager("clients"); later("clients-search", 250, loadClients); });
    $("clients-broker").addEventListener("change", () => { resetPager("clients"); state.client = null; loadClients(); });
    $("kv-prefix").addEventListener("input", () => { state.kvPrefix = $("kv-prefix").value; resetPager("kv"); later("kv-search", 250, loadKV); });
    for (;;) {
      try { state.info = await api("info"); break; } catch (err) { await new Promise((r) => setTimeout(r, 1000)); }
    }
    $("database").textContent = state.info.database;
    $("role").textContent = state.info.describe;
    $("mode").textContent = state.info.admin ? "admin" : "read-only";
    $("mode").dataset.mode = state.info.admin ? "admin" : "read-only";
    $("footer").textContent = "pgbroker schema " + state.info.version + " · pages of at most " + state.info.max_page
      + " rows · lease and registry changes arrive as they commit (LISTEN), the rest is re-read while shown";
    setDb(state.info.db);
    connect();
    showTab(location.hash.slice(1) || "brokers");
  }

  start();
})();
