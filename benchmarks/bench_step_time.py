"""Step time: fsdp() vs hand-written ``fully_shard`` vs DistributedDataParallel, same model, same run.

Four variants of one GPT, all from the same initial weights and trained on the same per-rank
batch, timed in interleaved blocks at 2 ranks on CPU (gloo):
  * ``fsdp() FULL_SHARD``: ``fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)``;
  * ``hand-written``: per-unit ``fully_shard`` written by hand (the same units and policy);
  * ``fsdp() NO_SHARD``: the DDP-like strategy (2-D mesh, replicate only);
  * ``DDP``: ``torch.nn.parallel.DistributedDataParallel``, the usual baseline.

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_step_time.py
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from _common import (
    BENCH_MODEL,
    QUICK_MODEL,
    Block,
    Report,
    add_timing_args,
    bench_parser,
    build_model,
    hand_written_fully_shard,
    interleaved_block_times,
    make_batch,
    run_benchmark,
    timing_note,
    timing_table,
    train_step,
)
from torch.nn.parallel import DistributedDataParallel

from zeta_fsdp import fsdp


def rank_main(args: argparse.Namespace) -> None:
    report = Report(  # made first: it records the load average when measuring starts
        name="step_time",
        title="Step time: fsdp() vs hand-written fully_shard vs DDP",
        command=args.command,
        what=f"Same model, same run, {dist.get_world_size()} CPU ranks (gloo), fp32 unless noted.",
    )
    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    base = build_model(spec)
    models = {
        "fsdp() FULL_SHARD": fsdp(
            copy.deepcopy(base), auto_wrap=True, mp=args.mp, shard_strat="FULL_SHARD", TransformerBlock=Block
        ),
        "hand-written": hand_written_fully_shard(copy.deepcopy(base), mp=args.mp),
        "fsdp() NO_SHARD": fsdp(
            copy.deepcopy(base), auto_wrap=True, mp=args.mp, shard_strat="NO_SHARD", TransformerBlock=Block
        ),
    }
    if args.mp == "fp32":  # DDP has no parameter-dtype policy; autocast would be a different recipe
        models["DDP"] = DistributedDataParallel(copy.deepcopy(base))
    batch = make_batch(spec)
    steps = {k: train_step(m, torch.optim.AdamW(m.parameters(), lr=1e-4), batch) for k, m in models.items()}
    first_loss = {k: float(step()) for k, step in steps.items()}  # same weights, same data: equal

    blocks, per_block = (2, 1) if args.quick else (args.blocks, args.steps_per_block)
    times = interleaved_block_times(steps, blocks=blocks, steps_per_block=per_block, warmup=1 if args.quick else 3)
    references = ["hand-written"] + (["DDP"] if "DDP" in models else [])
    headers, rows, timing = timing_table(times, references)

    report.table(f"{spec.describe()}, mp={args.mp}, AdamW", headers, rows)
    report.table(
        "First-step loss (same weights and data: must agree)",
        ["variant", "loss"],
        [[k, f"{v:.6f}"] for k, v in first_loss.items()],
    )
    report.notes.append(timing_note(blocks, per_block))
    report.data.update({"model": spec.describe(), "mp": args.mp, "timing": timing, "first_loss": first_loss})
    report.publish(args.out_dir)


def main() -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--mp", default="fp32", help="mixed precision for the FSDP variants (DDP only with fp32)")
    add_timing_args(parser, blocks=100, steps_per_block=1)
    run_benchmark(rank_main, parser)


if __name__ == "__main__":
    main()
