"""``python -m zeta_fsdp plan MODEL [KEY=VALUE ...]``: argument parsing only; the work is ``planner.plan``.

MODEL is a spec (see ``model_spec``); a ``module:factory`` spec may name a module in the current
folder, as ``python -m`` would find it.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

from ..options import MIXED_PRECISION_ALIASES, SHARDING_ALIASES
from ..planner import OPTIMIZERS, plan
from .args import UsageError, choice, int_in, parse_overrides
from .model_spec import MODEL_SPEC_HELP, importable_cwd, meta_model_from_spec

HELP = "per-rank memory plan of fsdp() for a model at any world size, checked by a fake-process-group dry run"
_MAX_WORLD_SIZE = 1 << 20
# The options passed on to planner.plan(): each one's argparse dest is the keyword's name.
_PLAN_KEYWORDS = ("world_size", "shard_strat", "mp", "auto_wrap", "TransformerBlock", "rank", "replicate_size")
_PLAN_KEYWORDS += ("local_world_size", "optimizer", "dry_run", "micro_batches")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments."""
    parser.add_argument("model", metavar="MODEL", help=MODEL_SPEC_HELP + "; built on the meta device")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="factory arguments / config fields")
    size = functools.partial(int_in, 1, _MAX_WORLD_SIZE)
    parser.add_argument("--world-size", type=size("--world-size"), default=8, help="ranks (default 8)")
    strat = choice("--shard-strat", SHARDING_ALIASES, lambda t: t.strip().upper().replace("-", "_"))
    strategies = "FULL_SHARD (default), SHARD_GRAD, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2"
    parser.add_argument("--shard-strat", type=strat, default="FULL_SHARD", help=strategies)
    mp = choice("--mp", MIXED_PRECISION_ALIASES, lambda t: t.strip().lower())
    parser.add_argument("--mp", type=mp, default="fp32", help="fp32 (default), bf16, fp16")
    whole = "the whole model as one FSDP unit"
    parser.add_argument("--no-auto-wrap", dest="auto_wrap", action="store_false", help=whole)
    block = "transformer block class name (default: detected)"
    parser.add_argument("--block", dest="TransformerBlock", metavar="CLASS", help=block)
    rank = int_in(0, None, "--rank")
    parser.add_argument("--rank", type=rank, default=0, help="rank to report (default 0, the largest)")
    parser.add_argument("--replicate-size", type=size("--replicate-size"), help="HYBRID replicas")
    per_node = "HYBRID: one replica per node (default 8)"
    gpus = size("--gpus-per-node")
    parser.add_argument("--gpus-per-node", dest="local_world_size", type=gpus, metavar="N", help=per_node)
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default="adamw")
    parser.add_argument(
        "--micro-batches",
        type=size("--micro-batches"),
        metavar="K",
        help="also compare the no_sync choices for accumulating K micro-batches (gradient bytes, collectives)",
    )
    no_dry_run = "skip the fake-process-group run of fsdp()"
    parser.add_argument("--no-dry-run", dest="dry_run", action="store_false", help=no_dry_run)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    """Build the model on ``meta``, plan it (with a dry run unless ``--no-dry-run``), print the report.
    Returns 1 when the dry run disagrees with the plan or fails, 0 otherwise."""
    overrides = parse_overrides(args.overrides)
    try:
        with importable_cwd():  # the model's module, and the dry run's subprocess, may import from here
            model = meta_model_from_spec(args.model, overrides)
            result = plan(model, **{name: getattr(args, name) for name in _PLAN_KEYWORDS})
    except ValueError as e:
        raise UsageError(str(e)) from None
    except RuntimeError as e:  # the dry-run subprocess failed
        sys.stderr.write(f"python -m zeta_fsdp plan: {e}\n")
        return 1
    print(json.dumps(result.to_dict(), indent=2, default=str) if args.json else result.report())
    return 1 if result.dry_run_matches is False else 0
