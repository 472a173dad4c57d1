"""What a worker app derives from its command line besides the runtime config: its name, its role's wiring and its
expert recording. `cli` parses the flags and builds the app; the apps read these without importing `cli` back."""
from __future__ import annotations

import argparse
import os
import socket
import uuid

from pdserve.services.worker.colocated import Colocated
from pdserve.services.worker.decode import Decode
from pdserve.services.worker.prefill import Prefill
from pdserve.services.worker.wiring import Wiring
from pdserve.shared.config import Role
from pdserve.shared.expert_recorder import MODES as EXPERT_RECORD_MODES
from pdserve.shared.expert_recorder import RecordSettings


def wiring_for(role: Role) -> Wiring:
    return {Role.COLOCATED: Colocated, Role.PREFILL: Prefill, Role.DECODE: Decode}[role]()


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


def tp_launch(args: argparse.Namespace, config, role: Role):
    """How this machine's ranks start (None for --tp-size 1); the checks a split must pass, before any starts."""
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
    return Launch(size, cpus, args.dist_timeout, args.base_gpu_id, transfer=transfer_spec(args, wiring_for(role)),
                  threads=args.threads, nodes=nodes)


def tp_ranks(args: argparse.Namespace, config, role: Role):
    """The other ranks of a tensor-parallel worker, started (None for --tp-size 1). Call it before the thread
    that will step exists: on a CPU it takes rank 0's cores, and the threads started after it inherit them."""
    launch = tp_launch(args, config, role)
    if launch is None:
        return None
    from pdserve.shared.tp_ranks import Ranks

    return Ranks(config, launch)


def serve_node(args: argparse.Namespace, config, role: Role) -> int:
    """A node other than 0 of a worker over several machines: its ranks only, until the group is gone."""
    args.worker_name = worker_name(role.value, args.host, args.port)  # its ranks' KV agents are named after it
    launch = tp_launch(args, config, role)
    from pdserve.shared.tp_remote import serve_node as serve

    return serve(config, launch)


def transfer_spec(args: argparse.Namespace, wiring: Wiring):
    """How a disaggregated worker's ranks make their KV transfer agents (None: a colocated worker has none)."""
    if wiring.transfer is None:
        return None
    from pdserve.shared.tp_transfer import TransferSpec
    from pdserve.shared.transfer import available_backends

    backend = args.transfer_backend
    if backend == "auto":
        backend = "nixl" if "nixl" in available_backends() else "tcp"
    if wiring.transfer == "receiver":  # TCP's receiving side listens: rank r on port + r
        return TransferSpec(backend, args.worker_name, args.host, args.transfer_port or args.port + 2000)
    return TransferSpec(backend, args.worker_name)
