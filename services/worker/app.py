"""WorkerApp: wires one Engine to its gRPC services, its KV transfer and its HTTP probes.

Lifecycle: load the model, start the engine thread, (decode) register with the
listed prefill workers, serve until SIGTERM/SIGINT, drain (not ready, no new Generate,
those in progress finish: `_drain`), then stop everything. The periodic stats line
(`StatsLine`) runs with the HTTP side, beside /metrics, which reads the same numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

import grpc
from aiohttp import web

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.services.signals import install_signal_handlers
from pdserve.services.worker.settings import expert_settings, worker_name
from pdserve.services.worker.metrics import WorkerMetrics
from pdserve.proto.codec import compat_to_proto, weights_to_proto
from pdserve.services.worker.peers import SERVER_OPTIONS, PeerError, PrefillPeers
from pdserve.services.worker.pooling import PoolingService
from pdserve.services.worker.prefill_rpc import PrefillService
from pdserve.services.worker.rpc import Calls, WorkerService
from pdserve.shared.addresses import expand_hostports
from pdserve.shared.cluster_auth import server_interceptors
from pdserve.shared.compat import Compat
from pdserve.shared.config import Role, RuntimeConfig
from pdserve.shared.engine import Engine
from pdserve.shared.logs import RequestIdServerInterceptor
from pdserve.shared.compute_thread import ComputeThread
from pdserve.shared.model_runner import ModelRunner
from pdserve.shared.scoring import DecoderPooling

log = logging.getLogger("pdserve.worker")


class WorkerApp:
    def __init__(self, config: RuntimeConfig, role: Role, args: argparse.Namespace) -> None:
        self.config = config
        self.role = role
        self.args = args
        self.http_port = args.http_port or args.port + 1000
        self.name = worker_name(role.value, args.host, args.port)
        self.compute = ComputeThread()  # loads the model, then runs the engine loop: one OpenMP pool
        runner = self.compute.run(lambda: ModelRunner(config))
        self.pooled = None  # a pooling decoder (embedding or classifier): served by Encode, never Generate
        if config.is_embedding or runner.model_config.is_classifier or runner.model_config.is_bare:
            if role != Role.COLOCATED:
                raise ValueError(f"{runner.model_config.architecture} with --is-embedding serves embeddings or "
                                 "scores, which need no prefill/decode split: run it as `pdserve colocated`")
            self.pooled = DecoderPooling.for_model(config.model_path, runner.model_config.is_classifier)
        self.experts = expert_settings(args, f"{role.value}-{args.port}")
        if self.experts.mode is not None and runner.model_config.moe is None:
            raise ValueError(f"--expert-distribution-recorder-mode {self.experts.mode}: the model "
                             f"{runner.model_config.architecture} has no experts (not a Mixture-of-Experts model)")
        self.transfer = None
        backend = "none"
        if role != Role.COLOCATED:
            from pdserve.shared.transfer import available_backends, create_transfer

            backend = args.transfer_backend
            if backend == "auto":
                backend = "nixl" if "nixl" in available_backends() else "tcp"
            kwargs = {}
            if backend == "tcp" and role == Role.DECODE:
                kwargs = {"host": args.host, "port": args.transfer_port or args.port + 2000}
            self.transfer = create_transfer(backend, self.name, runner.pool.buffer, **kwargs)
        transfer_fn = self._write_kv if role == Role.PREFILL else None
        poll_fn = self.transfer.poll if (self.transfer is not None and role == Role.DECODE) else None
        self.metrics = WorkerMetrics(args.served_model_name or config.model_path, role, runner.pool.page_size,
                                     runner.pool.num_pages, runner.lora.pool.num_slots if runner.lora else None)
        self.engine = Engine(config, role, runner, transfer_fn=transfer_fn, poll_fn=poll_fn,
                             observer=self.metrics)
        mc = runner.model_config
        self.compat = Compat(model=mc.identity(), dtype=str(runner.dtype).replace("torch.", ""),
                             page_size=config.cache.page_size, num_layers=mc.num_layers,
                             num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, transfer_backend=backend,
                             lora_adapters=tuple(sorted(f"{a.name}@{a.version}" for a in self.engine.adapters.list())),
                             weights_version=self.engine.weights.version.label,
                             quantization=config.quantization or "")
        self.info = pb.InfoReply(
            role=role.value, model_path=config.model_path,
            served_model_name=args.served_model_name or config.model_path,
            compat=compat_to_proto(self.compat), max_total_tokens=runner.pool.num_pages * runner.pool.page_size,
            context_length=runner.context_length, max_running_requests=config.scheduler.max_running_requests,
            architecture=mc.architecture, model_type=mc.model_type,
            attention_backend=runner.ops.name, lora_enabled=runner.lora is not None,
            max_lora_rank=runner.lora.pool.max_rank if runner.lora else 0,
            max_loras_per_batch=runner.lora.pool.num_slots if runner.lora else 0,
            weights=weights_to_proto(self.engine.weights.version))
        self.peers = PrefillPeers(self.name, self.compat, self.transfer) if role == Role.DECODE else None
        self.ready = False

    def healthy(self) -> bool:
        """Ready, its engine thread alive, and (PD) its KV transfer still able to take pages."""
        return self.ready and self.engine.is_alive() and (self.transfer is None or self.transfer.healthy())

    def _write_kv(self, req) -> float:
        import time

        peer, num_pages = req.transfer.peer_name, len(req.transfer.dst_pages)
        t0 = time.perf_counter()
        try:
            self.transfer.write_pages(peer, req.pages[:num_pages], req.transfer.dst_pages)
        except Exception:
            self.metrics.transfer_failed(peer)
            raise
        seconds = time.perf_counter() - t0
        self.metrics.transferred(peer, num_pages * self.transfer.page_bytes, seconds)
        return seconds

    async def serve(self) -> int:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        self.engine.start(self.compute)
        server = grpc.aio.server(options=SERVER_OPTIONS,
                                 interceptors=[*server_interceptors(self.args.host), RequestIdServerInterceptor()])
        calls = Calls()
        prefill = PrefillService(self.engine, self.compat, self.transfer, calls=calls) \
            if self.role == Role.PREFILL else None

        def weights_changed(compat: Compat) -> None:  # what registration exchanges names the new weights
            self.compat = compat
            if prefill is not None:
                prefill.compat = compat

        pb_grpc.add_WorkerServicer_to_server(
            WorkerService(self.engine, self.role, self.compat, self.info, self.peers,
                          is_ready=self.healthy, experts=self.experts,
                          on_weights=weights_changed, calls=calls, stream_interval=self.args.stream_interval),
            server)
        pb_grpc.add_PoolingServicer_to_server(PoolingService(self.role, engine=self.engine, pooled=self.pooled),
                                              server)
        if prefill is not None:
            pb_grpc.add_PrefillServicer_to_server(prefill, server)
        bound = server.add_insecure_port(f"{self.args.host}:{self.args.port}")
        if bound == 0:
            log.error("cannot listen on %s:%s (port in use? pass --port)", self.args.host, self.args.port)
            self.engine.stop()
            return 1
        await server.start()
        http = await self._start_http()
        if http is None:
            await server.stop(0)
            self.engine.stop()
            return 1
        code = 0
        try:
            if self.role == Role.DECODE and self.args.prefill:
                addrs = [a for spec in self.args.prefill for a in expand_hostports(spec)]
                await self.peers.register_all(addrs, deadline_s=120)
            self.ready = True
            spec = self.config.speculative
            weights = self.info.compat.dtype + (f" ({self.config.quantization})" if self.config.quantization else "")
            log.info("%s worker ready: gRPC %s:%d, HTTP %d, %s, kernels %s%s%s", self.role.value, self.args.host,
                     self.args.port, self.http_port, weights, self.info.attention_backend,
                     f", speculative ngram (up to {spec.num_draft_tokens} draft tokens)"
                     if spec is not None and self.role != Role.PREFILL else "",
                     ", overlapped decode steps" if self.engine.overlap.enabled else "")
            await stop.wait()
            await self._drain(calls)
        except PeerError as exc:
            log.error("%s", exc)
            code = 1
        finally:
            self.ready = False
            await server.stop(grace=2)
            await http.cleanup()
            self.engine.stop()
            if self.transfer is not None:
                self.transfer.close()
        return code

    async def _drain(self, calls: Calls) -> None:
        """Report not ready (gRPC Health and HTTP /health) and refuse new Generate calls; let those in progress
        finish for up to --drain-timeout seconds. What is left then is cancelled when the server stops."""
        self.ready = False
        calls.draining = True
        if calls.count:
            log.info("stopping: %d sequence(s) in progress may finish within %g s", calls.count,
                     self.args.drain_timeout)
        if not await calls.wait_idle(self.args.drain_timeout):
            log.warning("drain timeout: cancelling %d sequence(s) still in progress", calls.count)

    async def _start_http(self) -> web.AppRunner | None:
        async def health(request: web.Request) -> web.Response:
            ok = self.healthy()
            return web.Response(text="ok" if ok else "starting", status=200 if ok else 503)

        async def metrics(request: web.Request) -> web.Response:
            return await self.metrics.scrape(self.engine)

        async def stats_line(app: web.Application):
            task = asyncio.create_task(StatsLine(self.engine, self.args.log_stats_interval).run())
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

    def __init__(self, engine: Engine, interval_s: float) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self._tokens = (0, 0)  # prefill and decode tokens made by the previous line (engine.stats: running totals)
        self._at = time.monotonic()

    def _sample(self):  # on the engine thread
        spec = self.engine.speculator
        return (self.engine.load(), self.engine.stats.prefill_tokens, self.engine.stats.decode_tokens,
                spec.figures() if spec is not None else None)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.tick()

    async def tick(self) -> None:
        try:
            load, prefill, decode, spec = await asyncio.wait_for(asyncio.wrap_future(self.engine.call(self._sample)),
                                                           self.interval_s)
        except asyncio.TimeoutError:  # a long step, or the engine stopped: no line this time
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
