"""Command line: ``python -m zeta_fsdp {demo,plan,consolidate,bench} ...``.

Bad input (unknown subcommand, bad numbers, unimportable model path) prints one line with the
accepted values and exits with code 2, never a traceback.

Example:
    $ python -m zeta_fsdp consolidate checkpoints/step_100 model.pt
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

__all__ = ["main"]


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line (usage omitted) and exit with code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


class UsageError(Exception):
    """Raised by a subcommand for bad user input: printed as one line, exit code 2."""


# name -> (help, add_arguments(parser), run(args) -> exit code). Subcommands register below.
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def register(name: str, help_text: str, add_arguments: Callable, run: Callable) -> None:
    """Add a subcommand (used by the modules that implement them)."""
    _COMMANDS[name] = (help_text, add_arguments, run)


def _build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m zeta_fsdp", description="zeta_fsdp command line")
    sub = parser.add_subparsers(dest="command", parser_class=_OneLineParser, metavar="{" + ",".join(_COMMANDS) + "}")
    sub.required = True
    for name, (help_text, add_arguments, _) in _COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def _load_commands() -> None:
    # Each subcommand registers itself from its own small module; importing registers it.
    from . import _cmd_bench, _cmd_consolidate, _cmd_demo, _cmd_plan  # noqa: F401


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m zeta_fsdp``; returns the process exit code."""
    _load_commands()
    args = _build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command][2](args)
    except UsageError as e:
        sys.stderr.write(f"python -m zeta_fsdp {args.command}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
