"""The plan of `pdserve up`: every child's command line, stage, health URL, ports and environment, from the flags.

A plan starts nothing and checks nothing (`up_preflight.py` checks it, `supervisor.py` runs it). Stages: redis
0; prefill workers, colocated workers, the embedding worker and jobs 1; decode workers 2 (they register with
prefill); the gateway 3. Workers take consecutive gRPC ports from --worker-port, each with its HTTP port at
+1000 and a decode worker's KV port at +2000; the ranks of a tensor-parallel decode worker receive KV on that
port + rank, so the next worker starts that many ports further (`port_span`) and no two KV ranges overlap.

Secrets: the Redis password, the admin key and the cluster token are made per run unless the operator gave
them. Redis's config and the admin key go into 0600 files of the state dir (`Plan.private_files`); each secret
reaches only the children that use it, through their environment, never a command line (`ps` shows those):
the API key and a Redis URL with a password jobs and the gateway, the cluster token the workers and the
gateway, the admin key the gateway.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.services.supervisor import PortUse, Service, UpError
from pdserve.services.up_flags import own_parser, passed_flags, tp_size
from pdserve.services.up_preflight import DEFAULT_WORKER_PORT
from pdserve.shared.cluster_auth import TOKEN_ENV, TOKEN_FILE_ENV, cluster_token

# Secrets `up` may have in its own environment: each child gets those it uses in its Service.env, never the
# rest by inheritance (a worker has no use for the API key or the Redis URL).
SECRET_VARIABLES = frozenset({"PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY", "PDSERVE_REDIS_URL", TOKEN_ENV,
                              TOKEN_FILE_ENV})


@dataclass
class Plan:
    services: list[Service]
    base_url: str  # the OpenAI base URL users talk to
    model_name: str
    api_key: str | None
    # Files `up` writes (0600) before starting anything and removes after the last stop: Redis's config, admin key.
    private_files: dict[Path, str] = field(default_factory=dict)


def loopback(host: str) -> str:
    """The address a local client uses to reach a server bound to `host`."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "", "localhost") else host


def redis_config_path(state: Path) -> Path:
    return state / "redis.conf"


def admin_key_path(state: Path) -> Path:
    return state / "admin-api-key"


def build_plan(args: argparse.Namespace, model_dir: Path, cpus: int) -> Plan:
    """Every child's command line, stage, health URL and ports. Pure but for the secrets it generates: starts and
    checks nothing (a --worker-port left to `up` is DEFAULT_WORKER_PORT here; `prepare` chooses it)."""
    pdserve = [sys.executable, "-m", "pdserve"]
    local = "127.0.0.1"
    state = Path(args.state_dir).expanduser()
    worker_port = DEFAULT_WORKER_PORT if args.worker_port is None else args.worker_port
    services: list[Service] = []
    private: dict[Path, str] = {}
    if args.redis_url:
        redis_url = args.redis_url
    else:
        # A password per run, in a config file only this user can read: never on redis-server's command line
        # (`ps`), and only in the environment of the services that use Redis: jobs, and the gateway's stored responses.
        password = secrets.token_urlsafe(32)
        redis_url = f"redis://:{password}@{local}:{args.redis_port}/0"
        config = redis_config_path(state)
        private[config] = f'requirepass "{password}"\n'
        services.append(Service(
            "redis", ["redis-server"],
            [str(config), "--bind", local, "--port", str(args.redis_port), "--daemonize", "no",
             "--dir", str(state / "redis"), "--appendonly", "yes", "--appendfsync", "always"],
            0, redis_url, [PortUse(args.redis_port, local, "redis port", "--redis-port")]))

    roles = [("colocated", 1)] if args.colocated else [("prefill", args.prefill or 1), ("decode", args.decode or 1)]
    runtimes = sum(count for _, count in roles)
    # Decode workers compute all the time and their steps are bound by the weight matmuls, so they share every
    # core; prefill runs in short bursts and gets an equal share, overlapping decode while it runs (with
    # --threads 1 on a 2-core machine each role keeps a core of its own: steadier decode latency under long
    # prompts, half the decode throughput).
    # A tensor-parallel worker's ranks are each pinned to their own cores on a CPU (by default all cores split
    # evenly: --threads cannot change that), so its threads are the cores one rank gets, for every rank.
    decoders = sum(count for role, count in roles if role != "prefill")
    tp_of = {role: tp_size(args, role) for role, _ in roles}
    threads_of = {role: args.threads or max(1, cpus // (tp_of[role] if tp_of[role] > 1 else
                                                        decoders if role != "prefill" else runtimes))
                  for role, _ in roles}
    model_name = args.served_model_name or model_dir.name
    given = passed_flags(args, own_parser())
    common = ["--model-path", str(model_dir), "--served-model-name", model_name, "--host", local]
    # Workers take calls and KV only from holders of this run's cluster token (cluster_auth.py): another local
    # user's process cannot drive them or write into their pools.
    cluster = {TOKEN_ENV: cluster_token() or secrets.token_urlsafe(32)}
    workers: dict[str, list[str]] = {}  # role -> host:port of each worker
    index = 0
    for role, count in roles:
        tp = tp_of[role]
        for i in range(count):
            port = worker_port + index
            index += port_span(role, tp)
            name = role if count == 1 else f"{role}-{i}"
            workers.setdefault(role, []).append(f"{local}:{port}")
            ports = [PortUse(port, local, f"{name} gRPC port", "--worker-port"),
                     PortUse(port + 1000, local, f"{name} HTTP port (gRPC port + 1000)", "--worker-port")]
            extra = list(given[role]) + (["--tp-size", str(tp)] if tp > 1 else [])
            if role == "decode":
                ports.append(PortUse(port + 2000, local, f"{name} KV transfer port (gRPC port + 2000)",
                                     "--worker-port"))
                # Rank r of a tensor-parallel decode worker receives KV on the KV port + r.
                ports += [PortUse(port + 2000 + r, local, f"{name} rank {r} KV transfer port (gRPC port + "
                                  f"{2000 + r})", "--worker-port") for r in range(1, tp)]
                extra += ["--transfer-port", str(port + 2000)]
                for prefill in workers["prefill"]:
                    extra += ["--prefill", prefill]
            threads = threads_of[role]
            services.append(Service(
                name, pdserve, [role, *common, "--threads", str(threads), "--port", str(port),
                                "--http-port", str(port + 1000), *extra],
                2 if role == "decode" else 1, f"http://{local}:{port + 1000}/health", ports,
                {"OMP_NUM_THREADS": str(threads), **cluster}))

    embedding_targets: list[str] = []
    if args.embedding_model:
        service, embedding_targets = embedding_worker(args, worker_port + index, pdserve, cpus,
                                                      given["embedding"])
        service.env.update(cluster)
        services.append(service)
    gateway_url = f"http://{loopback(args.host)}:{args.port}"
    jobs_url = f"http://{local}:{args.jobs_port}"
    quiet = {"OMP_NUM_THREADS": "1"}  # keep HTTP services off the cores the workers compute on
    # Secrets reach the children through their environment, never their command lines (`ps` and the lines `up`
    # prints show those): the API key, and a Redis URL that holds a password.
    secret = {"PDSERVE_API_KEY": args.api_key} if args.api_key else {}
    # The admin routes (weights, adapters, cache, aborts) need a key of their own: the operator's, or one made for
    # this run and left where only this user can read it.
    admin_key = os.environ.get("PDSERVE_ADMIN_API_KEY") or secrets.token_urlsafe(32)
    private[admin_key_path(state)] = admin_key + "\n"
    redis_secret = {"PDSERVE_REDIS_URL": redis_url} if urlsplit(redis_url).password else {}
    services.append(Service(
        "jobs", pdserve,
        ["jobs", "--host", local, "--port", str(args.jobs_port), *([] if redis_secret else ["--redis-url", redis_url]),
         "--gateway-url", gateway_url, *given["jobs"]],
        1, f"{jobs_url}/health", [PortUse(args.jobs_port, local, "jobs port", "--jobs-port")],
        {**quiet, **secret, **redis_secret}))

    targets: list[str] = []
    for role, flag in (("colocated", "--worker"), ("prefill", "--prefill"), ("decode", "--decode")):
        for address in workers.get(role, []):
            targets += [flag, address]
    targets += embedding_targets
    services.append(Service(
        "gateway", pdserve,
        ["gateway", "--model-path", str(model_dir), "--host", args.host, "--port", str(args.port),
         *targets, "--jobs-url", jobs_url,
         # named only when the user named it: then other names are refused (400), as SGLang; else any is served
         *(["--served-model-name", args.served_model_name] if args.served_model_name else []),
         *([] if redis_secret else ["--redis-url", redis_url]), *given["gateway"]],
        3, f"{gateway_url}/health", [PortUse(args.port, args.host, "gateway port", "--port")],
        {**quiet, **secret, **cluster, **redis_secret, "PDSERVE_ADMIN_API_KEY": admin_key}))
    for service in services:
        service.withheld = SECRET_VARIABLES
    return Plan(services, f"{gateway_url}/v1", model_name, args.api_key, private)


def port_span(role: str, tp: int) -> int:
    """How many consecutive gRPC ports a worker takes from --worker-port: one, but a decode worker of --tp-size
    N takes N, as its ranks' KV ports are its KV port + 0..N-1 (gRPC port + 2000 + r): spaced so, the next
    worker's KV port lies past its last rank's, and no two decode workers' KV ranges overlap. The ports skipped
    serve nothing."""
    return tp if role == "decode" else 1


def worker_count(args: argparse.Namespace) -> int:
    """Consecutive gRPC ports the workers `up` starts take (`port_span` each), the --embedding-model worker
    included: the block `up` chooses for them (each with +1000 and +2000)."""
    if args.colocated:
        return 1 + (1 if args.embedding_model else 0)
    spans = (args.prefill or 1) * port_span("prefill", tp_size(args, "prefill")) + \
        (args.decode or 1) * port_span("decode", tp_size(args, "decode"))
    return spans + (1 if args.embedding_model else 0)


def embedding_worker(args: argparse.Namespace, port: int, pdserve: list[str], cpus: int,
                     flags: list[str]) -> tuple[Service, list[str]]:
    """The dedicated worker of --embedding-model (an encoder: no KV, no PD) and the gateway flags routing to it."""
    local = "127.0.0.1"
    threads = args.threads or max(1, cpus // 2)  # it computes only while embedding requests come in
    ports = [PortUse(port, local, "embedding gRPC port", "--worker-port"),
             PortUse(port + 1000, local, "embedding HTTP port (gRPC port + 1000)", "--worker-port")]
    service = Service(
        "embedding", pdserve,
        ["colocated", "--is-embedding", "--model-path", args.embedding_model, "--host", local, "--threads",
         str(threads), "--port", str(port), "--http-port", str(port + 1000), *flags,
         *(["--quantization", args.embedding_quantization] if args.embedding_quantization else [])],
        1, f"http://{local}:{port + 1000}/health", ports, {"OMP_NUM_THREADS": str(threads)})
    return service, ["--embedding-model", args.embedding_model, "--embedding-worker", f"{local}:{port}"]


def substitute(plan: Plan, specs: list[str]) -> None:
    """Swap the executable of named services (`NAME=COMMAND`); their flags, ports and health checks stay."""
    by_name = {s.name: s for s in plan.services}
    for spec in specs:
        name, _, command = spec.partition("=")
        if name not in by_name or not command:
            raise UpError(f"--substitute expects NAME=COMMAND with NAME one of {', '.join(by_name)}; got {spec!r}")
        by_name[name].launcher = shlex.split(command)
