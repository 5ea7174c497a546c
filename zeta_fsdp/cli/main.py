"""``python -m zeta_fsdp {demo,plan,consolidate,doctor} ...``: the fixed table of subcommands.

Each subcommand is one module of this package with ``HELP``, ``add_arguments(parser)`` and
``run(args) -> exit code``; the table below names them (nothing registers itself on import).
Bad input (unknown subcommand, bad numbers, unimportable model path) prints one line with the
accepted values and exits with code 2, never a traceback.
"""

from __future__ import annotations

import sys
from typing import Optional

from . import consolidate, demo, doctor, plan
from .args import OneLineParser, UsageError

__all__ = ["COMMANDS", "main"]

# name -> the module implementing it, in the order ``--help`` lists them.
COMMANDS = {"demo": demo, "plan": plan, "consolidate": consolidate, "doctor": doctor}


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``python -m zeta_fsdp``; returns the process exit code."""
    parser = OneLineParser(prog="python -m zeta_fsdp", description="zeta_fsdp command line")
    metavar = "{" + ",".join(COMMANDS) + "}"
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser, metavar=metavar, required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.HELP, description=command.HELP))
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command].run(args)
    except UsageError as e:
        sys.stderr.write(f"python -m zeta_fsdp {args.command}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
