"""The status page: `GET /` and `GET /status` (one static HTML page) and `GET /status.json` (what it shows); and
`GET /debug/requests/{id}`, one request's timeline from the flight recorder (`pdserve debug trace` prints it).

The page holds no data, so it is served without the API key; it fetches /status.json every 2 s, which needs
the key like every other route (the page asks for it and keeps it in sessionStorage). /status.json reads
what the gateway already knows: the worker pool's last Health/Load answers, the generations in flight, and a
ring buffer of throughput and TTFT samples. A background task takes one sample every `INTERVAL_S` from the
gateway's own counters (output tokens, the TTFT histogram), keeping the last `WINDOW_S`: it starts and stops
with the app. With several gateway processes (--gateway-workers) the counters and the generations in flight are
summed over them, as /metrics shows them. Batches in flight come from the jobs service (its most recent 100 batches) when --jobs-url is set.
With an API key and an admin key both set, the requests' timelines (/status.json's, and /debug/requests) are the
admin key's: the API key is every client's, and they hold other clients' ids, timings and token counts.
With --planner slo, the planner's targets, the worker counts it would want and its last decisions.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import asdict, dataclass

import aiohttp
from aiohttp import web

from pdserve.services.gateway.apis.context import GATEWAY, JOBS_SESSION, sees_other_clients
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.metrics import GatewayMetrics
from pdserve.services.gateway.timelines import RECENT, SLOWEST
from pdserve.shared.outputs import acceptance

PAGE_PATHS = frozenset({"/", "/status"})  # the HTML only: answered without the API key
INTERVAL_S = 3.0  # between two samples
WINDOW_S = 600.0  # samples kept: the last ten minutes
ACTIVE_BATCH_STATUSES = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
JOBS_TIMEOUT = aiohttp.ClientTimeout(total=2)
SHOWN = 10  # of the flight recorder's recent and slowest requests, on the page


@dataclass(frozen=True)
class Sample:
    t: float  # unix time at the end of the interval
    tokens_per_s: float  # output tokens generated per second over the interval
    ttft_p50_s: float | None  # median TTFT of the generations that got their first token in it (None: none did)


@dataclass(frozen=True)
class Snapshot:
    """The gateway's cumulative counters at one moment."""
    t: float
    tokens: float
    ttft_buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending


def snapshot(metrics: GatewayMetrics) -> Snapshot:
    """As /metrics reports them: with several gateway processes, their sums."""
    tokens = sum(s.value for s in metrics.samples(metrics.generation_tokens) if s.name.endswith("_total"))
    buckets = tuple((float(s.labels["le"]), s.value) for s in metrics.samples(metrics.ttft)
                    if s.name.endswith("_bucket"))
    return Snapshot(time.time(), tokens, buckets)


def median_between(before: Snapshot, after: Snapshot) -> float | None:
    """The TTFT median of the observations between two snapshots, interpolated within its bucket as
    Prometheus' histogram_quantile does."""
    counts = [(le, a - b) for (le, a), (_, b) in zip(after.ttft_buckets, before.ttft_buckets)]
    total = counts[-1][1] if counts else 0
    if total <= 0:
        return None
    rank, lower, below = total / 2, 0.0, 0.0
    for le, cumulative in counts:
        if cumulative >= rank:
            if le == float("inf"):
                return lower  # beyond the last finite bound: its lower edge is all that is known
            inside = cumulative - below
            return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = le, cumulative
    return lower


class Sampler:
    """Owns the ring buffer of samples and the task that fills it."""

    def __init__(self, metrics: GatewayMetrics, interval_s: float = INTERVAL_S, window_s: float = WINDOW_S) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=max(1, int(window_s / interval_s)))
        self._last = snapshot(metrics)

    def take(self) -> Sample:
        now = snapshot(self.metrics)
        dt = max(now.t - self._last.t, 1e-6)
        sample = Sample(now.t, (now.tokens - self._last.tokens) / dt, median_between(self._last, now))
        self.samples.append(sample)
        self._last = now
        return sample

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.take()


SAMPLER: web.AppKey[Sampler] = web.AppKey("status_sampler", Sampler)


def describe_worker(w) -> dict:
    load = w.load
    kv = None
    if load is not None and load.total_pages:
        kv = {"used_pages": load.total_pages - load.free_pages, "total_pages": load.total_pages,
              "cached_pages": load.cached_pages,
              "fraction": (load.total_pages - load.free_pages) / load.total_pages,
              # the tiers below the pool (--enable-hierarchical-cache), where the worker has them
              "host": ({"pages": load.host_pages, "total_pages": load.host_capacity} if load.host_tier else None),
              "storage": ({"pages": load.storage_pages, "bytes": load.storage_bytes} if load.storage_tier
                          else None)}
    return {"address": w.address, "role": w.role, "healthy": w.healthy, "last_error": w.last_error or None,
            "in_flight": w.in_flight, "running": load.running if load else None,
            "queued": load.waiting if load else None, "kv": kv,
            "spec": spec_figures(load), "live_moves": {"out": w.moved_out, "in": w.moved_in}}


def spec_figures(load) -> dict | None:
    """A speculating worker's accept length and rate since it started (None where it has not drafted)."""
    if load is None or not load.spec_drafting_reqs:
        return None
    length, rate = acceptance(load.spec_drafting_reqs, load.spec_draft_tokens, load.spec_accepted_tokens)
    return {"accept_length": round(length, 3), "accept_rate": round(rate, 3)}


async def batches_in_flight(request: web.Request) -> dict | None:
    """{"count": n} of the jobs service's most recent 100 batches still running, {"error": ...} when it does
    not answer, None without --jobs-url. The client's key goes along, as through the proxy."""
    jobs_url = request.app[GATEWAY].jobs_url
    if not jobs_url:
        return None
    headers = {h: request.headers[h] for h in ("Authorization",) if h in request.headers}
    try:
        async with request.app[JOBS_SESSION].get(jobs_url.rstrip("/") + "/v1/batches?limit=100",
                                                            headers=headers, timeout=JOBS_TIMEOUT) as reply:
            if reply.status != 200:
                return {"error": f"the jobs service answered {reply.status}"}
            listing = await reply.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return {"error": f"the jobs service is unreachable: {exc or type(exc).__name__}"}
    return {"count": sum(1 for b in listing.get("data", []) if b.get("status") in ACTIVE_BATCH_STATUSES)}


def requests_in_flight(backend) -> dict:
    """Generations running on the workers and queued before them: with several gateway processes, the sums of
    every process's gauges, as /metrics shows them."""
    backend.metrics.queued.set(backend.queued)  # this process's share of the room may have changed since
    in_flight = sum(s.value for s in backend.metrics.samples(backend.metrics.running))
    queued = sum(s.value for s in backend.metrics.samples(backend.metrics.queued))
    return {"running": round(in_flight - queued), "queued": round(queued)}


async def status_json(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    backend = gw.backend
    workers: dict[str, list[dict]] = {}
    for w in backend.workers():
        workers.setdefault(w.role, []).append(describe_worker(w))
    body = {"model": gw.served_model_name, "mode": backend.mode, "time": time.time(), "workers": workers,
            "requests": requests_in_flight(backend),
            "samples": {"interval_s": request.app[SAMPLER].interval_s,
                        "points": [asdict(s) for s in request.app[SAMPLER].samples]},
            "timelines": {"recent": [t.as_dict() for t in list(backend.recorder.recent)[::-1][:SHOWN]],
                          "slowest": [t.as_dict() for t in backend.recorder.slowest[:SHOWN]]}
            if sees_other_clients(request) else None}
    body["planner"] = gw.planner.describe() if gw.planner is not None else None
    batches = await batches_in_flight(request)
    if batches is not None:
        body["batches_in_flight"] = batches
    return web.json_response(body, headers={"Cache-Control": "no-store"})


async def request_timelines(request: web.Request) -> web.Response:
    """GET /debug/requests/{id}: the kept timelines of a request, by its X-Request-Id, its id, the client's id or
    its trace id (this gateway process's flight recorder: services/gateway/timelines.py)."""
    wanted = request.match_info["id"]
    found = request.app[GATEWAY].backend.recorder.find(wanted)
    if not found:
        raise ApiError(404, f"No timeline of a request {wanted!r} is kept by this gateway process (it keeps the last "
                            f"{RECENT} requests and the {SLOWEST} slowest).", "id")
    return web.json_response({"timelines": [t.as_dict() for t in found]}, headers={"Cache-Control": "no-store"})


async def page(request: web.Request) -> web.Response:
    return web.Response(text=PAGE, content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


async def sampling(app: web.Application):
    sampler = app[SAMPLER] = Sampler(app[GATEWAY].backend.metrics)
    task = asyncio.create_task(sampler.run(), name="status-sampler")
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def add_routes(app: web.Application) -> None:
    for path in sorted(PAGE_PATHS):
        app.router.add_get(path, page)
    app.router.add_get("/status.json", status_json)
    app.router.add_get("/debug/requests/{id}", request_timelines)
    app.cleanup_ctx.append(sampling)


# One self-contained page: no external resources, so it works on a machine without internet access.
PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pdserve status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #1d2433; background: #f6f7f9; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 15px; margin: 20px 0 8px; }
.muted { color: #667; } .error { color: #b00020; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; }
.card { background: #fff; border: 1px solid #dde; border-radius: 6px; padding: 10px 16px; min-width: 120px; }
.card b { display: block; font-size: 22px; }
table { border-collapse: collapse; background: #fff; border: 1px solid #dde; }
th, td { padding: 6px 12px; border-bottom: 1px solid #eef; text-align: left; }
.healthy { color: #137333; font-weight: 600; } .down { color: #b00020; font-weight: 600; }
.bar { display: inline-block; width: 100px; height: 8px; background: #e5e7ee; border-radius: 4px;
       vertical-align: middle; }
.bar i { display: block; height: 100%; background: #3b6fd8; border-radius: 4px; }
.charts { display: flex; gap: 16px; flex-wrap: wrap; }
svg { background: #fff; border: 1px solid #dde; border-radius: 6px; }
#keyform { display: none; margin: 12px 0; }
</style></head>
<body>
<h1>pdserve gateway</h1>
<div class="muted" id="summary">loading…</div>
<form id="keyform"><span class="error" id="keymsg">This gateway needs its API key.</span>
  <input id="key" type="password" placeholder="API key" autocomplete="off"> <button>Use key</button></form>
<div class="error" id="error"></div>
<div class="cards">
  <div class="card">running<b id="running">–</b></div>
  <div class="card">queued<b id="queued">–</b></div>
  <div class="card">batches in flight<b id="batches">–</b></div>
</div>
<h2>Workers</h2>
<table><thead><tr><th>role</th><th>address</th><th>health</th><th>running</th><th>queued</th>
  <th>in flight (this gateway)</th><th>KV use</th><th>speculation</th><th>live moves out / in</th></tr></thead>
  <tbody id="workers"></tbody></table>
<h2>Planner</h2>
<div class="muted" id="planner">–</div>
<table id="planner-table"><thead><tr><th>time</th><th>decision</th><th>reason</th><th>pressure (prefill / decode)</th>
  <th>detail</th><th>outcome</th></tr></thead><tbody id="decisions"></tbody></table>
<h2>Last requests</h2>
<table><thead><tr><th>started</th><th>request id</th><th>workers</th><th>TTFT ms</th><th>where the TTFT went (ms)</th>
  <th>total ms</th><th>tokens in / out</th><th>events</th></tr></thead><tbody id="timelines"></tbody></table>
<h2>Slowest requests</h2>
<table><thead><tr><th>started</th><th>request id</th><th>workers</th><th>TTFT ms</th><th>where the TTFT went (ms)</th>
  <th>total ms</th><th>tokens in / out</th><th>events</th></tr></thead><tbody id="slowest"></tbody></table>
<h2>Last 10 minutes</h2>
<div class="charts">
  <svg id="chart-throughput" width="520" height="200" viewBox="0 0 520 200" role="img"></svg>
  <svg id="chart-ttft" width="520" height="200" viewBox="0 0 520 200" role="img"></svg>
</div>
<script>
"use strict";
const KEY = "pdserve-api-key", WINDOW_S = 600, W = 520, H = 200, PAD = 40;
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => "&#" + c.charCodeAt(0) + ";");
const num = (v, d = 0) => (v === null || v === undefined) ? "–" : Number(v).toFixed(d);

$("keyform").addEventListener("submit", (e) => {
  e.preventDefault(); sessionStorage.setItem(KEY, $("key").value); refresh();
});

function chart(svg, title, points, pick, unit) {
  const now = Date.now() / 1000, vals = points.map(pick).filter((v) => v !== null);
  const max = Math.max(1e-9, ...vals) * 1.1;
  const x = (t) => PAD + (W - 2 * PAD) * (1 - (now - t) / WINDOW_S);
  const y = (v) => H - PAD + 10 - (H - PAD - 10) * (v / max);
  let out = `<text x="${PAD}" y="16" font-size="13" font-weight="600">${esc(title)}</text>`;
  out += `<line x1="${PAD}" y1="${y(0)}" x2="${W - PAD}" y2="${y(0)}" stroke="#bbc"/>`;
  out += `<text x="${PAD}" y="${H - 8}" font-size="11" fill="#667">-10 min</text>`;
  out += `<text x="${W - PAD}" y="${H - 8}" font-size="11" fill="#667" text-anchor="end">now</text>`;
  out += `<text x="${PAD - 4}" y="${y(max / 1.1) + 4}" font-size="11" fill="#667" text-anchor="end">` +
         `${esc(num(max / 1.1, max < 10 ? 2 : 0))}</text>`;
  const pts = points.filter((p) => pick(p) !== null && now - p.t <= WINDOW_S)
                    .map((p) => `${x(p.t).toFixed(1)},${y(pick(p)).toFixed(1)}`);
  if (pts.length) {
    out += `<polyline fill="none" stroke="#3b6fd8" stroke-width="2" points="${pts.join(" ")}"/>`;
    const [lx, ly] = pts[pts.length - 1].split(",");
    out += `<circle cx="${lx}" cy="${ly}" r="3" fill="#3b6fd8"/>`;
    out += `<text x="${W - PAD}" y="16" font-size="12" text-anchor="end">` +
           `${esc(num(pick(points[points.length - 1]), 1))} ${esc(unit)}</text>`;
  } else {
    out += `<text x="${W / 2}" y="${H / 2}" font-size="12" fill="#667" text-anchor="middle">no data yet</text>`;
  }
  svg.innerHTML = out;
}

function timelineRows(list) {
  return list.map((t) => {
    const parts = Object.entries(t.ttft_parts).filter(([, v]) => v >= 0.0005).sort((a, b) => b[1] - a[1])
                        .map(([k, v]) => `${esc(k)} ${(1000 * v).toFixed(1)}`).join(", ");
    return `<tr><td>${new Date(t.started * 1000).toLocaleTimeString()}</td><td>${esc(t.request_id)}</td>` +
           `<td>${esc(t.workers)}</td><td>${t.ttft_s === null ? "–" : (1000 * t.ttft_s).toFixed(1)}</td>` +
           `<td>${parts || "–"}</td><td>${(1000 * t.total_s).toFixed(1)}</td>` +
           `<td>${t.prompt_tokens} / ${t.output_tokens}</td><td>${esc(t.events.join("; ")) || "–"}</td></tr>`;
  }).join("") || `<tr><td colspan="8" class="muted">none yet</td></tr>`;
}

function render(s) {
  const updated = new Date(s.time * 1000).toLocaleTimeString();
  $("summary").textContent = `model ${s.model} · ${s.mode} mode · updated ${updated}`;
  $("running").textContent = s.requests.running;
  $("queued").textContent = s.requests.queued;
  const b = s.batches_in_flight;
  $("batches").textContent = b === undefined ? "no jobs service" : (b.error ? "?" : b.count);
  $("batches").title = b && b.error ? b.error : "";
  let rows = "";
  for (const [role, workers] of Object.entries(s.workers)) {
    for (const w of workers) {
      const kv = w.kv ? `<span class="bar"><i style="width:${(100 * w.kv.fraction).toFixed(1)}%"></i></span> ` +
                        `${(100 * w.kv.fraction).toFixed(1)}% (${w.kv.used_pages}/${w.kv.total_pages} pages)` +
                        (w.kv.host ? ` · host ${w.kv.host.pages}/${w.kv.host.total_pages} pages` : "") +
                        (w.kv.storage ? ` · storage ${w.kv.storage.pages} pages ` +
                                        `(${(w.kv.storage.bytes / 1048576).toFixed(1)} MiB)` : "") : "–";
      const spec = w.spec ? `accept len ${w.spec.accept_length.toFixed(2)}, rate ` +
                            `${(100 * w.spec.accept_rate).toFixed(0)}%` : "–";
      const health = w.healthy ? `<span class="healthy">healthy</span>`
                               : `<span class="down" title="${esc(w.last_error || "")}">down</span>`;
      rows += `<tr><td>${esc(role)}</td><td>${esc(w.address)}</td><td>${health}</td><td>${num(w.running)}</td>` +
              `<td>${num(w.queued)}</td><td>${w.in_flight}</td><td>${kv}</td><td>${spec}</td>` +
              `<td>${w.live_moves.out} / ${w.live_moves.in}</td></tr>`;
    }
  }
  $("workers").innerHTML = rows || `<tr><td colspan="8" class="muted">no workers</td></tr>`;
  const hidden = `<tr><td colspan="8" class="muted">other clients' requests: open the page with the admin key</td></tr>`;
  $("timelines").innerHTML = s.timelines ? timelineRows(s.timelines.recent) : hidden;
  $("slowest").innerHTML = s.timelines ? timelineRows(s.timelines.slowest) : hidden;
  const pl = s.planner;
  $("planner-table").style.display = pl ? "" : "none";
  $("planner").textContent = pl ? `SLO: TTFT ${num(1000 * pl.ttft_slo_s)} ms, ITL ${num(1000 * pl.itl_slo_s)} ms` +
      `${pl.dry_run ? " · dry run: switches nothing" : ""} · would want ${num(pl.desired.prefill)} prefill, ` +
      `${num(pl.desired.decode)} decode` : "off (pdserve gateway --planner slo turns it on)";
  $("decisions").innerHTML = pl ? pl.decisions.slice(0, 10).map((d) =>
      `<tr><td>${new Date(d.time * 1000).toLocaleTimeString()}</td><td>${esc(d.action)}` +
      `${d.addresses.length ? " " + esc(d.addresses.join(", ")) + " " + esc(d.from) + " → " + esc(d.to) : ""}</td>` +
      `<td>${esc(d.reason)}</td>` +
      `<td>${num(d.pressure.prefill, 2)} / ${num(d.pressure.decode, 2)}</td><td>${esc(d.detail)}</td>` +
      `<td>${esc(d.outcome || "–")}</td></tr>`).join("") : "";
  chart($("chart-throughput"), "Output tokens/s", s.samples.points, (p) => p.tokens_per_s, "tok/s");
  chart($("chart-ttft"), "TTFT p50 (ms)", s.samples.points,
        (p) => p.ttft_p50_s === null ? null : 1000 * p.ttft_p50_s, "ms");
}

async function refresh() {
  const key = sessionStorage.getItem(KEY);
  try {
    const r = await fetch("status.json", {headers: key ? {"Authorization": "Bearer " + key} : {}, cache: "no-store"});
    if (r.status === 401) { $("keyform").style.display = "block"; $("error").textContent = ""; return; }
    if (!r.ok) throw new Error(`/status.json answered ${r.status}`);
    $("keyform").style.display = "none"; $("error").textContent = "";
    render(await r.json());
  } catch (e) {
    $("error").textContent = "Cannot reach the gateway: " + e.message;
  }
}
refresh();
setInterval(refresh, 2000);
</script></body></html>
"""
