"""EncoderWorkerApp: a worker serving an encoder model (`pdserve colocated --is-embedding`).

Lifecycle: load the model into an Encoder, start its thread, serve the Worker service (health, info and
load for the gateway's pool; Generate is refused) and the Pooling service over gRPC, plus /health and /metrics
over HTTP, until SIGTERM/SIGINT.
"""
from __future__ import annotations

import argparse
import asyncio
import logging

import grpc
from aiohttp import web

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.services.signals import install_signal_handlers
from pdserve.services.worker.encoder_metrics import EncoderMetrics
from pdserve.services.worker.front.peers import GRPC_OPTIONS
from pdserve.services.worker.channel.wire import RemoteError, error_kind
from pdserve.services.worker.front.pooling_rpc import PoolingService
from pdserve.shared.cluster_auth import server_interceptors
from pdserve.shared.config import Role, RuntimeConfig
from pdserve.shared.encoder import Encoder

log = logging.getLogger("pdserve.worker")


class EncoderWorkerService(pb_grpc.WorkerServicer):
    """What the gateway's worker pool asks every worker, answered for a model without a KV cache."""

    def __init__(self, encoder: Encoder, info: pb.InfoReply, is_ready) -> None:
        self.encoder = encoder
        self.info = info
        self.is_ready = is_ready

    async def Generate(self, request, context):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"this worker serves the embedding model {self.info.served_model_name!r}: it does not "
                            "generate text")
        yield pb.GenerateResponse()  # never reached; makes this a streaming handler

    async def Abort(self, request, context):
        return pb.AbortReply(found=False)  # requests are not tracked by id: each is one short forward

    async def Health(self, request, context):
        return pb.HealthReply(ok=self.is_ready(), role=Role.COLOCATED.value)

    async def Info(self, request, context):
        return self.info

    async def Load(self, request, context):
        return pb.LoadReply(running=self.encoder.running, waiting=self.encoder.waiting)

    async def FlushCache(self, request, context):
        return pb.FlushReply(ok=True, message="an encoder keeps no cache")

    async def Stats(self, request, context):
        return pb.PoolStats(integrity_ok=True, integrity_message="an encoder keeps no KV pages")

    async def SwitchRole(self, request, context):
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "embedding_worker: an embedding or scoring model "
                                                                 "has no prefill or decode role")


class EncoderWorkerApp:
    def __init__(self, config: RuntimeConfig, args: argparse.Namespace) -> None:
        if config.tiers is not None:
            raise ValueError("--enable-hierarchical-cache does not apply to an embedding worker: an encoder keeps "
                             "no KV cache between requests")
        import torch

        dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)  # auto: the checkpoint's
        self.args = args
        self.http_port = args.http_port or args.port + 1000
        self.encoder = Encoder(config.model_path, dtype, config.device, config.context_length,
                               max_batch_tokens=config.scheduler.max_prefill_tokens,
                               quantization=getattr(args, "quantization", None))
        self.metrics = EncoderMetrics(args.served_model_name or config.model_path)
        self.encoder.observer = self.metrics
        cfg = self.encoder.config
        self.info = pb.InfoReply(
            role=Role.COLOCATED.value, model_path=config.model_path,
            served_model_name=args.served_model_name or config.model_path,
            compat=pb.Compat(model=cfg.architecture, dtype=str(self.encoder.dtype).replace("torch.", "")),
            context_length=self.encoder.context_length,
            max_running_requests=config.scheduler.max_running_requests, architecture=cfg.architecture,
            model_type=cfg.model_type, kernels="torch")
        self.ready = False

    async def _encode(self, seqs: list[list[int]], types: list[list[int]] | None, labels: list[int],
                      timeout_s: float = 120.0) -> dict:
        """Queued on the Encoder, batched with whatever else is queued; failures by kind (wire.error_kind)."""
        try:
            if labels:
                raise ValueError("this worker serves an embedding model: scoring label tokens needs a generative "
                                 "model")
            vectors = await asyncio.wait_for(asyncio.wrap_future(self.encoder.submit(seqs, types)), timeout_s)
        except (ValueError, RuntimeError) as exc:
            raise RemoteError(error_kind(exc), str(exc)) from None
        return {"vectors": vectors, "prompt_tokens": sum(len(s) for s in seqs), "cached_tokens": 0}

    async def serve(self) -> int:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        self.encoder.start()
        is_ready = lambda: self.ready and self.encoder.is_alive()  # noqa: E731
        server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=server_interceptors(self.args.host))
        pb_grpc.add_WorkerServicer_to_server(EncoderWorkerService(self.encoder, self.info, is_ready), server)
        pb_grpc.add_PoolingServicer_to_server(PoolingService(self._encode), server)
        if server.add_insecure_port(f"{self.args.host}:{self.args.port}") == 0:
            log.error("cannot listen on %s:%s (port in use? pass --port)", self.args.host, self.args.port)
            self.encoder.stop()
            return 1
        await server.start()
        app = web.Application()

        async def health(request: web.Request) -> web.Response:
            ok = is_ready()
            return web.Response(text="ok" if ok else "starting", status=200 if ok else 503)

        async def metrics(request: web.Request) -> web.Response:
            return self.metrics.scrape(self.encoder)

        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.args.host, self.http_port).start()
            self.ready = True
            enc = self.encoder
            how = f" ({enc.quantization})" if enc.quantization else ""
            if enc.matmul_dtype != enc.dtype:
                how += f" (matmuls {str(enc.matmul_dtype).removeprefix('torch.')})"
            log.info("embedding worker ready: gRPC %s:%d, HTTP %d, %s %s%s", self.args.host, self.args.port,
                     self.http_port, self.info.architecture, self.info.compat.dtype, how)
            await stop.wait()
        except OSError as exc:
            log.error("cannot listen on %s:%d for HTTP (%s); pass --http-port", self.args.host, self.http_port, exc)
            return 1
        finally:
            self.ready = False
            await server.stop(grace=2)
            await runner.cleanup()
            self.encoder.stop()
        return 0
