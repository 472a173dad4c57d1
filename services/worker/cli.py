"""`pdserve colocated|prefill|decode`: one runtime worker serving gRPC, plus /health and /metrics over HTTP."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from pdserve.services.worker.channel.settings import (add_expert_arguments, add_lora_arguments,
                                                      add_speculative_arguments, add_tp_arguments, positive_int,
                                                      runtime_config, serve_node, set_torch_threads, tp_nodes)
from pdserve.services.worker.channel.tier_flags import add_tier_arguments
from pdserve.shared.config import ENCODER_MODEL_TYPES, CacheConfig, Role, RuntimeConfig, SchedulerConfig
from pdserve.shared.logs import add_log_arguments, setup_logging
from pdserve.services.tracing import add_trace_flags, on_dropped, setup_tracing, shutdown_tracing

DEFAULT_PORTS = {"colocated": 50051, "prefill": 50051, "decode": 50052}
log = logging.getLogger("pdserve.worker")


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    cache, sched = CacheConfig(), SchedulerConfig()
    parser.add_argument("--model-path", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--served-model-name", default=None, help="model name reported to clients")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve gRPC and HTTP on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORTS[command], help="gRPC port")
    parser.add_argument("--http-port", type=int, default=None, help="HTTP port for /health and /metrics (default: port + 1000)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    # One flag picks the whole kernel set (attention, norm, rotary, activation, MoE, LoRA), not only attention:
    # --kernels says so; --attention-backend is SGLang's name for it, kept as an alias.
    parser.add_argument("--kernels", "--attention-backend", dest="kernels", default="auto",
                        choices=["auto", "native", "torch", "triton"],
                        help="the kernel set every layer runs on: triton (default on CUDA), native C++ (default on "
                             "CPU) or the plain-torch twins; --attention-backend is an alias (SGLang's name)")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="greedy output and seeded samples bit-identical for a prompt whatever it is batched, "
                             "cached or chunked with (CPU, native kernels; checked at start on this machine)")
    # SGLang's flag for what is always so here: the LM head's logits stay fp32 from its fp32 sums (on a CPU its
    # fixed-order kernel is as fast as the bf16 one), so sampling never sees a logit rounded to bf16.
    parser.add_argument("--enable-fp32-lm-head", action="store_true",
                        help="accepted for SGLang's command lines: logits are always fp32 here")
    parser.add_argument("--stream-interval", type=positive_int, default=1, metavar="TOKENS",
                        help="tokens a request's stream gathers before a message is sent (SGLang's); a stream that "
                             "falls behind sends what it has in one message whatever this is")
    parser.add_argument("--disable-cuda-graph", action="store_true",
                        help="run every decode step as it comes, without captured CUDA graphs (GPU)")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="read each decode step's tokens before the next step is scheduled (GPU; by default the "
                             "next step is launched first, so the host's work hides behind the device's)")
    parser.add_argument("--enable-overlap-schedule", action="store_true",
                        help="launch each decode step before the previous one's tokens are read on a CPU too, where "
                             "it only delays each token by a step: the GPU's order, for checking it on a CPU")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=RuntimeConfig.cuda_graph_max_bs,
                        help="largest decode batch captured as a CUDA graph; larger ones run without")
    parser.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None, metavar="N",
                        help="the decode batch sizes to capture (default: 1, 2, 4, 8, then steps of 8, 16 and 32 "
                             "up to --cuda-graph-max-bs)")
    parser.add_argument("--context-length", type=int, default=None, help="longest sequence (default: the model's)")
    parser.add_argument("--page-size", type=int, default=cache.page_size, help="tokens per KV page")
    parser.add_argument("--max-total-tokens", type=int, default=cache.max_total_tokens, help="KV pool capacity in tokens")
    parser.add_argument("--mem-fraction", "--mem-fraction-static", type=float, default=None,
                        help="size the KV pool to this fraction of the memory free after loading the weights "
                             "(overrides --max-total-tokens)")
    parser.add_argument("--max-running-requests", type=int, default=sched.max_running_requests)
    parser.add_argument("--max-prefill-tokens", type=int, default=sched.max_prefill_tokens,
                        help="new prompt tokens per prefill batch")
    parser.add_argument("--chunked-prefill-size", type=int, default=sched.chunked_prefill_size,
                        help="longest prompt chunk per step; <= 0 disables chunking")
    parser.add_argument("--schedule-policy", default=sched.policy, choices=["fcfs", "lpm"])
    parser.add_argument("--enable-mixed-chunk", action="store_true",
                        help="colocated: prefill new prompts in the same steps that decode running requests")
    parser.add_argument("--quantization", default=None, choices=["w8a8_int8", "gguf"],
                        help="w8a8_int8: run the layers' matmuls in int8: weights per output channel, activations "
                             "per token (decoders: attention, dense MLPs and the LM head, while MoE experts stay in "
                             "--dtype; encoders: fp32 models, smoothed); gguf: a .gguf --model-path's matrices kept as "
                             "its Q4_0, Q4_1 or Q8_0 blocks")
    add_lora_arguments(parser)
    add_expert_arguments(parser)
    add_tp_arguments(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch compute threads (default: all cores; with --tp-size on a CPU: per rank, at most "
                             "the cores of the rank, default all of them)")
    parser.add_argument("--random-seed", type=int, default=None,
                        help="seed of the generator that requests without a seed of their own sample from "
                             "(default: random)")
    add_log_arguments(parser)
    add_trace_flags(parser)
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM, how long the requests in progress may take to finish before they are "
                             "cancelled (new ones are refused at once)")
    parser.add_argument("--log-stats-interval", type=float, default=10.0, metavar="SECONDS",
                        help="log running and queued requests, KV use and throughput this often while busy "
                             "(0: never)")
    if command in ("prefill", "decode"):
        parser.add_argument("--transfer-backend", default="auto", choices=["auto", "nixl", "tcp"],
                            help="how KV pages move between workers (auto: nixl when installed, else tcp)")
        parser.add_argument("--transfer-port", type=int, default=None,
                            help="tcp backend: port the decode worker receives KV on (default: port + 2000)")
    if command == "colocated":
        parser.add_argument("--is-embedding", action="store_true",
                            help="serve an embedding or cross-encoder model (/v1/embeddings, /encode): an encoder "
                                 "(BERT family; chosen by itself for those) or a decoder whose last token's hidden "
                                 "state is the embedding (gte-Qwen2 style); sequence classifiers (reward models) "
                                 "are pooling models by themselves")
    if command in ("colocated", "decode"):
        add_speculative_arguments(parser)
    # Every generative role: decode computes a conversation's next turn itself after the prefix its cache holds
    # (--local-prefill-max-tokens), and reads that prefix from the tier once its pool has evicted it.
    add_tier_arguments(parser)
    if command == "decode":
        parser.add_argument("--local-prefill-max-tokens", type=int, default=sched.local_prefill_max_tokens,
                            metavar="TOKENS", help="compute a prompt here, not on a prefill worker, when this "
                            "worker's prefix cache holds all of it but at most this many tokens (a conversation's "
                            "next turn); 0: never")
        parser.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT",
                            help="prefill worker to register with at start-up (repeatable; DNS names may resolve to several)")


def main(args: argparse.Namespace, command: str) -> int:
    setup_logging(args.log_level, args.log_format == "json")
    from pdserve.shared.model_files import ModelNotFound, resolve_model_path

    try:
        model_path = str(resolve_model_path(args.model_path))
        config = runtime_config(args, model_path)
        nodes = tp_nodes(args)
    except (ModelNotFound, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if command == "colocated" and is_encoder_checkpoint(model_path):
        if args.tp_size != 1:
            print(f"error: --tp-size {args.tp_size}: an encoder model (BERT family) runs in one process",
                  file=sys.stderr)
            return 1
        return _serve_encoder(config, args)
    if config.tiers is not None and config.tiers.storage_dir is not None:  # before the engine process loads the model
        from pdserve.shared.kv_files import KVFiles

        try:
            KVFiles.check_directory(config.tiers.storage_dir)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if nodes is not None and nodes.rank > 0:  # this machine's ranks only: node 0 runs the worker's endpoints
        try:
            from pdserve.services.worker.engine.engine_process import engine_role  # this node computes: torch is fine

            return serve_node(args, config, Role(command), engine_role(Role(command)).transfer_spec)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    # A generative worker's front: gRPC and HTTP here, the model in the engine process it starts (no torch here).
    from pdserve.services.worker.front.app import WorkerApp

    app = WorkerApp(Role(command), args, model_path)
    if setup_tracing(args, f"pdserve-{command}"):
        on_dropped(app.trace_spans_dropped.inc)
    try:
        return asyncio.run(app.serve())
    finally:
        shutdown_tracing()


def _serve_encoder(config: RuntimeConfig, args: argparse.Namespace) -> int:
    """An encoder model (BERT family): one process, the Encoder batching in a thread of its own."""
    import torch

    set_torch_threads(args)
    from pdserve.services.worker.encoder_app import EncoderWorkerApp

    try:
        app = EncoderWorkerApp(config, args)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    if setup_tracing(args, "pdserve-colocated"):
        on_dropped(app.metrics.trace_spans_dropped.inc)
    try:
        return asyncio.run(app.serve())
    finally:
        shutdown_tracing()


def is_encoder_checkpoint(model_path: str) -> bool:
    """Encoder-only checkpoints (BERT family) run on the Encoder, never on the paged decoder runtime."""
    import json
    from pathlib import Path

    try:
        return json.loads((Path(model_path) / "config.json").read_text()).get("model_type") in ENCODER_MODEL_TYPES
    except (OSError, ValueError):
        return False
