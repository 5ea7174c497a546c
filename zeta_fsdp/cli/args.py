"""What every subcommand's argument parsing shares: one-line errors, bounded ints, named choices.

Bad input prints one line naming the bad value and what is accepted, and exits with code 2.

Example:
    >>> parse = int_in(1, 32, "--nproc")
    >>> parse("4")
    4
    >>> parse_overrides(["dim=64", "name=x"])
    {'dim': 64, 'name': 'x'}
"""

from __future__ import annotations

import argparse
import ast
import sys
from typing import Any, Callable

__all__ = ["OneLineParser", "UsageError", "choice", "int_in", "parse_overrides"]


class UsageError(Exception):
    """Raised by a subcommand for bad user input: printed as one line, exit code 2.

    Example:
        >>> raise UsageError("OUT already exists; pass --overwrite to replace it.")
        Traceback (most recent call last):
        ...
        zeta_fsdp.cli.args.UsageError: OUT already exists; pass --overwrite to replace it.
    """


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line (usage omitted) and exit with code 2.

    Example:
        >>> OneLineParser(prog="p").parse_args(["--bogus"])
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse ``type``: an int from ``low`` to ``high``, else a one-line error naming ``what``.

    Example:
        >>> int_in(1, 8, "--nproc")("9")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: --nproc must be an int from 1 to 8, got '9'
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} must be an int from {low} to {high}, got {text!r}")
        return value

    return parse


def choice(what: str, accepted: dict[str, str], normalize: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse ``type``: ``text`` whose ``normalize(text)`` is a key of ``accepted`` (kept as typed).

    Example:
        >>> choice("--mp", {"fp32": "fp32"}, str.lower)("FP32")
        'FP32'
    """

    def parse(text: str) -> str:
        if normalize(text) not in accepted:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}; accepted (case-insensitive): {', '.join(accepted)}"
            )
        return text

    return parse


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["dim=64", "name=x"]`` -> ``{"dim": 64, "name": "x"}`` (Python literals, else strings).

    Example:
        >>> parse_overrides(["n_layers=32", "tie=True"])
        {'n_layers': 32, 'tie': True}
    """
    values: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"override {item!r} is not KEY=VALUE (e.g. n_layers=32 dim=4096)")
        try:
            values[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            values[key] = raw
    return values
