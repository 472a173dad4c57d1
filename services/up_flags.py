"""The flags `pdserve up` passes through: every flag of the workers, the gateway and the jobs service, built from
their own parsers (a new flag needs nothing here), each passed, when given, to the services that take it.
"""
from __future__ import annotations

import argparse
import copy

CHILDREN = ("colocated", "prefill", "decode", "gateway", "jobs")  # the commands whose flags `up` passes through
# The children's flags that `up` sets for each child itself (its addresses and peers), never taken from the user.
PLANNED = frozenset({"--http-port", "--transfer-port", "--worker", "--jobs-url", "--embedding-worker",
                     "--gateway-url"})
# Of the workers' flags, those the --embedding-model worker (an encoder) takes too; the rest are about generation.
EMBEDDING_FLAGS = frozenset({"--device", "--dtype", "--log-level", "--log-format"})


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


def passed_flags(args: argparse.Namespace, own_parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Child command ("embedding": the --embedding-model worker) -> the flags given to `up` that it takes."""
    given = vars(args)
    flags: dict[str, list[str]] = {command: [] for command in (*CHILDREN, "embedding")}
    for option, uses in passed_actions(own_parser).items():
        dest = uses[0][1].dest
        if dest not in given:
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
