"""The single `pdserve` command: one subcommand per service, plus debugging tools.

Each subcommand lives in the module that owns it; that module exposes
`add_arguments(parser, command)` and `main(args, command) -> int`. Modules are
imported only for the subcommand that runs, so `pdserve gateway` never loads torch.

The services also read their flags from a file (`--config FILE`, TOML or YAML): its keys are flag names,
with dashes or underscores; a flag given on the command line wins over the file's.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pdserve.services.up", "run the whole system on this machine (redis, workers, jobs, gateway)"),
    "prefill": ("pdserve.services.worker.cli", "run a prefill worker (gRPC)"),
    "decode": ("pdserve.services.worker.cli", "run a decode worker (gRPC)"),
    "colocated": ("pdserve.services.worker.cli", "run one worker doing both prefill and decode (gRPC)"),
    "gateway": ("pdserve.services.gateway.cli", "run the HTTP gateway (OpenAI-compatible and native APIs)"),
    "jobs": ("pdserve.services.jobs.cli", "run the Files/Batches service"),
    "batch-worker": ("pdserve.services.jobs.cli", "run a batch worker that executes batch items"),
    "prepare-model": ("pdserve.shared.model_files", "convert/locate a model and print its HF directory"),
    "bench": ("pdserve.benchclient.cli", "streaming chat load against any OpenAI-compatible server: throughput, "
                                       "TTFT, ITL"),
    "profile": ("pdserve.planning.cli", "measure this machine's step costs for a model: the profile simulate and plan "
                                         "read"),
    "simulate": ("pdserve.planning.cli", "replay a trace on a simulated deployment: TTFT, ITL, throughput, goodput"),
    "plan": ("pdserve.planning.cli", "the split of workers between prefill and decode with the best goodput on a trace"),
    "debug": ("pdserve.services.debug", "debugging tools: ping, info, stats, generate, transfer benchmark"),
}
SERVICES = ("up", "prefill", "decode", "colocated", "gateway", "jobs", "batch-worker")  # these take --config


class ConfigError(ValueError):
    pass


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None]:
    parser, command, _ = _build(argv)
    return parser, command


def _build(argv: list[str]) -> tuple[argparse.ArgumentParser, str | None, argparse.ArgumentParser | None]:
    """The parser, the command `argv` names (None: none) and that command's own parser."""
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with disaggregated prefill and decode.")
    parser.add_argument("--version", action="version", version=f"pdserve {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    command_parser = None
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(sp, name)
            if name in SERVICES:
                sp.add_argument("--config", metavar="FILE",
                                help="read flags from this TOML or YAML file: keys are flag names (dashes or "
                                     "underscores), values what the flag takes (true/false for switches, a list "
                                     "for repeatable flags); flags on the command line win")
            command_parser = sp
    return parser, chosen if chosen in COMMANDS else None, command_parser


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


# ---------------------------------------------------------------- --config FILE


def with_config_file(argv: list[str], command: str, parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with the flags of its --config file put right after the command, but for those it gives itself."""
    at = argv.index(command) + 1
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv[at:])[0].config
    if path is None:
        return argv
    options = {option: action for action in parser._actions for option in action.option_strings}
    given = {token.split("=", 1)[0] for token in argv[at:] if token.startswith("--")}
    flags: list[str] = []
    for key, value in read_config(Path(path)).items():
        option = "--" + str(key).replace("_", "-")
        action = options.get(option)
        if action is None or option in ("--config", "--help"):
            raise ConfigError(f"--config {path}: {key!r} is not a flag of `pdserve {command}` (see --help)")
        if value is None or given & set(action.option_strings):
            continue
        flags += config_flags(option, action, value, path)
    return argv[:at] + flags + argv[at:]


def read_config(path: Path) -> dict:
    if path.suffix not in (".toml", ".yaml", ".yml"):
        raise ConfigError(f"--config {path}: give a .toml, .yaml or .yml file")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror})") from None
    try:
        if path.suffix == ".toml":
            import tomllib

            settings = tomllib.loads(text)
        else:
            import yaml  # PyYAML comes with transformers

            settings = yaml.safe_load(text) or {}
    except Exception as exc:  # tomllib.TOMLDecodeError, yaml.YAMLError: their messages say where
        raise ConfigError(f"--config {path}: {exc}") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"--config {path}: expected flag names and their values at the top level")
    return settings


def config_flags(option: str, action: argparse.Action, value: object, path: str) -> list[str]:
    """The command-line form of one setting, so that argparse checks it as it checks flags."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ConfigError(f"--config {path}: {option} is a switch: give true or false, not {value!r}")
        return [option] if value == action.const else []
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, (dict, list)) for v in values):
        raise ConfigError(f"--config {path}: {option} takes plain values, not {value!r}")
    texts = [str(v).lower() if isinstance(v, bool) else str(v) for v in values]
    if isinstance(action, argparse._AppendAction):  # repeatable: once per value
        return [f"{option}={text}" for text in texts]
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return [option, *texts]
    if len(texts) != 1:
        raise ConfigError(f"--config {path}: {option} takes one value, not a list")
    return [f"{option}={texts[0]}"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, command, command_parser = _build(argv)
    if command in SERVICES:
        try:
            argv = with_config_file(argv, command, command_parser)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
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
