"""What a worker is started with, read by both its front and its engine process: the flags beyond the plain
ones (speculative decoding, LoRA, expert recording, tensor parallelism), the runtime config the engine builds
from them, the worker's name, and the TP ranks' start. `cli` parses the flags; nothing here imports it back."""
from __future__ import annotations

import argparse
import os
import socket
import uuid

from pathlib import Path

from pdserve.services.worker.channel.tier_flags import tier_config
from pdserve.shared.config import CacheConfig, LoraConfig, Role, RuntimeConfig, SchedulerConfig, SpeculativeConfig
from pdserve.shared.expert_recorder import MODES as EXPERT_RECORD_MODES
from pdserve.shared.expert_recorder import RecordSettings


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def worker_name(role: str, host: str, port: int) -> str:
    return f"{role}-{socket.gethostname()}-{host}:{port}-{uuid.uuid4().hex[:6]}-{os.getpid()}"


def add_expert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--expert-distribution-recorder-mode", default=None, choices=EXPERT_RECORD_MODES,
                        help="MoE models: let /start_expert_distribution_record count how often each layer picks "
                             "each expert (stat: totals per layer and expert); unset, those endpoints are refused")
    parser.add_argument("--expert-distribution-recorder-dir",
                        default=os.environ.get("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR") or "/tmp",
                        help="where /dump_expert_distribution_record writes its .pt files "
                             "(default: $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR, else /tmp)")


def expert_settings(args: argparse.Namespace, tag: str) -> RecordSettings:
    return RecordSettings(args.expert_distribution_recorder_mode, args.expert_distribution_recorder_dir, tag)


def add_tp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1, metavar="N",
                        help="split the model over N ranks, one process each (on a CPU each on its own cores, on "
                             "GPUs each on its own device); the worker keeps one endpoint")
    parser.add_argument("--cpu-binding", default=None, metavar="CORES|CORES",
                        help="--tp-size on a CPU: each rank's cores, '|' between ranks (e.g. 0-3|4-7); default: a "
                             "NUMA node per rank where there are enough, else the cores split evenly")
    parser.add_argument("--base-gpu-id", type=int, default=0, help="--tp-size on GPUs: rank r runs on GPU base + r")
    parser.add_argument("--dist-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="--tp-size: how long a rank waits for the others inside a step before the worker "
                             "gives up on them and stops (a rank that died is noticed at once); across nodes also "
                             "how long a node may stay silent")
    parser.add_argument("--nnodes", type=int, default=1, metavar="K",
                        help="--tp-size over K machines, --tp-size / K ranks each (SGLang's flag); node 0 runs the "
                             "worker's endpoint, every other node only its ranks")
    parser.add_argument("--node-rank", type=int, default=0, metavar="R",
                        help="--nnodes: this machine's node, 0 to K-1; node R runs ranks R*N/K to (R+1)*N/K-1")
    parser.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                        help="--nnodes: where the ranks meet: node 0's address and a free port there (default: "
                             "$MASTER_ADDR:$MASTER_PORT)")


def tp_nodes(args: argparse.Namespace):
    """The machines the worker's ranks span (None: one machine); a ValueError names the numbers of flags that
    cannot go together. The worker's front calls it before anything starts."""
    from pdserve.shared.tp_nodes import plan_nodes

    return plan_nodes(getattr(args, "tp_size", 1), getattr(args, "nnodes", 1), getattr(args, "node_rank", 0),
                      getattr(args, "dist_init_addr", None))


def tp_launch(args: argparse.Namespace, config, transfer):
    """How this machine's ranks start (None for --tp-size 1); the checks a split must pass, before any starts.
    `transfer`: how each rank makes its KV transfer agent (the role's `transfer_spec`; None: none)."""
    size = getattr(args, "tp_size", 1)
    if size == 1:
        return None
    from pdserve.shared.config import ModelConfig
    from pdserve.shared.tp_ranks import Launch, cpu_sets
    from pdserve.shared.tp_shards import check_tp_size

    if args.dist_timeout <= 0:
        raise ValueError(f"--dist-timeout must be positive, got {args.dist_timeout}")
    nodes = tp_nodes(args)
    check_tp_size(ModelConfig.from_dir(config.model_path), size)
    here = size if nodes is None else nodes.per_node
    cpus = [] if config.device.startswith("cuda") else cpu_sets(here, args.cpu_binding)
    return Launch(size, cpus, args.dist_timeout, args.base_gpu_id, transfer=transfer,
                  threads=args.threads, nodes=nodes)


def tp_ranks(args: argparse.Namespace, config, transfer):
    """The other ranks of a tensor-parallel worker, started (None for --tp-size 1). Call it before the thread
    that will step exists: on a CPU it takes rank 0's cores, and the threads started after it inherit them."""
    launch = tp_launch(args, config, transfer)
    if launch is None:
        return None
    from pdserve.shared.tp_ranks import Ranks

    return Ranks(config, launch)


def serve_node(args: argparse.Namespace, config, role: Role, transfer_spec) -> int:
    """A node other than 0 of a worker over several machines: its ranks only, until the group is gone.
    `transfer_spec(args)`: the role's KV transfer agent."""
    args.worker_name = worker_name(role.value, args.host, args.port)  # its ranks' KV agents are named after it
    launch = tp_launch(args, config, transfer_spec(args))
    from pdserve.shared.tp_remote import serve_node as serve

    return serve(config, launch)


def transfer_backend(args: argparse.Namespace) -> str:
    """The KV transfer backend of a prefill or decode worker (auto: nixl when installed, else tcp)."""
    from pdserve.shared.transfer import available_backends

    backend = args.transfer_backend
    if backend == "auto":
        backend = "nixl" if "nixl" in available_backends() else "tcp"
    return backend


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    spec = SpeculativeConfig()
    parser.add_argument("--speculative-algorithm", type=str.lower, default=None, choices=["ngram"],
                        help="speculative decoding: ngram drafts several tokens of a request from its own prompt "
                             "and output, verified in one step (output unchanged; off by default)")
    parser.add_argument("--speculative-num-draft-tokens", type=positive_int, default=spec.num_draft_tokens,
                        help="the most draft tokens a request verifies in one step")
    parser.add_argument("--speculative-ngram-min-match-window-size", type=positive_int, default=spec.min_match,
                        help="shortest suffix of a sequence matched against its earlier tokens")
    parser.add_argument("--speculative-ngram-max-match-window-size", type=positive_int, default=spec.max_match,
                        help="longest suffix compared when choosing among matches")


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    if getattr(args, "speculative_algorithm", None) is None:
        return None
    return SpeculativeConfig(num_draft_tokens=args.speculative_num_draft_tokens,
                             min_match=args.speculative_ngram_min_match_window_size,
                             max_match=args.speculative_ngram_max_match_window_size)


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    lora = LoraConfig()
    parser.add_argument("--enable-lora", action="store_true",
                        help="serve LoRA adapters over the base model (implied by --lora-paths)")
    parser.add_argument("--lora-paths", nargs="+", default=os.environ.get("PDSERVE_LORA_PATHS", "").split(),
                        metavar="NAME=PATH", help="PEFT adapter directories loaded at start-up, as NAME=PATH (or "
                        "PATH: named by its folder); default: $PDSERVE_LORA_PATHS, space-separated")
    parser.add_argument("--max-loras-per-batch", type=int, default=lora.max_loras_per_batch,
                        help="adapter slots: the distinct adapters one batch may mix")
    parser.add_argument("--max-lora-rank", type=int, default=int(os.environ.get("PDSERVE_MAX_LORA_RANK") or 0) or None,
                        help="largest adapter rank (default: $PDSERVE_MAX_LORA_RANK, else the largest of "
                             "--lora-paths, else 16)")
    parser.add_argument("--lora-target-modules", nargs="+", default=None, metavar="MODULE",
                        help="modules adapters may change, or 'all' (default: those of --lora-paths, else all)")


def lora_config(args: argparse.Namespace) -> LoraConfig | None:
    if not (args.enable_lora or args.lora_paths):
        return None
    paths = []
    for spec in args.lora_paths:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).resolve().name, spec
        paths.append((name, path))
    targets = args.lora_target_modules
    if targets is not None and "all" in targets:
        from pdserve.shared.lora import SUPPORTED_TARGETS

        targets = list(SUPPORTED_TARGETS)
    return LoraConfig(paths=tuple(paths), max_loras_per_batch=args.max_loras_per_batch, max_rank=args.max_lora_rank,
                      target_modules=tuple(targets) if targets is not None else None)


def runtime_config(args: argparse.Namespace, model_path: str) -> RuntimeConfig:
    return RuntimeConfig(
        model_path=model_path, dtype=args.dtype, device=args.device, kernels=args.kernels,
        decode_graphs="off" if args.disable_cuda_graph else "auto", cuda_graph_max_bs=args.cuda_graph_max_bs,
        cuda_graph_bs=tuple(args.cuda_graph_bs or ()),
        overlap_schedule=("off" if args.disable_overlap_schedule else "on" if args.enable_overlap_schedule
                          else "auto"),
        context_length=args.context_length, deterministic=args.enable_deterministic_inference,
        cache=CacheConfig(page_size=args.page_size, max_total_tokens=args.max_total_tokens,
                          mem_fraction=args.mem_fraction),
        scheduler=SchedulerConfig(max_running_requests=args.max_running_requests,
                                  max_prefill_tokens=args.max_prefill_tokens,
                                  chunked_prefill_size=args.chunked_prefill_size, policy=args.schedule_policy,
                                  mixed_prefill=args.enable_mixed_chunk,
                                  local_prefill_max_tokens=getattr(args, "local_prefill_max_tokens", 0)),
        lora=lora_config(args) if not getattr(args, "is_embedding", False) else None,
        is_embedding=getattr(args, "is_embedding", False),
        quantization=args.quantization,
        speculative=speculative_config(args),
        tiers=tier_config(args),
    )


def set_torch_threads(args: argparse.Namespace) -> None:
    """--threads compute threads (default: all cores), and one inter-op thread: in the process that computes."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
