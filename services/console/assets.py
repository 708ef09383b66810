"""The console's stylesheet and script, served from memory (written here; the only vendored asset
is the map's land outline, :mod:`loom_services.console.land`, with its licence).

The script follows the page's event stream (``body[data-events]``, server-sent events) and
updates rows of the jobs table and the job page in place; ``data-history`` on each job keeps
the states the page has shown, in order (what the browser tests read). On a job page that
follows its job live, the operator's cancel is confirmed and sent from the page itself (a POST
with ``live=1``, answered at once), and the ``cancelled`` event shows the outcome in place.
"""

CSS = b"""
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2433;background:#f6f7f9}
header{display:flex;gap:1.5em;align-items:center;padding:.6em 1.2em;background:#1d2433;color:#fff}
header nav{display:flex;gap:1em;flex:1}header nav a{color:#cfd6e4;text-decoration:none}
header nav a.active{color:#fff;font-weight:600}.who{margin-left:auto;color:#9fb0cc}
main{padding:1em 1.5em}h1{font-size:1.4em;margin:.2em 0 .6em}
table{border-collapse:collapse;background:#fff;margin:.5em 0 1.2em}
td,th{padding:.25em .7em;border-bottom:1px solid #e3e6eb;text-align:left}
.bar{display:inline-block;width:80px;height:8px;background:#e3e6eb;vertical-align:middle}
.bar span{display:block;height:100%;background:#3b7dd8}
.state.running{color:#3b7dd8}.state.completed{color:#2ca02c}.state.failed,.state.rejected{color:#d62728}
.state.queued,.state.placed{color:#8a6d00}.bad{color:#d62728}.error{color:#d62728;font-weight:600}
svg.map{width:100%;max-width:1000px;background:#fff}.sea{fill:#eef3fa}.grid{stroke:#d5deeb;stroke-width:.5}
.land{fill:#e2e6dc;stroke:#b7bfae;stroke-width:.6;stroke-linejoin:round}
.link{stroke-width:2.5;opacity:.85}.region circle{fill:#1d2433}.region text{font-size:12px;fill:#1d2433}
dl{display:grid;grid-template-columns:8em 1fr;gap:.2em 1em}dt{color:#66708a}
#timeline time{color:#66708a;font-variant-numeric:tabular-nums}.filters{margin-bottom:.6em}
button[disabled]{opacity:.6}.notice{background:#e7f4e4;border:1px solid #9fd19a;padding:.5em .8em}
a.button{display:inline-block;padding:.3em .8em;border:1px solid #1d2433;border-radius:3px}
a.button{text-decoration:none;color:#1d2433;background:#fff}
button.danger{background:#d62728;color:#fff;border:0;padding:.4em 1em;border-radius:3px}
.drain{color:#8a6d00;font-weight:600}.chart rect{fill:#3b7dd8}.chart text{font-size:12px}
.inc.open{color:#d62728}

"""

JS = b"""
(function () {
  "use strict";
  var STATE_OF = {submitted: "queued", requeued: "queued", placed: "placed", started: "running",
    progress: "running", checkpointed: "running", resized: "running", completed: "completed",
    failed: "failed", rejected: "rejected", cancelled: "cancelled"};
  var FINAL = ["completed", "rejected", "cancelled"];
  var live = window.loomConsole = {events: 0, connected: false};
  var src = document.body.dataset.events;
  if (!src || !window.EventSource) return;

  function text(el, value) { if (el) el.textContent = value; }
  function remember(holder, state) {
    var seen = (holder.dataset.history || "").split(" ").filter(Boolean);
    if (seen[seen.length - 1] !== state) seen.push(state);
    holder.dataset.history = seen.join(" ");
  }
  function apply(holder, ev) {
    var state = STATE_OF[ev.kind];
    if (!state) return;
    var seen = (holder.dataset.history || "").split(" ");
    // A job that completed, was rejected or cancelled stays so: the run stopped by a cancel is
    // still reported (failed) after it. A failure is not final (a retry requeues the job).
    if (FINAL.indexOf(seen[seen.length - 1]) >= 0) return;
    var cell = holder.querySelector("[data-field=state]");
    if (cell) { cell.textContent = state; cell.className = "state " + state; }
    if (ev.cluster) text(holder.querySelector("[data-field=cluster]"), ev.cluster);
    var bar = holder.querySelector("[data-field=progress]");
    if (ev.progress != null) text(bar, Math.round(ev.progress * 100) + "%");
    if (state === "completed") text(holder.querySelector("[data-field=progress]"), "100%");
    if (ev.reason) text(holder.querySelector("[data-field=reason]"), ev.reason);
    remember(holder, state);
    if (holder.id === "job" && FINAL.indexOf(state) >= 0) {
      var button = document.querySelector("a[data-action=cancel]");
      if (button) button.parentNode.remove();  // nothing left to cancel
    }
  }
  function say(message, ok) {
    var p = document.querySelector("p.notice");
    if (!p) {
      p = document.createElement("p");
      var h1 = document.querySelector("main h1");
      h1.parentNode.insertBefore(p, h1.nextSibling);
    }
    p.className = ok ? "notice" : "notice error";
    p.setAttribute("role", "status");
    p.textContent = message;
  }
  function newRow(table, ev) {
    var wantState = table.dataset.filterState, wantTenant = table.dataset.filterTenant;
    if ((wantState && wantState !== "queued") || (wantTenant && wantTenant !== ev.tenant)) return null;
    var tr = document.createElement("tr");
    tr.dataset.job = ev.job_id; tr.dataset.history = "";
    var link = document.createElement("a");
    link.href = "/jobs/" + encodeURIComponent(ev.job_id); link.textContent = ev.job_id;
    var when = new Date(ev.at * 1000).toISOString().slice(0, 19).replace("T", " ");
    var cells = [link, ev.tenant, "queued", "-", "0%", when];
    var fields = [null, null, "state", "cluster", "progress", null];
    cells.forEach(function (value, i) {
      var td = document.createElement("td");
      if (fields[i]) td.dataset.field = fields[i];
      if (typeof value === "string") td.textContent = value; else td.appendChild(value);
      tr.appendChild(td);
    });
    var body = table.tBodies[0];
    body.insertBefore(tr, body.firstChild);
    var empty = document.querySelector("p.empty");
    if (empty) empty.remove();
    return tr;
  }
  function timeline(ev) {
    var list = document.getElementById("timeline");
    if (!list) return;
    var li = document.createElement("li");
    li.dataset.kind = ev.kind;
    var t = document.createElement("time");
    t.textContent = new Date(ev.at * 1000).toISOString().slice(0, 19).replace("T", " ");
    var b = document.createElement("b");
    b.textContent = ev.kind;
    li.appendChild(t); li.appendChild(document.createTextNode(" ")); li.appendChild(b);
    li.appendChild(document.createTextNode(" " + (ev.cluster ? "cluster " + ev.cluster : "")));
    list.appendChild(li);
  }

  var source = new EventSource(src);
  source.onopen = function () { live.connected = true; document.body.dataset.live = "on"; };
  source.onerror = function () { live.connected = false; document.body.dataset.live = "off"; };
  source.addEventListener("job", function (message) {
    var ev = JSON.parse(message.data);
    live.events += 1;
    var job = document.getElementById("job");
    if (job && job.dataset.jobId === ev.job_id) { apply(job, ev); timeline(ev); }
    var table = document.querySelector("table[data-live-jobs]");
    if (!table) return;
    var row = null;
    table.querySelectorAll("tr[data-job]").forEach(function (tr) {
      if (tr.dataset.job === ev.job_id) row = tr;
    });
    if (!row && ev.kind === "submitted") row = newRow(table, ev);
    if (row) apply(row, ev);
  });

  // The operator's cancel on a job page that follows its job: confirmed and sent from the page,
  // whose event stream then shows the job cancelled (without it: the confirmation page).
  var cancel = document.querySelector("a[data-action=cancel][data-form-key]");
  if (cancel) cancel.addEventListener("click", function (e) {
    if (!live.connected) return;
    e.preventDefault();
    if (!window.confirm(cancel.dataset.confirm)) return;
    var body = new URLSearchParams();
    body.set("form_key", cancel.dataset.formKey);
    body.set("live", "1");
    fetch(cancel.href, {method: "POST", body: body, credentials: "same-origin"})
      .then(function (r) { return r.json().then(function (a) { say(a.message, r.ok); }); })
      .catch(function () { say("The cancel could not be sent: try again.", false); });
  });
})();
"""
