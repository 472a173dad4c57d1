"""WorkerApp: a generative worker's front process: its gRPC services, registration with peers, /health, /metrics and
the stats line, over the engine process it starts (`engine_link.EngineLink`); it never loads torch.

Lifecycle: start the engine process and wait until it is ready, (decode) register with the listed prefill
workers, serve (a prefill or decode worker may switch roles meanwhile: `role_switch.py`) until SIGTERM/SIGINT, drain (not ready, no new Generate, those in progress finish: `_drain`), then
stop everything. If the engine process dies, the worker reports unhealthy at once, its requests end with an error
(a decode worker's migrate), and the front exits with an error so that its supervisor starts the worker again.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import compat_to_proto, weights_to_proto
from pdserve.services.signals import install_signal_handlers
from pdserve.services.worker.channel.wire import EngineGone, RemoteError
from pdserve.services.worker.front.colocated_wiring import Colocated
from pdserve.services.worker.front.decode_wiring import Decode
from pdserve.services.worker.front.engine_link import EngineLink
from pdserve.services.worker.channel.messages import (CacheChanged, CacheDomain, Load, Metrics, StatsSample,
                                                     TransferHealth)
from pdserve.services.worker.front.kv_events_rpc import KVFeed
from pdserve.services.worker.front.peers import SERVER_OPTIONS, PeerError
from pdserve.services.worker.front.pooling_rpc import PoolingService, engine_encode
from pdserve.services.worker.front.rpc import Calls, Timeouts, WorkerService
from pdserve.services.worker.front.prefill_wiring import Prefill
from pdserve.services.worker.front.prefill_rpc import PrefillGate
from pdserve.services.worker.front.role_switch import RoleSwitch
from pdserve.services.worker.channel.settings import worker_name
from pdserve.services.worker.front.wiring import Wiring
from pdserve.shared.cluster_auth import server_interceptors
from pdserve.shared.compat import Compat, WeightsVersion
from pdserve.shared.config import Role
from pdserve.shared.logs import RequestIdServerInterceptor

log = logging.getLogger("pdserve.worker")


def wiring_for(role: Role) -> Wiring:
    """The front's side of a role: what it serves and how (`wiring.py`)."""
    return {wiring.role: wiring for wiring in (Colocated, Prefill, Decode)}[role]()


class WorkerApp:
    def __init__(self, role: Role, args: argparse.Namespace, model_path: str) -> None:
        self.wiring = wiring_for(role)
        self.timeouts = Timeouts()
        self.args = args
        self.http_port = args.http_port or args.port + 1000
        self.name = worker_name(role.value, args.host, args.port)
        flags = {**vars(args), "model_path": model_path, "worker_name": self.name}
        self.link = EngineLink(role.value, flags, on_exit=self._engine_exited)
        self.kv_feed = KVFeed()  # what its prefix cache holds, for the routers
        self.link.on(CacheChanged, lambda e: self.kv_feed.apply(e.cleared, e.added, e.removed))
        self.link.on(CacheDomain, lambda e: self.kv_feed.set_domain(e.domain))
        self.link.on(TransferHealth, self._transfer_health)
        self.registry = CollectorRegistry()  # the front's own series, beside the engine's
        self.trace_spans_dropped = Counter(
            "pdserve_worker_trace_spans_dropped", "spans the trace collector did not take (unreachable, slow or "
            "refusing): dropped, never retried", ["model_name"], registry=self.registry).labels(
            args.served_model_name or model_path)
        self.model_path = model_path
        self.ready = False
        self.transfer_ok = True
        self.engine_exit: int | None = None
        self._stop: asyncio.Event | None = None

    async def _start_engine(self) -> None:
        """Start the engine process; what the worker tells the gateway (Info) and its peers, from its answer."""
        info = await self.link.start()
        self.compat = Compat(**{**info["compat"], "lora_adapters": tuple(info["compat"]["lora_adapters"])})
        self.weights = WeightsVersion(**info["weights"])
        self.engine_info = info
        self.info = pb.InfoReply(
            role=self.wiring.role.value, model_path=self.model_path,
            served_model_name=self.args.served_model_name or self.model_path,
            compat=compat_to_proto(self.compat), max_total_tokens=info["max_total_tokens"],
            context_length=info["context_length"], max_running_requests=info["max_running_requests"],
            architecture=info["architecture"], model_type=info["model_type"], kernels=info["kernels"],
            lora_enabled=info["lora_enabled"], max_lora_rank=info["max_lora_rank"],
            max_loras_per_batch=info["max_loras_per_batch"], weights=weights_to_proto(self.weights),
            tp_size=info["tp_size"])

    def healthy(self) -> bool:
        """Ready, its engine process alive, and (PD) its KV transfer still able to take pages."""
        return self.ready and self.link.alive and self.transfer_ok

    def _transfer_health(self, event: TransferHealth) -> None:
        self.transfer_ok = event.ok
        log.log(logging.INFO if self.transfer_ok else logging.ERROR, "KV transfer %s",
                "healthy again" if self.transfer_ok else "unhealthy: peers cannot write into this pool")

    def _engine_exited(self, code: int) -> None:
        log.error("the engine process exited (code %s): this worker stops, for its supervisor to start it again",
                  code)
        self.engine_exit = code
        self.ready = False
        if self._stop is not None:
            self._stop.set()

    async def serve(self) -> int:
        self._stop = stop = asyncio.Event()
        install_signal_handlers(stop)
        try:
            await self._start_engine()
        except (ValueError, EngineGone) as exc:
            print(f"error: {exc}", file=sys.stderr)
            await self.link.stop()
            return 1
        server = grpc.aio.server(options=SERVER_OPTIONS,
                                 interceptors=[*server_interceptors(self.args.host), RequestIdServerInterceptor()])
        self.calls = calls = Calls()
        info = self.engine_info
        await self.wiring.serve(self, server, calls)
        if self.wiring.switches_roles:  # the Prefill service, in whichever role it holds now (role_switch.py)
            pb_grpc.add_PrefillServicer_to_server(PrefillGate(lambda: getattr(self.wiring, "service", None)), server)

        def weights_changed(compat: Compat) -> None:
            self.compat = compat
            self.wiring.weights_changed(compat)

        worker = WorkerService(self.link, self.wiring, self.compat, self.info, self.timeouts, is_ready=self.healthy,
                               on_weights=weights_changed, calls=calls, stream_interval=self.args.stream_interval,
                               generates=info["generates"])
        worker.kv_feed = self.kv_feed
        Gauge("pdserve_worker_traced_generations", "traced generations in progress: their spans open",
              ["model_name"], registry=self.registry).labels(self.args.served_model_name or self.model_path
                                                             ).set_function(lambda: len(worker.traced))
        pooling = PoolingService(engine_encode(self.link), self.wiring.refuses_pooling)
        worker.role_switch = RoleSwitch(self, worker, pooling, wiring_for)
        pb_grpc.add_WorkerServicer_to_server(worker, server)
        pb_grpc.add_PoolingServicer_to_server(pooling, server)
        bound = server.add_insecure_port(f"{self.args.host}:{self.args.port}")
        if bound == 0:
            log.error("cannot listen on %s:%s (port in use? pass --port)", self.args.host, self.args.port)
            await self.link.stop()
            return 1
        await server.start()
        http = await self._start_http()
        if http is None:
            await server.stop(0)
            await self.link.stop()
            return 1
        code = 0
        try:
            await self.wiring.start(self)
            self.ready = self.link.alive
            spec = info["speculative_tokens"]
            weights = self.compat.dtype + (f" ({self.args.quantization})" if self.args.quantization else "")
            log.info("%s worker ready: gRPC %s:%d, HTTP %d, engine process %s, %s, kernels %s%s%s%s",
                     self.wiring.role.value, self.args.host, self.args.port, self.http_port, self.link.pid, weights,
                     info["kernels"], f", tensor-parallel over {info['tp_size']} ranks" if info["tp_size"] > 1 else "",
                     f", speculative ngram (up to {spec} draft tokens)" if spec else "",
                     ", overlapped decode steps" if info["overlap"] else "")
            await stop.wait()
            if self.engine_exit is None:
                await self._drain(calls)
        except PeerError as exc:
            log.error("%s", exc)
            code = 1
        finally:
            self.ready = False
            await server.stop(grace=0.5 if self.engine_exit is not None else 2)
            await http.cleanup()
            await self.link.stop()
        return 1 if self.engine_exit is not None else code

    async def _drain(self, calls: Calls) -> None:
        """Report not ready (gRPC Health and HTTP /health) and refuse new Generate calls; let those in progress
        finish for up to --drain-timeout seconds. What is left then is cancelled when the server stops. A decode
worker's generations usually go sooner: the gateway, seeing it drain, has them move live to another decode worker
(Migrate), and the drain then waits only for their KV to be taken (move_rpc.py)."""
        self.ready = False
        calls.draining = True
        if calls.count:
            log.info("stopping: %d sequence(s) in progress may finish within %g s", calls.count,
                     self.args.drain_timeout)
        deadline = time.monotonic() + self.args.drain_timeout
        if not await calls.wait_idle(self.args.drain_timeout):
            log.warning("drain timeout: cancelling %d sequence(s) still in progress", calls.count)
            return
        # Generations frozen for a live move (their streams ended) wait for the decode worker that takes their KV.
        while await self._holds_frozen():
            if time.monotonic() >= deadline:
                log.warning("drain timeout: generations frozen for a live move were not taken: they are dropped")
                return
            await asyncio.sleep(0.05)

    async def _holds_frozen(self) -> bool:
        if not self.wiring.moves_live:
            return False
        try:
            return (await self.link.call(Load(), 5.0))["waiting"] > 0
        except (RemoteError, EngineGone, asyncio.TimeoutError):
            return False

    async def _start_http(self) -> web.AppRunner | None:
        async def health(request: web.Request) -> web.Response:
            ok = self.healthy()
            return web.Response(text="ok" if ok else "starting", status=200 if ok else 503)

        async def metrics(request: web.Request) -> web.Response:
            try:
                engine = await self.link.call(Metrics(), 5.0)
            except (RemoteError, EngineGone, asyncio.TimeoutError):
                engine = b""
            return web.Response(body=engine + generate_latest(self.registry),
                                headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def stats_line(app: web.Application):
            task = asyncio.create_task(StatsLine(self.link, self.args.log_stats_interval).run())
            yield
            task.cancel()

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        if self.args.log_stats_interval > 0:
            app.cleanup_ctx.append(stats_line)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.args.host, self.http_port).start()
        except OSError as exc:
            log.error("cannot listen on %s:%d for HTTP (%s); pass --http-port", self.args.host, self.http_port, exc)
            await runner.cleanup()
            return None
        return runner


class StatsLine:
    """A worker's load, logged every `interval_s` while it has requests or made tokens since the last line (as
    SGLang's batch lines): running and queued requests, KV use, prefill and generation throughput."""

    def __init__(self, link: EngineLink, interval_s: float) -> None:
        self.link = link
        self.interval_s = interval_s
        self._tokens = (0, 0)  # prefill and decode tokens made by the previous line (engine.stats: running totals)
        self._at = time.monotonic()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.tick()

    async def tick(self) -> None:
        try:
            load, prefill, decode, spec = await self.link.call(StatsSample(), self.interval_s)
        except (asyncio.TimeoutError, RemoteError, EngineGone):  # a long step, or the engine stopped: no line now
            return
        now = time.monotonic()
        seconds, made = now - self._at, (prefill - self._tokens[0], decode - self._tokens[1])
        self._tokens, self._at = (prefill, decode), now
        if load["running"] or load["waiting"] or any(made):
            self.log(load, made[0] / seconds, made[1] / seconds, spec)

    @staticmethod
    def log(load: dict[str, int], prefill_per_s: float, gen_per_s: float,
            spec_figures: tuple[float, float] | None = None) -> None:
        total = load["total_pages"]
        usage = (total - load["free_pages"]) / total if total else 0.0
        fields = {"running": load["running"], "queued": load["waiting"], "token_usage": round(usage, 4),
                  "prefill_throughput": round(prefill_per_s, 1), "gen_throughput": round(gen_per_s, 1)}
        spec = ""
        if spec_figures is not None:  # SGLang's wording, where the worker speculates
            fields["accept_length"], fields["accept_rate"] = (round(f, 2) for f in spec_figures)
            spec = f", accept len: {fields['accept_length']:.2f}, accept rate: {fields['accept_rate']:.2f}"
        log.info("#running-req: %d, #queue-req: %d, token usage: %.2f, prefill throughput (token/s): %.1f, "
                 "gen throughput (token/s): %.1f%s", load["running"], load["waiting"], usage, prefill_per_s, gen_per_s,
                 spec, extra=fields)
