"""The single `pdserve` command: one subcommand per service, plus debugging tools.

Each subcommand lives in the module that owns it; that module exposes
`add_arguments(parser, command)` and `main(args, command) -> int`. Modules are
imported only for the subcommand that runs, so `pdserve gateway` never loads torch.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pdserve.services.up", "run the whole system on this machine (redis, workers, jobs, gateway)"),
    "prefill": ("pdserve.services.worker.cli", "run a prefill worker (gRPC)"),
    "decode": ("pdserve.services.worker.cli", "run a decode worker (gRPC)"),
    "colocated": ("pdserve.services.worker.cli", "run one worker doing both prefill and decode (gRPC)"),
    "gateway": ("pdserve.services.gateway.cli", "run the HTTP gateway (OpenAI-compatible and native APIs)"),
    "jobs": ("pdserve.services.jobs.cli", "run the Files/Batches service"),
    "batch-worker": ("pdserve.services.jobs.cli", "run a batch worker that executes batch items"),
    "prepare-model": ("pdserve.shared.model_files", "convert/locate a model and print its HF directory"),
    "bench": ("pdserve.services.bench", "streaming chat load against any OpenAI-compatible server: throughput, "
                                        "TTFT, ITL"),
    "debug": ("pdserve.services.debug", "debugging tools: ping, info, stats, generate, transfer benchmark"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with disaggregated prefill and decode.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(sp, name)
    return parser, chosen if chosen in COMMANDS else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, command = build_parser(argv)
    args = parser.parse_args(argv)
    if command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    try:
        return int(module.main(args, command) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
