"""The web view (``--serve PORT``): one page of plain HTML, inline JavaScript and SVG, no build step.

The server reads the job's view every refresh on a thread of its own and keeps the last
:data:`HISTORY` of them; the page polls ``/status.json`` and draws the members table, each worker's
steps per second, the consensus distance and the world size over time, and the events as a
timeline. It listens on localhost unless ``--host`` says otherwise, and only reads the store.
"""

from __future__ import annotations

import errno
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["HISTORY", "PAGE", "serve"]

#: How many refreshes the plots span.
HISTORY = 300

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>decent-optim-wrapper: watching a fleet</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1em; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: right; }
td:nth-child(2), th:nth-child(2), td:nth-child(4) { text-align: left; }
tr.lost td, tr.left td { color: #b00; } tr.silent td { color: #c60; }
.plots { display: flex; gap: 2em; flex-wrap: wrap; }
svg { border: 1px solid #ccc; background: #fcfcfc; }
#events li.lost { color: #b00; } #events li.joined { color: #070; }
</style></head>
<body>
<h2 id="title">decent-optim-wrapper</h2>
<table id="members"><thead><tr><th>member</th><th>state</th><th>rank</th><th>host</th><th>pid</th>
<th>step</th><th>steps/s</th><th>world</th><th>gen</th><th>sent MB</th><th>wait s</th><th>joins</th>
<th>losses</th><th>guard</th><th>consensus</th></tr></thead><tbody></tbody></table>
<div class="plots">
<div><b>steps per second, by member</b><br><svg id="rate" width="520" height="220"></svg></div>
<div><b>consensus distance</b><br><svg id="consensus" width="520" height="220"></svg></div>
<div><b>world size</b><br><svg id="world" width="520" height="220"></svg></div>
</div>
<h3>events</h3><ul id="events"></ul>
<script>
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
function cell(v, digits) {
  if (v === null || v === undefined) return "-";
  if (typeof v === "number") return digits === undefined ? String(v) : v.toFixed(digits);
  if (typeof v === "object") {
    return Object.entries(v).filter(e => e[1]).map(e => e.join("=")).join(",") || "0";
  }
  return String(v);
}
function plot(svg, series, ymin) {
  // pad: the axis labels' room on the left and below, the legend's on the right
  const w = svg.width.baseVal.value, h = svg.height.baseVal.value, left = 44, right = 80, pad = 24;
  let xs = [], ys = [];
  for (const s of series) for (const p of s.points) { xs.push(p[0]); ys.push(p[1]); }
  let out = "";
  if (xs.length) {
    const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
    const y0 = Math.min(ymin, ...ys), top = Math.max(...ys);
    const y1 = top > y0 ? top * 1.05 : y0 + 1;  // a flat series still gets a scale
    const X = x => left + (x - x0) / (x1 - x0) * (w - left - right);
    const Y = y => h - pad - (y - y0) / (y1 - y0) * (h - 2 * pad);
    const label = y => Math.abs(y1) < 0.1 && y !== 0 ? y.toPrecision(2) : y.toFixed(1);
    const clock = t => new Date(t * 1000).toLocaleTimeString();
    out += `<text x="4" y="${pad}" font-size="11">${label(y1)}</text>`;
    out += `<text x="4" y="${h - pad}" font-size="11">${label(y0)}</text>`;
    out += `<text x="${left}" y="${h - 6}" font-size="11">${clock(x0)}</text>`;
    out += `<text x="${w - right}" y="${h - 6}" font-size="11" text-anchor="end">${clock(x1)}</text>`;
    series.forEach((s, i) => {
      const d = s.points.map((p, j) => (j ? "L" : "M") + X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1))
        .join(" ");
      const c = COLORS[i % COLORS.length];
      out += `<path class="series" d="${d}" fill="none" stroke="${c}" stroke-width="2"/>`;
      for (const p of s.points) {
        const at = `cx="${X(p[0]).toFixed(1)}" cy="${Y(p[1]).toFixed(1)}"`;
        out += `<circle class="point" ${at} r="2" fill="${c}"/>`;
      }
      out += `<text x="${w - right + 6}" y="${pad + 13 * i}" font-size="11" fill="${c}">${s.name}</text>`;
    });
  }
  svg.innerHTML = out;
}
async function refresh() {
  let data;
  try { data = await (await fetch("status.json")).json(); } catch (e) { return; }
  const v = data.view;
  if (!v) return;
  document.getElementById("title").textContent =
    `job ${v.job} at ${v.store}: ${v.world_size} member(s), generation ${v.generation}`;
  const body = document.querySelector("#members tbody");
  body.innerHTML = "";
  for (const m of v.members) {
    const tr = document.createElement("tr");
    tr.className = m.state;
    const sent = m.bytes_sent === null || m.bytes_sent === undefined ? null : m.bytes_sent / 1e6;
    for (const [x, d] of [[m.member], [m.state], [m.rank], [m.host], [m.pid], [m.step], [m.steps_per_s, 2],
        [m.world_size], [m.generation], [sent, 2], [m.wait_s, 2], [m.joins], [m.losses], [m.guard],
        [m.consensus === null || m.consensus === undefined ? null : m.consensus.toPrecision(3)]]) {
      const td = document.createElement("td"); td.textContent = cell(x, d); tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  const byMember = {};
  for (const h of data.history) for (const [m, r] of Object.entries(h.rates)) {
    (byMember[m] = byMember[m] || []).push([h.time, r]);
  }
  plot(document.getElementById("rate"),
       Object.entries(byMember).map(([m, p]) => ({name: "member " + m, points: p})), 0);
  plot(document.getElementById("consensus"), [{name: "distance",
       points: data.history.filter(h => h.consensus !== null).map(h => [h.time, h.consensus])}], 0);
  plot(document.getElementById("world"),
       [{name: "world", points: data.history.map(h => [h.time, h.world_size])}], 0);
  const ul = document.getElementById("events");
  ul.innerHTML = "";
  for (const e of v.events) {
    const li = document.createElement("li");
    li.className = e.kind;
    const when = new Date(e.time * 1000).toLocaleTimeString();
    const donors = e.kind === "joined" ? ` (donor(s) ${e.donors.join(", ")})` : "";
    li.textContent = `${when}: step ${e.step}, generation ${e.generation}: member(s) ` +
      `${e.members.join(", ")} ${e.kind}${donors}; world size ${e.world_size}`;
    ul.appendChild(li);
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script></body></html>
"""


class _Views:
    """The latest view and the history the plots draw, refreshed by a thread of their own."""

    def __init__(self, read: Callable[[], dict[str, Any]], interval: float) -> None:
        self._read, self._interval = read, interval
        self._lock = threading.Lock()
        self._view: dict[str, Any] | None = None
        self._error: str | None = None
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            started = time.monotonic()
            try:
                view, error = self._read(), None
            except Exception as err:  # the job ended, the store went: shown on the page
                view, error = None, str(err)
            with self._lock:
                self._error = error
                if view is not None:
                    self._view = view
                    rates = {
                        str(m["member"]): m["steps_per_s"]
                        for m in view["members"]
                        if m["state"] in ("member", "silent") and m["steps_per_s"] is not None
                    }
                    self._history.append(
                        {
                            "time": view["time"],
                            "rates": rates,
                            "world_size": view["world_size"],
                            "consensus": view.get("consensus"),
                        }
                    )
            self.stopped.wait(max(0.0, self._interval - (time.monotonic() - started)))

    def payload(self) -> bytes:
        with self._lock:
            data = {"view": self._view, "error": self._error, "history": list(self._history)}
        return json.dumps(data).encode()


def serve(read: Callable[[], dict[str, Any]], host: str, port: int, interval: float) -> int:
    """Serve the page on ``host:port`` until interrupted; returns the exit code (2: the port is taken)."""
    views = _Views(read, interval)
    page = PAGE.replace("REFRESH_MS", str(int(interval * 1000))).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path in ("/", "/index.html"):
                body, kind = page, "text/html; charset=utf-8"
            elif path == "/status.json":
                body, kind = views.payload(), "application/json"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            del format, args  # quiet: the terminal is the user's

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as err:
        import sys

        if err.errno == errno.EADDRINUSE:
            why = f"port {port} is already in use on {host}; give --serve a free port"
        else:
            why = f"cannot listen on {host}:{port} ({err.strerror}); give another --serve port or --host"
        print(f"monitor: --serve {port}: {why}.", file=sys.stderr)
        return 2
    thread = threading.Thread(target=views.run, name="decent-monitor-views", daemon=True)
    thread.start()
    print(f"watching at http://{host}:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        views.stopped.set()
        server.server_close()
    return 0
