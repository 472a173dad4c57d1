"""The flags of `pdserve up`: its own, their checks, and those it passes through: every flag of the workers,
the gateway and the jobs service, built from their own parsers (a new flag needs nothing here), each passed,
when given, to the services that take it.
"""
from __future__ import annotations

import argparse
import copy
import ipaddress
import os
from pathlib import Path

from pdserve.services.supervisor import UpError
from pdserve.services.up_preflight import DEFAULT_WORKER_PORT

CHILDREN = ("colocated", "prefill", "decode", "gateway", "jobs")  # the commands whose flags `up` passes through
# The children's flags that `up` sets for each child itself (its addresses and peers), never taken from the user.
PLANNED = frozenset({"--http-port", "--transfer-port", "--worker", "--jobs-url", "--embedding-worker",
                     "--gateway-url"})
# Of the workers' flags, those the --embedding-model worker (an encoder) takes too; the rest are about generation.
EMBEDDING_FLAGS = frozenset({"--device", "--dtype", "--log-level", "--log-format"})
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


# ---------------------------------------------------------------- up's own flags


def default_state_dir() -> Path:
    root = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(root) / "pdserve"


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
    parser.add_argument("--served-model-name", default=None,
                        help="the one model name clients may send, others are refused (default: any name is served)")
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
    parser.add_argument("--prefill-tp-size", type=int, default=None, metavar="N",
                        help="--tp-size of the prefill workers (default: --tp-size, else 1)")
    parser.add_argument("--decode-tp-size", type=int, default=None, metavar="N",
                        help="--tp-size of the decode workers (default: --tp-size, else 1); a decode worker's "
                             "ranks receive KV on its KV port + rank")
    parser.add_argument("--worker-port", type=int, default=None,
                        help="gRPC port of the first worker; the next workers count up from it (past a "
                             "tensor-parallel decode worker by its --decode-tp-size); each worker's HTTP port "
                             "is its gRPC port + 1000, a decode worker's KV port its gRPC port + 2000 (rank r's "
                             f"+ r) (default: from {DEFAULT_WORKER_PORT}, the first free block outside the "
                             "kernel's ephemeral port range)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per worker, per rank of a tensor-parallel one (default: decode and "
                             "colocated workers share all cores, prefill workers get an equal share of them; a "
                             "worker of --tp-size N: the cores one rank gets, all / N). On a CPU each rank of a "
                             "tensor-parallel worker is pinned to its own cores (--cpu-binding, else all cores "
                             "split evenly) and computes with one thread per core of them, whatever --threads says")
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
    if args.colocated and (args.prefill_tp_size is not None or args.decode_tp_size is not None):
        raise UpError("--colocated runs one worker: give its size with --tp-size, not --prefill-tp-size/"
                      "--decode-tp-size")
    for flag, value in (("--tp-size", getattr(args, "tp_size", None)), ("--prefill-tp-size", args.prefill_tp_size),
                        ("--decode-tp-size", args.decode_tp_size)):
        if value is not None and value < 1:
            raise UpError(f"{flag} must be at least 1, got {value}")
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


# ---------------------------------------------------------------- the children's flags


def child_parsers() -> dict[str, argparse.ArgumentParser]:
    """The parser of each child command, as `pdserve COMMAND` builds it."""
    from pdserve.services.gateway import cli as gateway_cli
    from pdserve.services.jobs import cli as jobs_cli
    from pdserve.services.worker import cli as worker_cli

    modules = {"colocated": worker_cli, "prefill": worker_cli, "decode": worker_cli, "gateway": gateway_cli,
               "jobs": jobs_cli}
    parsers = {}
    for command in CHILDREN:
        parsers[command] = argparse.ArgumentParser(add_help=False)
        modules[command].add_arguments(parsers[command], command)
    return parsers


def passed_actions(own_parser: argparse.ArgumentParser) -> dict[str, list[tuple[str, argparse.Action]]]:
    """option -> (child command, the child's action) for each child flag that `up` passes through: all but
    those `up` has (`own_parser`: its own flags) or sets itself. argparse shows a parser's flags only as
    `_actions`."""
    own = {option for action in own_parser._actions for option in action.option_strings} | PLANNED
    own_dests = {action.dest for action in own_parser._actions}
    passed: dict[str, list[tuple[str, argparse.Action]]] = {}
    for command, child in child_parsers().items():
        for action in child._actions:
            if action.option_strings and not own & set(action.option_strings) and action.dest not in own_dests:
                passed.setdefault(action.option_strings[0], []).append((command, action))
    return passed


def add_passed_arguments(parser: argparse.ArgumentParser, own_parser: argparse.ArgumentParser) -> None:
    """The children's flags, each in a group named after the services it goes to, with no default of its own:
    `up` passes only those given."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for uses in passed_actions(own_parser).values():
        commands = [command for command, _ in uses]
        label = services_label(commands)
        if label not in groups:
            groups[label] = parser.add_argument_group(f"passed to {label}")
        action = copy.copy(uses[0][1])
        default = action.default
        if default not in (None, False, [], "") and action.help != argparse.SUPPRESS \
                and "default" not in (action.help or ""):
            action.help = f"{action.help or ''} (default: {str(default).replace('%', '%%')})".lstrip()
        action.default, action.required = argparse.SUPPRESS, False
        groups[label]._add_action(action)


def services_label(commands: list[str]) -> str:
    if set(commands) == set(CHILDREN):
        return "every service"
    workers = [c for c in commands if c in ("colocated", "prefill", "decode")]
    names = ["every worker"] if len(workers) == 3 else [f"{c} workers" for c in workers]
    names += [{"gateway": "the gateway", "jobs": "the jobs service"}[c] for c in commands if c in ("gateway", "jobs")]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def tp_size(args: argparse.Namespace, role: str) -> int:
    """The --tp-size of a worker role: its own flag (--prefill-tp-size, --decode-tp-size), else --tp-size (every
    worker's), else 1."""
    own = getattr(args, f"{role}_tp_size", None)
    return own if own is not None else getattr(args, "tp_size", None) or 1


def passed_flags(args: argparse.Namespace, own_parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Child command ("embedding": the --embedding-model worker) -> the flags given to `up` that it takes, but
    --tp-size: the plan gives each worker its own (`tp_size`)."""
    given = vars(args)
    flags: dict[str, list[str]] = {command: [] for command in (*CHILDREN, "embedding")}
    for option, uses in passed_actions(own_parser).items():
        dest = uses[0][1].dest
        if dest not in given or dest == "tp_size":
            continue
        for command, action in uses:
            tokens = command_line(action, given[dest])
            flags[command] += tokens
            if command == "colocated" and option in EMBEDDING_FLAGS:
                flags["embedding"] += tokens
    return flags


def command_line(action: argparse.Action, value: object) -> list[str]:
    """The flag of `action` with the value it parsed to, as a command line."""
    option = action.option_strings[0]
    if action.nargs == 0:  # a switch
        return [option] if value == action.const else []
    if isinstance(action, argparse._AppendAction):  # repeatable: once per value
        return [token for item in value for token in (option, str(item))]
    if isinstance(value, list):
        return [option, *map(str, value)]
    return [option, str(value)]
