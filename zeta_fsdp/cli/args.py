"""What every subcommand's argument parsing shares: one-line errors, bounded ints, named choices.

Bad input prints one line naming the bad value and what is accepted, and exits with code 2.
"""

from __future__ import annotations

import argparse
import ast
import sys
from typing import Any, Callable, Optional

__all__ = ["OneLineParser", "UsageError", "choice", "int_in", "parse_overrides"]


class UsageError(Exception):
    """Raised by a subcommand for bad user input: printed as one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line (usage omitted) and exit with code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def int_in(low: int, high: Optional[int], what: str) -> Callable[[str], int]:
    """An argparse ``type``: an int from ``low`` to ``high`` (``None``: no bound), else a one-line error naming ``what``."""
    accepted = f"an int >= {low}" if high is None else f"an int from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{what} must be {accepted}, got {text!r}")
        return value

    return parse


def choice(what: str, accepted: dict[str, str], normalize: Callable[[str], str]) -> Callable[[str], str]:
    """An argparse ``type``: ``text`` whose ``normalize(text)`` is a key of ``accepted`` (kept as typed)."""

    def parse(text: str) -> str:
        if normalize(text) not in accepted:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}; accepted (case-insensitive): {', '.join(accepted)}"
            )
        return text

    return parse


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["dim=64", "name=x"]`` -> ``{"dim": 64, "name": "x"}`` (Python literals, else strings)."""
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
