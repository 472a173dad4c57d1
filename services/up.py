"""`pdserve up`: the whole system on one machine, as supervised child processes.

Lifecycle: plan (command lines and ports, from the flags) -> preflight (every executable present, every
port free, the model resolved once: converted on first use with a progress bar) -> start in stages, each
healthy before the next (redis; prefill workers and jobs; decode workers; gateway) -> serve until
Ctrl-C/SIGTERM, restarting any service that dies meanwhile -> stop in reverse stage order (SIGTERM to each
child's process group, SIGKILL after a grace period).

Ports: the gateway, jobs and Redis ports are the user's (a busy one is an error naming its flag). Unless
--worker-port is given, the workers' block (each gRPC port, +1000 HTTP, +2000 KV) is chosen at start-up
outside the kernel's ephemeral range, where an outgoing connection cannot take one as its local port, and
free; a worker that still loses its port to a race during start-up makes `up` start again on the next block.

Secrets: a Redis password and an admin key generated per run, in 0600 files of the state dir; the Redis URL
reaches jobs and the gateway only, in their environment. Beyond loopback the gateway needs an API key.

Invariant: `up` never leaves a half-started system running. A child that exits during start-up, or that
does not turn healthy in time, is reported with its last log lines, everything else is stopped, and `up`
exits non-zero. Once serving, a child that dies is restarted with backoff (supervisor.RestartPolicy: 1 s,
doubling to 30 s) while the others keep serving; only a crash loop (a 6th exit in a row, none after
staying healthy for 60 s) is reported that way and stops everything.

Flags: besides its own, `up` takes every flag of the workers, the gateway and the jobs service (built from
their parsers, so a new one needs nothing here) and passes each one given to the services that take it; one
not given is not passed, so each service keeps its own default.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shlex
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.services.supervisor import Child, Console, PortUse, Service, Supervisor, UpError, probe
from pdserve.services.up_flags import add_passed_arguments, passed_flags
from pdserve.services.up_preflight import (DEFAULT_WORKER_PORT, WORKER_BASE_STEP, check_executables, check_ports,
                                           choose_worker_base, ephemeral_range, port_in_use)
from pdserve.shared.cluster_auth import TOKEN_ENV, TOKEN_FILE_ENV, cluster_token

CHAT_EXAMPLE = "What is the capital of France?"
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})
# Secrets `up` may have in its own environment: each child gets those it uses in its Service.env, never the
# rest by inheritance (a worker has no use for the API key or the Redis URL).
SECRET_VARIABLES = frozenset({"PDSERVE_API_KEY", "PDSERVE_ADMIN_API_KEY", "PDSERVE_REDIS_URL", TOKEN_ENV,
                              TOKEN_FILE_ENV})
BIND_ATTEMPTS = 3  # starts of the whole system when a worker loses its chosen port to a race


@dataclass
class Plan:
    services: list[Service]
    base_url: str  # the OpenAI base URL users talk to
    model_name: str
    api_key: str | None
    # Files `up` writes (0600) before starting anything and removes after the last stop: Redis's config, admin key.
    private_files: dict[Path, str] = field(default_factory=dict)


# ---------------------------------------------------------------- plan
def default_state_dir() -> Path:
    root = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(root) / "pdserve"


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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
    decoders = sum(count for role, count in roles if role != "prefill")
    threads_of = {role: args.threads or max(1, cpus // (decoders if role != "prefill" else runtimes))
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
        for i in range(count):
            port = worker_port + index
            index += 1
            name = role if count == 1 else f"{role}-{i}"
            workers.setdefault(role, []).append(f"{local}:{port}")
            ports = [PortUse(port, local, f"{name} gRPC port", "--worker-port"),
                     PortUse(port + 1000, local, f"{name} HTTP port (gRPC port + 1000)", "--worker-port")]
            extra = list(given[role])
            if role == "decode":
                ports.append(PortUse(port + 2000, local, f"{name} KV transfer port (gRPC port + 2000)",
                                     "--worker-port"))
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
         *targets, "--jobs-url", jobs_url, "--served-model-name", model_name,
         *([] if redis_secret else ["--redis-url", redis_url]), *given["gateway"]],
        3, f"{gateway_url}/health", [PortUse(args.port, args.host, "gateway port", "--port")],
        {**quiet, **secret, **cluster, **redis_secret, "PDSERVE_ADMIN_API_KEY": admin_key}))
    for service in services:
        service.withheld = SECRET_VARIABLES
    return Plan(services, f"{gateway_url}/v1", model_name, args.api_key, private)


def worker_count(args: argparse.Namespace) -> int:
    """Worker processes `up` starts, the --embedding-model worker included: each takes a gRPC port in turn."""
    runtimes = 1 if args.colocated else (args.prefill or 1) + (args.decode or 1)
    return runtimes + (1 if args.embedding_model else 0)


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


# ---------------------------------------------------------------- preflight


def choose_ports(args: argparse.Namespace, start: int = DEFAULT_WORKER_PORT) -> None:
    """Sets args.worker_port when the user left it to `up` (see choose_worker_base)."""
    reserved = {args.port, args.jobs_port} | (set() if args.redis_url else {args.redis_port})
    args.worker_port = choose_worker_base(worker_count(args), ephemeral_range(), reserved,
                                          lambda port: not port_in_use("127.0.0.1", port), start)


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_own_arguments(parser)
    add_passed_arguments(parser, own_parser())


def own_parser() -> argparse.ArgumentParser:
    """A parser of `up`'s own flags alone."""
    parser = argparse.ArgumentParser(add_help=False)
    add_own_arguments(parser)
    return parser


def add_own_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--colocated", action="store_true",
                        help="run one colocated worker instead of separate prefill and decode workers")
    parser.add_argument("--prefill", type=int, default=None, metavar="N", help="prefill workers (default 1)")
    parser.add_argument("--decode", type=int, default=None, metavar="M", help="decode workers (default 1)")
    parser.add_argument("--host", default="127.0.0.1", help="address the gateway listens on (0.0.0.0: all)")
    parser.add_argument("--port", type=int, default=30000, help="gateway HTTP port (the OpenAI API)")
    parser.add_argument("--model-path", default=None,
                        help="HF directory or .gguf file (default: SmolLM2-135M-Instruct, converted on first use)")
    parser.add_argument("--served-model-name", default=None, help="model name for clients (default: the model dir's)")
    parser.add_argument("--embedding-model", default=None, metavar="PATH",
                        help="also start a dedicated embedding worker on this model (e.g. all-MiniLM-L6-v2); "
                             "requests pick it by their 'model'")
    parser.add_argument("--embedding-quantization", default=None, choices=["w8a8_int8"],
                        help="run the --embedding-model worker's matmuls in int8 (its --quantization)")
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                        help="require this key on the gateway and jobs service (default: $PDSERVE_API_KEY; prefer "
                             "the variable: a flag shows in `ps`). Services get it through their environment")
    parser.add_argument("--allow-insecure", action="store_true",
                        help="let the gateway listen beyond loopback (--host) with no API key: anyone who can "
                             "reach the port may use it")
    parser.add_argument("--redis-url", default=os.environ.get("PDSERVE_REDIS_URL") or None,
                        help="use this Redis instead of starting redis-server (default: $PDSERVE_REDIS_URL; give a "
                             "URL with a password in the variable: a flag shows in `ps`)")
    parser.add_argument("--redis-port", type=int, default=6379, help="port of the redis-server `up` starts")
    parser.add_argument("--jobs-port", type=int, default=30010, help="jobs (Files/Batches) service port")
    parser.add_argument("--worker-port", type=int, default=None,
                        help="gRPC port of the first worker; the next workers count up from it; each worker's "
                             "HTTP port is its gRPC port + 1000, a decode worker's KV port its gRPC port + 2000 "
                             f"(default: from {DEFAULT_WORKER_PORT}, the first free block outside the kernel's "
                             "ephemeral port range)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker (default: decode and colocated workers share all cores, "
                             "prefill workers get an equal share of them)")
    parser.add_argument("--state-dir", default=str(default_state_dir()),
                        help="Redis data and service logs (default: %(default)s)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="seconds each stage may take to become healthy")
    parser.add_argument("--stop-timeout", type=float, default=45.0,
                        help="seconds a service may take to stop after SIGTERM before it is killed (longer than "
                             "the services' --drain-timeout, 30 s by default, for requests in progress to finish)")
    # Runs another executable in place of one service (same flags, ports and health check); for testing.
    parser.add_argument("--substitute", action="append", default=[], metavar="NAME=COMMAND", help=argparse.SUPPRESS)


def validate(args: argparse.Namespace) -> None:
    if args.colocated and (args.prefill is not None or args.decode is not None):
        raise UpError("--colocated runs one worker: drop --prefill/--decode")
    for flag, value in (("--prefill", args.prefill), ("--decode", args.decode)):
        if value is not None and not 1 <= value <= 64:
            raise UpError(f"{flag} must be between 1 and 64, got {value}")
    if args.threads is not None and args.threads < 1:
        raise UpError(f"--threads must be at least 1, got {args.threads}")
    if not args.api_key and not args.allow_insecure and not is_loopback(args.host):
        raise UpError(f"--host {args.host} serves the API beyond this machine with no API key: set one "
                      "(PDSERVE_API_KEY, or --api-key) or pass --allow-insecure to serve it to anyone who can "
                      "reach the port")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def exposed_without_key(args: argparse.Namespace) -> bool:
    return not args.api_key and not is_loopback(args.host)


def banner(plan: Plan, log_dir: Path) -> str:
    workers = [s.name for s in plan.services if s.args and s.args[0] in ("colocated", "prefill", "decode")]
    auth = " -H 'Authorization: Bearer YOUR_API_KEY'" if plan.api_key else ""
    # Greedy, so the first answer a user sees is the model's best one rather than a sample.
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "%s"}], "temperature": 0, "max_tokens": 32}'
            % (plan.model_name, CHAT_EXAMPLE))
    return "\n".join([
        f"[up] pdserve is ready: workers {', '.join(workers)}; model {plan.model_name}",
        f"[up] OpenAI base URL: {plan.base_url}",
        "[up] try:",
        f"  curl {plan.base_url}/chat/completions -H 'Content-Type: application/json'{auth} \\",
        f"    -d '{body}'",
        f"[up] admin routes (update_weights_from_disk, load_lora_adapter, flush_cache, abort_request, ...) need "
        f"the key in {admin_key_path(log_dir.parent)}",
        f"[up] logs: {log_dir}; press Ctrl-C to stop",
    ])


def prepare(args: argparse.Namespace) -> Plan:
    """Check everything a user could get wrong before anything starts, then resolve the model once."""
    from pdserve.shared.model_files import resolve_model_path

    validate(args)
    if args.worker_port is None:
        choose_ports(args)
    draft = build_plan(args, Path(args.model_path or "."), available_cpus())
    substitute(draft, args.substitute)
    check_executables(draft.services)
    check_ports(draft.services)
    if args.redis_url and not probe(args.redis_url):
        from pdserve.services.jobs.cli import without_password

        raise UpError(f"cannot reach Redis at {without_password(args.redis_url)} (--redis-url): is it running?")
    args.model_path = str(resolve_model_path(args.model_path))  # converts on first use, with a progress bar
    return replan(args)


def replan(args: argparse.Namespace) -> Plan:
    """The plan for a resolved model (args.model_path) and the ports now in args, checked free."""
    plan = build_plan(args, Path(args.model_path), available_cpus())
    substitute(plan, args.substitute)
    check_ports(plan.services)
    return plan


def lost_its_port(child: Child) -> bool:
    """Whether a child that died during start-up is a worker that could not bind one of its ports."""
    if not any(use.flag == "--worker-port" for use in child.service.ports):
        return False
    return any("cannot listen on" in line or "address already in use" in line.lower() for line in child.last_lines())


def plan_elsewhere(args: argparse.Namespace, failed: Child | None, console: Console) -> Plan | None:
    """After a start-up that failed because a worker lost one of the ports `up` chose for it: a plan on the next
    free block. None when the failure was another one (or no block is left)."""
    if failed is None or not lost_its_port(failed):
        return None
    try:
        choose_ports(args, start=args.worker_port + WORKER_BASE_STEP)
        plan = replan(args)
    except UpError as exc:
        console.print(f"error: {exc}", err=True)
        return None
    console.print(f"[up] {failed.name} lost a port to another process as it started: starting again with worker "
                  f"ports from {args.worker_port}", err=True)
    return plan


def write_private(files: dict[Path, str]) -> None:
    """Each file readable by this user only, from its creation on."""
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            os.fchmod(fd, 0o600)  # one left by an earlier run may have had another mode
            f.write(text)


def main(args: argparse.Namespace, command: str) -> int:
    from pdserve.shared.model_files import ModelNotFound

    console = Console()
    chosen = args.worker_port is None  # `up` picks the worker ports, so it may pick again
    try:
        plan = prepare(args)
    except (UpError, ModelNotFound) as exc:
        console.print(f"error: {exc}", err=True)
        return 1
    if exposed_without_key(args):
        console.print(f"[up] warning: the gateway listens on {args.host} with no API key (--allow-insecure): "
                      f"anyone who can reach port {args.port} can use it", err=True)
    state = Path(args.state_dir).expanduser()
    log_dir = state / "logs"
    for path in (log_dir, state / "redis"):
        path.mkdir(parents=True, exist_ok=True)
    current: list[Supervisor] = []
    stopped: list[str] = []

    def on_signal(signum: int, frame: object) -> None:
        stopped.append(signal.Signals(signum).name)
        if current:
            current[-1].request_stop(stopped[-1])

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for attempt in range(1, BIND_ATTEMPTS + 1):
            write_private(plan.private_files)
            supervisor = Supervisor(plan.services, console, log_dir, args.startup_timeout, args.stop_timeout)
            current.append(supervisor)
            if stopped:
                supervisor.request_stop(stopped[-1])
            code = supervisor.run(on_ready=lambda: console.print(banner(plan, log_dir)))
            if code == 0 or stopped or not chosen or attempt == BIND_ATTEMPTS:
                break
            retry = plan_elsewhere(args, supervisor.startup_failure, console)
            if retry is None:
                break
            plan = retry
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for path in plan.private_files:
            path.unlink(missing_ok=True)
    console.print("[up] stopped" if code == 0 else "[up] stopped after a failure", err=code != 0)
    return code
