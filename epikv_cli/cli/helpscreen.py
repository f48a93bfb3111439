"""``--help`` drawn with rich: usage, description, then option panels that read well at 80 columns.

Each option is one row: its names and metavar on the left (never wrapped, never cut), its help on
the right, wrapped at word boundaries, followed by its choices, default and environment variable.
Flags take no metavar; the two halves of a ``--x/--no-x`` pair stand on two lines, so the left
column stays narrow and both names stay whole.
"""

from __future__ import annotations

import inspect
from enum import Enum
from pathlib import Path
from typing import get_args, get_origin

from rich.cells import cell_len
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

NAME_STYLE = "bold cyan"
METAVAR_STYLE = "yellow"
DIM = "dim"


TYPE_METAVARS = {int: "INTEGER", float: "FLOAT", Path: "FILE"}


def _annotation(param):
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", str)
    args = get_args(annotation)
    return args[0] if get_origin(annotation) is list and args else annotation


def choices(param) -> list[str]:
    """The values an Enum-typed option accepts (empty for free-form options)."""
    annotation = _annotation(param)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return [member.value for member in annotation]
    return []


def metavar(param) -> str:
    """The placeholder shown after an option's names: its own ``metavar``, else its type (INTEGER, FLOAT, ...)."""
    if param.metavar:
        return param.metavar
    return "|".join(choices(param)) or TYPE_METAVARS.get(_annotation(param), "TEXT")


def option_names(param) -> Text:
    """``-b, --budget INTEGER``, ``-q, --quiet``, or a ``--panel/--no-panel`` pair on two lines."""
    short = [name for name in param.opts if not name.startswith("--")]
    long = [name for name in param.opts if name.startswith("--")]
    text = Text(", ".join(short + long), style=NAME_STYLE)
    for negation in param.secondary_opts:
        text.append("\n" + negation, style=NAME_STYLE)
    if not getattr(param, "is_flag", False):
        text.append(" " + metavar(param), style=METAVAR_STYLE)
    return text


def option_help(param) -> Text:
    """Help text, then choices, repeatability, default and environment variable."""
    text = Text((param.help or "").strip())
    extras = []
    if choices(param):
        extras.append(f"One of: {', '.join(choices(param))}.")
    if getattr(param, "multiple", False):
        extras.append("Repeatable.")
    if extras:
        text.append(" " + " ".join(extras))
    default = param.default.value if isinstance(param.default, Enum) else param.default
    if not getattr(param, "is_flag", False) and default not in (None, "", ()) and param.show_default is not False:
        text.append(f" [default: {default}]", style=DIM)
    if isinstance(param.envvar, str):
        text.append(f" [env: {param.envvar}]", style=DIM)
    return text


def _panel(title: str, rows: list[tuple[Text, Text]], name_width: int) -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(no_wrap=True, width=name_width)
    table.add_column(ratio=1)
    for names, help_text in rows:
        table.add_row(names, help_text)
    return Panel(table, title=title, title_align="left", border_style=DIM)


def render_help(ctx, command, environment: tuple[tuple[str, str], ...] = ()) -> str:
    """The whole help screen of ``command`` (a Typer command or group), as the terminal should show it, with an
    ``environment`` panel of (variable, meaning) rows when given."""
    usage = Text.assemble(("Usage: ", "bold"), " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)]))
    parts: list = [usage, Text("")]
    if command.help:
        parts += [Text(inspect.cleandoc(command.help).split("\n\n")[0].replace("\n", " ")), Text("")]

    params = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
    arguments = [
        (Text(p.name.upper(), style=NAME_STYLE), Text((getattr(p, "help", None) or "").strip()))
        for p in params
        if p.param_type_name == "argument"
    ]
    panels: dict[str, list[tuple[Text, Text]]] = {}
    for p in params:
        if p.param_type_name == "option":
            panels.setdefault(getattr(p, "rich_help_panel", None) or "Options", []).append(
                (option_names(p), option_help(p))
            )
    commands = []
    if hasattr(command, "list_commands"):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            commands.append((Text(name, style=NAME_STYLE), Text(sub.get_short_help_str(limit=200))))

    variables = [(Text(name, style=NAME_STYLE), Text(meaning)) for name, meaning in environment]
    rows = arguments + commands + variables + [row for group in panels.values() for row in group]
    width = max((cell_len(line) for names, _ in rows for line in names.plain.split("\n")), default=10)
    if arguments:
        parts.append(_panel("Arguments", arguments, width))
    for title, group in panels.items():
        parts.append(_panel(title, group, width))
    if commands:
        parts.append(_panel("Commands", commands, width))
    if variables:
        parts.append(_panel("Environment", variables, width))
    if command.epilog:  # a heading line, then one example command per line
        heading, *examples = [line.strip() for line in command.epilog.splitlines() if line.strip()]
        table = Table.grid(padding=(0, 1))
        table.add_column(no_wrap=True, style=DIM)
        table.add_column(ratio=1, style="green")
        for example in examples:
            table.add_row(" $", example)
        parts += [Text(heading, style="bold"), table]

    console = Console(highlight=False, soft_wrap=False)
    with console.capture() as captured:
        console.print(Group(*parts))
    return "\n".join(line.rstrip() for line in captured.get().rstrip("\n").splitlines())
