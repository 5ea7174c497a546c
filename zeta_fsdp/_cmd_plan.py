"""`python -m zeta_fsdp plan`: argument parsing only; the work lives in the library modules."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from typing import Any

from .cli import UsageError, register
from .options import MIXED_PRECISION_ALIASES, SHARDING_ALIASES

_HELP = "per-rank memory plan of fsdp() for a model at any world size, checked by a fake-process-group dry run"
_MAX_WORLD_SIZE = 1 << 20


def _positive_int(what: str, high: int = _MAX_WORLD_SIZE):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not 1 <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} must be an int from 1 to {high}, got {text!r}")
        return value

    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"--rank must be an int >= 0, got {text!r}")
    return value


def _choice(what: str, accepted: dict[str, str], normalize):
    def parse(text: str) -> str:
        if normalize(text) not in accepted:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {text!r}; accepted (case-insensitive): {', '.join(accepted)}"
            )
        return text

    return parse


def _overrides(items: list[str]) -> dict[str, Any]:
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


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from .planner import MODEL_SPEC_HELP, OPTIMIZERS

    parser.add_argument("model", metavar="MODEL", help=MODEL_SPEC_HELP + "; built on the meta device")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="factory arguments / config fields")
    parser.add_argument("--world-size", type=_positive_int("--world-size"), default=8, help="ranks (default 8)")
    parser.add_argument(
        "--shard-strat",
        type=_choice("--shard-strat", SHARDING_ALIASES, lambda t: t.strip().upper().replace("-", "_")),
        default="FULL_SHARD",
        help="FULL_SHARD (default), SHARD_GRAD, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2",
    )
    parser.add_argument(
        "--mp",
        type=_choice("--mp", MIXED_PRECISION_ALIASES, lambda t: t.strip().lower()),
        default="fp32",
        help="fp32 (default), bf16, fp16",
    )
    parser.add_argument("--no-auto-wrap", action="store_true", help="the whole model as one FSDP unit")
    parser.add_argument("--block", metavar="CLASS", help="transformer block class name (default: detected)")
    parser.add_argument("--rank", type=_non_negative_int, default=0, help="rank to report (default 0, the largest)")
    parser.add_argument("--replicate-size", type=_positive_int("--replicate-size"), help="HYBRID replicas")
    parser.add_argument(
        "--gpus-per-node", type=_positive_int("--gpus-per-node"), help="HYBRID: one replica per node (default 8)"
    )
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    parser.add_argument("--no-dry-run", action="store_true", help="skip the fake-process-group run of fsdp()")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _run(args: argparse.Namespace) -> int:
    from .planner import meta_model_from_spec, plan

    overrides = _overrides(args.overrides)
    try:
        model = meta_model_from_spec(args.model, overrides)
        result = plan(
            model,
            args.world_size,
            shard_strat=args.shard_strat,
            mp=args.mp,
            auto_wrap=not args.no_auto_wrap,
            TransformerBlock=args.block,
            rank=args.rank,
            replicate_size=args.replicate_size,
            local_world_size=args.gpus_per_node,
            optimizer=args.optimizer,
            dry_run=not args.no_dry_run,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    except RuntimeError as e:  # the dry-run subprocess failed
        sys.stderr.write(f"python -m zeta_fsdp plan: {e}\n")
        return 1
    print(json.dumps(result.to_dict(), indent=2, default=str) if args.json else result.report())
    return 1 if result.dry_run_matches is False else 0


register("plan", _HELP, _add_arguments, _run)
