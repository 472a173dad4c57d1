"""The CLI reference: one page per `pdserve` command, written from the argparse parser the command itself runs.

Every flag `pdserve COMMAND --help` shows is a row of its page, with its value, default and help, under the
group --help puts it in; a command with subcommands (`debug`) gets a section per subcommand. Each row carries an
anchor named after the flag (`cli/up.md#page-size`), so a link to one flag stays put.
"""
from __future__ import annotations

import argparse

from mdtable import code, table, text

from pdserve.cli import COMMANDS, SERVICES, _build


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser `pdserve COMMAND` parses its arguments with."""
    _, _, parser = _build([command])
    return parser


def pages() -> dict[str, str]:
    """Page path (under reference/cli/) -> Markdown, for every command and the index of them all."""
    out = {"index.md": index_page()}
    for command in COMMANDS:
        out[f"{command}.md"] = command_page(command)
    return out


def index_page() -> str:
    rows = [[f"[`pdserve {name}`]({name}.md)", text(help_text)] for name, (_, help_text) in COMMANDS.items()]
    return ("# Command-line reference\n\n"
            "Every `pdserve` command and every flag it takes, written from the parsers the commands run (so "
            "this reference is `pdserve COMMAND --help`, laid out). The services (`"
            + "`, `".join(SERVICES) + "`) also read their flags from a file, `--config FILE` (TOML or YAML: keys "
            "are flag names, with dashes or underscores; a flag on the command line wins over the file's).\n\n"
            + table(["command", "what it does"], rows))


def command_page(command: str) -> str:
    parser = command_parser(command)
    lines = [f"# pdserve {command}\n", text(parser.description or ""), "",
             "```text", f"pdserve {command} [FLAGS]", "```", ""]
    lines += parser_sections(parser, level=2, anchor_prefix="")
    return "\n".join(lines)


def parser_sections(parser: argparse.ArgumentParser, level: int, anchor_prefix: str) -> list[str]:
    formatter = parser._get_formatter()
    lines: list[str] = []
    subcommands: list[tuple[str, argparse.ArgumentParser, str]] = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {choice.dest: choice.help for choice in action._choices_actions}
                subcommands += [(name, sub, helps.get(name) or "") for name, sub in action.choices.items()]
                continue
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            rows.append(flag_row(action, formatter, anchor_prefix))
        if rows:
            title = {"options": "flags", "optional arguments": "flags",
                     "positional arguments": "arguments"}.get(group.title or "", group.title or "")
            lines += [f"{'#' * level} {text(title)[:1].upper() + text(title)[1:]}", "",
                      table(["flag", "default", "meaning"], rows)]
    for name, sub, help_text in subcommands:
        lines += [f"{'#' * level} {name}", "", text(help_text or sub.description or ""), "",
                  "```text", f"{sub.prog} [FLAGS]", "```", ""]
        lines += parser_sections(sub, level + 1, anchor_prefix=f"{name}-")
    return lines


def flag_row(action: argparse.Action, formatter: argparse.HelpFormatter, anchor_prefix: str) -> list[str]:
    if not action.option_strings:  # a positional argument: its value is all there is
        shown = code(formatter._format_args(action, action.dest))
        help_text = formatter._expand_help(action) if action.help else ""
        return [f'<span id="{anchor_prefix}{action.dest}"></span>{shown}', default(action), text(help_text)]
    names = action.option_strings
    metavar = formatter._get_default_metavar_for_optional(action)
    value = "" if action.nargs == 0 else " " + formatter._format_args(action, metavar)
    long_names = [name for name in names if name.startswith("--")] or [action.dest]
    anchors = "".join(f'<span id="{anchor_prefix}{name.lstrip("-")}"></span>' for name in long_names)
    shown = ", ".join(code(name + value) for name in names)
    help_text = formatter._expand_help(action) if action.help else ""
    return [anchors + shown, default(action), text(help_text)]


def default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value == argparse.SUPPRESS or (action.nargs == 0 and value in (False, True)):
        return ""
    if isinstance(value, (list, tuple)):
        return code(" ".join(str(v) for v in value)) if value else ""
    return code(value)
