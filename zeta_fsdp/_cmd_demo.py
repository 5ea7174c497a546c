"""`python -m zeta_fsdp demo`: argument parsing only; the work lives in the library modules."""

from __future__ import annotations

import argparse
import sys

from .cli import UsageError, register
from .options import MIXED_PRECISION_ALIASES

_HELP = (
    "train a small GPT under every sharding strategy on local ranks and compare "
    "(CUDA/nccl with a GPU per rank, else CPU/gloo)"
)


def _int_in(low: int, high: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} must be an int from {low} to {high}, got {text!r}")
        return value

    return parse


def _mp(text: str) -> str:
    if text.lower() not in MIXED_PRECISION_ALIASES:
        raise argparse.ArgumentTypeError(
            f"unknown mp {text!r}; accepted (case-insensitive): {', '.join(MIXED_PRECISION_ALIASES)}"
        )
    return text


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from .demo import MAX_NPROC, MAX_STEPS

    parser.add_argument(
        "--nproc", type=_int_in(1, MAX_NPROC, "--nproc"), default=2, help="local ranks to launch (default 2)"
    )
    parser.add_argument(
        "--steps", type=_int_in(1, MAX_STEPS, "--steps"), default=8, help="training steps per strategy (default 8)"
    )
    parser.add_argument("--mp", type=_mp, default="fp32", help="mixed precision: fp32 (default), bf16, fp16")
    parser.add_argument("--plot", metavar="OUT.png", help="also write a bar chart of memory per strategy (matplotlib)")


def _run(args: argparse.Namespace) -> int:
    from .demo import DemoError, format_table, run_demo

    try:
        result = run_demo(nproc=args.nproc, steps=args.steps, mp=args.mp, plot=args.plot, log=sys.stderr)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except DemoError as e:
        sys.stderr.write(f"python -m zeta_fsdp demo: {e}\n")
        return 1
    print(format_table(result))
    if args.plot:
        print(f"memory chart written to {args.plot}")
    return 0


register("demo", _HELP, _add_arguments, _run)
