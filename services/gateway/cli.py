"""`pdserve gateway`: the HTTP front end (OpenAI-compatible and native APIs) over runtime workers."""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from pdserve.services.gateway import limits as request_limits
from pdserve.services.gateway import planner
from pdserve.services.gateway.cpu_pool import DEFAULT_DEADLINE_S, DEFAULT_QUEUE, CpuPool
from pdserve.services.gateway.intake.reasoning import PARSERS
from pdserve.services.gateway.intake.tool_parsers import PARSERS as TOOL_PARSERS
from pdserve.services.gateway.workers.router import POLICIES
from pdserve.services.tracing import (add_trace_flags, on_content_dropped, on_dropped, setup_tracing,
                                      shutdown_tracing)
from pdserve.shared.logs import add_log_arguments, setup_logging

if TYPE_CHECKING:
    from pdserve.services.gateway.siblings import Siblings

log = logging.getLogger("pdserve.gateway")


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--model-path", default=None,
                        help="HF directory or .gguf file; its tokenizer and chat template are used "
                             "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--tokenizer-path", default=None, help="tokenizer directory (default: the model's)")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: --model-path)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all interfaces)")
    parser.add_argument("--port", type=int, default=30000, help="HTTP port")
    parser.add_argument("--worker", action="append", default=[], metavar="HOST:PORT",
                        help="colocated worker (repeatable; a DNS name may resolve to several)")
    parser.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                        help="prefill worker (repeatable; a DNS name may resolve to several)")
    parser.add_argument("--decode", action="append", default=[], metavar="HOST:PORT",
                        help="decode worker (repeatable; a DNS name may resolve to several)")
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY") or None,
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $PDSERVE_API_KEY)")
    parser.add_argument("--admin-api-key", default=os.environ.get("PDSERVE_ADMIN_API_KEY") or None,
                        help="the key the admin routes need (weights, adapters, cache flush, abort, expert "
                             "recording); the API key is refused there (default: $PDSERVE_ADMIN_API_KEY)")
    parser.add_argument("--admin-api-key-file", default=None, metavar="FILE",
                        help="read the admin key from FILE, so that it appears on no command line")
    parser.add_argument("--open-admin-routes", action="store_true",
                        help="without an admin key, let the admin routes take the API key (or none), as before "
                             "admin keys existed; by default they are refused (403) until one is set")
    parser.add_argument("--max-queued-requests", type=int, default=256,
                        help="sequences (a request counts n) that may wait for a place on the workers beyond what "
                             "they run at once; more are refused at once with 429 and Retry-After. With "
                             "--gateway-workers N, each process admits 1/N of what the workers run plus this "
                             "(at least one sequence), so the limit holds for the gateway as a whole")
    parser.add_argument("--gateway-workers", type=int, default=1, metavar="N",
                        help="gateway processes serving --port together (SO_REUSEPORT: the kernel spreads "
                             "connections over them), for when one process's CPU is the bottleneck; without "
                             "--redis-url the first process keeps the stored /v1/responses for all of them")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, refuse new requests (503) and let those in progress finish for up to "
                             "this long; streams still running then end with an error")
    parser.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template to use instead "
                        "of the model's")
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(PARSERS),
                        help="split <think> reasoning into message.reasoning_content")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="read tool calls out of the model's output (tool_choice auto) in this model family's "
                             "format: qwen25/qwen (Qwen2.5, Qwen3), llama3 (Llama 3 JSON), pythonic (Llama 3.2+, 4)")
    parser.add_argument("--enable-cache-report", action="store_true",
                        help="report cached prompt tokens in every response (usage.prompt_tokens_details, Responses' "
                             "input_tokens_details, Messages' cache_read_input_tokens); without it none is told "
                             "(0 where the API's shape needs the field), as SGLang: they tell one client what "
                             "another's prompts hold")
    parser.add_argument("--routing-policy", default="cache_aware", choices=POLICIES)
    parser.add_argument("--rebalance-decode", action="store_true",
                        help="move running generations live (with their KV) from a decode worker whose pool is "
                             "much fuller than another's; its decisions are counted in "
                             "pdserve_gateway_rebalance_decisions")
    parser.add_argument("--jobs-url", default=None, help="jobs service that /v1/files and /v1/batches go to")
    parser.add_argument("--redis-url", default=os.environ.get("PDSERVE_REDIS_URL") or None,
                        help="Redis that keeps /v1/responses stored responses, shared by every gateway replica and "
                             "kept across restarts (default: $PDSERVE_REDIS_URL; without one they are kept in this "
                             "gateway's memory); give a URL with a password in the variable: a flag shows in `ps`")
    parser.add_argument("--responses-ttl", type=float, default=7 * 24 * 3600, metavar="SECONDS",
                        help="stored responses expire this long after their last change (default: 7 days)")
    parser.add_argument("--responses-incomplete-status", action="store_true",
                        help="a /v1/responses response cut by max_output_tokens ends with status 'incomplete' and "
                             "a response.incomplete event, as OpenAI's API does (default: 'completed' and "
                             "response.completed, as SGLang does, which the openai SDK's responses.stream() needs)")
    parser.add_argument("--health-check-interval", type=float, default=1.0, help="seconds between worker checks")
    parser.add_argument("--embedding-model", default=os.environ.get("PDSERVE_EMBEDDING_MODEL") or None,
                        metavar="PATH",
                        help="also serve this embedding or cross-encoder model on its own workers "
                             "(--embedding-worker); requests pick it by their 'model' (default: "
                             "$PDSERVE_EMBEDDING_MODEL)")
    parser.add_argument("--embedding-worker", action="append", metavar="HOST:PORT",
                        default=os.environ.get("PDSERVE_EMBEDDING_WORKER", "").replace(",", " ").split(),
                        help="worker serving --embedding-model (repeatable; a DNS name may resolve to several); "
                             "added to those in $PDSERVE_EMBEDDING_WORKER (space- or comma-separated)")
    parser.add_argument("--embedding-served-model-name", default=None,
                        help="name clients use for --embedding-model (default: the path as given)")
    parser.add_argument("--is-embedding", action="store_true",
                        help="the model is served for embeddings (/v1/embeddings, /encode), as its workers are "
                             "(`colocated --is-embedding`); encoders and sequence classifiers are recognised alone")
    parser.add_argument("--inflate-request-bodies", action="store_true",
                        help="take request bodies sent with Content-Encoding gzip or deflate, inflated as they "
                             "arrive and refused (413) once past --max-body-bytes or --max-inflation-ratio; by "
                             "default such a body is a 415, as SGLang and vLLM inflate none")
    parser.add_argument("--cpu-pool-queue", type=int, default=DEFAULT_QUEUE, metavar="N",
                        help="large inputs (bodies of 64 KiB or more, prompts of 8k characters or more) and "
                             "answers are worked on by the gateway's CPU pool; this many may wait beyond those "
                             "it runs, more are refused at once with 429 and Retry-After "
                             f"(default: {DEFAULT_QUEUE})")
    parser.add_argument("--cpu-pool-deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                        help="a request whose work on the CPU pool (queue wait included) is not done within this "
                             "is answered 503 with Retry-After, and its work stopped where it can be "
                             f"(default: {DEFAULT_DEADLINE_S:g})")
    request_limits.add_arguments(parser)
    planner.add_arguments(parser)
    add_log_arguments(parser)
    add_trace_flags(parser)
    parser.add_argument("--log-requests", action="store_true",
                        help="log each request's body (at debug level, under pdserve.requests, whatever "
                             "--log-level says); headers, and so the API key, never")


def main(args: argparse.Namespace, command: str) -> int:
    setup_logging(args.log_level, args.log_format == "json")
    problem = check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.gateway_workers > 1:
        from pdserve.services.gateway.processes import supervise

        return supervise(args, serve_process)
    _exit(run(args))


def check(args: argparse.Namespace) -> str | None:
    """What makes these flags unusable, before anything starts (None: nothing)."""
    if args.max_queued_requests < 0 or args.drain_timeout < 0:
        return "--max-queued-requests and --drain-timeout must be >= 0"
    if args.gateway_workers < 1:
        return "--gateway-workers must be >= 1"
    if args.cpu_pool_queue < 0 or args.cpu_pool_deadline <= 0:
        return "--cpu-pool-queue must be >= 0 and --cpu-pool-deadline > 0"
    try:
        planner.from_args(args)
    except ValueError as exc:
        return str(exc)
    return None


def serve_process(args: argparse.Namespace, index: int, directory: str) -> None:
    """One of the --gateway-workers processes (started by processes.supervise, which passes SIGINT on as
    SIGTERM: a Ctrl-C reaching the whole process group must not break a start-up half-way)."""
    from pdserve.services.gateway import processes
    from pdserve.services.gateway.siblings import Siblings

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(args.log_level, args.log_format == "json", with_pid=True)
    parent, alive = os.getppid(), processes.join(directory)
    try:
        code = run(args, f"gateway process {index} of {args.gateway_workers}",
                   Siblings(directory, index, args.gateway_workers))
    finally:
        processes.leave(directory, alive, orphaned=os.getppid() != parent)
    _exit(code)


def run(args: argparse.Namespace, name: str = "gateway", siblings: Siblings | None = None) -> int:
    """Build the app and serve it until SIGTERM; the exit status. `name`: the process, in its start log;
    `siblings`: the gateway's other processes."""
    if args.log_requests:
        logging.getLogger("pdserve.requests").setLevel(logging.DEBUG)
    _map_large_allocations()
    try:
        app = build(args, siblings)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if setup_tracing(args, "pdserve-gateway"):
        from pdserve.services.gateway.apis.context import GATEWAY

        on_dropped(app[GATEWAY].backend.metrics.trace_spans_dropped.inc)
        on_content_dropped(app[GATEWAY].backend.metrics.trace_content_dropped.inc)
    try:
        return asyncio.run(_serve(app, args, name))
    finally:
        shutdown_tracing()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _map_large_allocations() -> None:
    """Allocations of 1 MiB or more (request bodies, their decoded lists) get pages of their own, returned to the
    system when freed. glibc's default raises that threshold as large blocks are freed, up to 32 MiB, and keeps
    what is freed in its heaps: eight 31 MiB bodies refused on the CPU pool left the gateway 128-310 MB larger for
    good. Not glibc: nothing to do."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def _exit(code: int) -> None:
    # Everything is closed by now: skip the interpreter's teardown of the modules loaded (torch among them),
    # 1-2 s that would hold up a drained gateway's exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def read_key_file(path: str, flag: str) -> str:
    try:
        key = open(path, encoding="utf-8").read().strip()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if not key:
        raise ValueError(f"{flag}: {path} is empty")
    return key


def build(args: argparse.Namespace, siblings: Siblings | None = None):
    """The aiohttp app for these arguments (loads the tokenizer; workers are contacted when it starts), one of
    several processes of the gateway with `siblings`."""
    from pdserve.services.gateway.apis.context import Gateway
    from pdserve.services.gateway.app import create_app
    from pdserve.services.gateway.metrics import GatewayMetrics
    from pdserve.services.gateway.tokenization import ModelTokenizer, read_model_config
    from pdserve.services.gateway.workers.backend import Backend, BackendSettings
    from pdserve.services.gateway.workers.pool import HealthSettings, WorkerPool
    from pdserve.services.gateway.workers.router import Router
    from pdserve.shared.model_files import DEFAULT_MODEL_NAME, resolve_model_path

    limits = request_limits.from_args(args)
    model_dir = resolve_model_path(args.model_path, quiet=True)
    given = args.model_path if args.model_path not in (None, "", "default") else DEFAULT_MODEL_NAME
    tokenizer_dir = args.tokenizer_path or str(model_dir)
    tokenizer = ModelTokenizer(tokenizer_dir, args.chat_template)
    config = read_model_config(model_dir)
    pool = WorkerPool({"colocated": args.worker, "prefill": args.prefill, "decode": args.decode},
                      HealthSettings(interval_s=args.health_check_interval))
    processes = args.gateway_workers
    backend = Backend(tokenizer, pool, Router(pool, args.routing_policy), GatewayMetrics(multiprocess=processes > 1),
                      BackendSettings(max_queued_requests=args.max_queued_requests, processes=processes,
                                      rebalance_decode=args.rebalance_decode),
                      default_context_length=config.max_position_embeddings)
    served = args.served_model_name or given
    # One model per gateway: "default" always names it, as in SGLang's examples and clients written for them.
    names = {served, given, str(model_dir), model_dir.name, "default"}
    admin_key = args.admin_api_key
    if args.admin_api_key_file:
        admin_key = read_key_file(args.admin_api_key_file, "--admin-api-key-file")
    public_args = {**{k: v for k, v in vars(args).items() if k not in ("api_key", "admin_api_key", "command")},
                   "model_path": given, "tokenizer_path": args.tokenizer_path or given, "served_model_name": served,
                   "api_key_required": bool(args.api_key)}
    gateway = Gateway(backend=backend, tokenizer=tokenizer, served_model_name=served, model_path=given,
                      tokenizer_path=args.tokenizer_path or given, model_config=config,
                      reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                      enable_cache_report=args.enable_cache_report,
                      api_key=args.api_key or None, admin_api_key=admin_key or None,
                      open_admin_routes=args.open_admin_routes, jobs_url=args.jobs_url, server_args=public_args,
                      accepted_model_names=frozenset(names), strict_model_name=bool(args.served_model_name),
                      is_embedding=args.is_embedding, limits=limits,
                      inflate_bodies=args.inflate_request_bodies,
                      responses_incomplete_status=args.responses_incomplete_status,
                      cpu=CpuPool(queue=args.cpu_pool_queue, deadline_s=args.cpu_pool_deadline))
    settings = planner.from_args(args)
    if settings is not None and (siblings is None or siblings.index == 1):  # one planner per gateway
        from pdserve.services.gateway.workers.planning import PlannerLoop

        gateway.planner = PlannerLoop(settings, pool, backend.metrics)
    from pdserve.services.gateway.apis.served_models import build_embedding_gateway

    extra = build_embedding_gateway(args, gateway)
    from pdserve.services.gateway.apis.responses.store import open_store

    if args.responses_ttl <= 0:
        raise ValueError("--responses-ttl must be > 0")
    return create_app(gateway, [extra] if extra else [], open_store(args.redis_url, args.responses_ttl, siblings),
                      siblings)


async def _serve(app, args: argparse.Namespace, name: str) -> int:
    from pdserve.services.gateway.app import serve
    from pdserve.services.gateway.processes import watch_parent

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    shared = args.gateway_workers > 1
    watcher = asyncio.create_task(watch_parent(stop)) if shared else None
    try:
        await serve(app, args.host, args.port, stop, args.drain_timeout, reuse_port=shared, name=name)
    except OSError as exc:
        log.error("cannot listen on %s:%d (%s); pass --port", args.host, args.port, exc)
        return 1
    finally:
        if watcher is not None:
            watcher.cancel()
    return 0
