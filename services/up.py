"""`pdserve up`: the whole system on one machine, as supervised child processes.

Lifecycle: plan (command lines and ports, from the flags) -> preflight (every executable present, every
port free, the model resolved once: converted on first use with a progress bar) -> start in stages, each
healthy before the next (redis; prefill workers and jobs; decode workers; gateway) -> serve until
Ctrl-C/SIGTERM, restarting any service that dies meanwhile -> stop in reverse stage order (SIGTERM to each
child's process group, SIGKILL after a grace period).

Ports: the gateway, jobs and Redis ports are the user's (a busy one is an error naming its flag). Unless
--worker-port is given, the workers' block (each gRPC port, +1000 HTTP, +2000 KV, + rank for the ranks of a
tensor-parallel decode worker) is chosen at start-up outside the kernel's ephemeral range, where an outgoing
connection cannot take one as its local port, and free; a worker that still loses its port to a race during start-up makes `up` start again on the next block.

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

The parts: `up_flags.py` the flags and their checks, `up_plan.py` the plan, `up_preflight.py` the checks
before starting, `supervisor.py` the children; this module is the command and its lifecycle.
"""
from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from pdserve.services.supervisor import Child, Console, Supervisor, UpError, probe
from pdserve.services.up_flags import add_own_arguments, add_passed_arguments, exposed_without_key, own_parser, validate
from pdserve.services.up_plan import Plan, admin_key_path, build_plan, substitute, worker_count
from pdserve.services.up_preflight import (DEFAULT_WORKER_PORT, WORKER_BASE_STEP, check_executables, check_ports,
                                           choose_worker_base, ephemeral_range, port_in_use)

CHAT_EXAMPLE = "What is the capital of France?"
BIND_ATTEMPTS = 3  # starts of the whole system when a worker loses its chosen port to a race


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_own_arguments(parser)
    add_passed_arguments(parser, own_parser())


# ---------------------------------------------------------------- preflight


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def choose_ports(args: argparse.Namespace, start: int = DEFAULT_WORKER_PORT) -> None:
    """Sets args.worker_port when the user left it to `up` (see choose_worker_base)."""
    reserved = {args.port, args.jobs_port} | (set() if args.redis_url else {args.redis_port})
    args.worker_port = choose_worker_base(worker_count(args), ephemeral_range(), reserved,
                                          lambda port: not port_in_use("127.0.0.1", port), start)


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


# ---------------------------------------------------------------- start and serve


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
