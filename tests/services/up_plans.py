"""What the `pdserve up` tests share: parsing its flags, reading a plan's command lines."""
from __future__ import annotations

import argparse

from pdserve.services import up, up_plan


def parse(*argv: str, state_dir: str = "/tmp/pdserve-state") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser, "up")
    return parser.parse_args([*argv, "--state-dir", state_dir])


def flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


def by_name(plan: up_plan.Plan) -> dict[str, up.Service]:
    return {s.name: s for s in plan.services}


def parsed_args(args: list[str]) -> argparse.Namespace:
    """A child's command line as its own command parses it."""
    from pdserve import cli

    return cli.build_parser(args)[0].parse_args(args)
