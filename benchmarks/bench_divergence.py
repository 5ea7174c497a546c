"""What the run-time divergence check (``fsdp(divergence_check=...)``, issue 41) costs a training step.

An 8-block LM at 2 ranks (gloo, CPU, FULL_SHARD, fp32, AdamW), three variants in ONE run: the check
on for every forward (``divergence_check=True``: the worst case, what ``ZETA_FSDP_DIVERGENCE_CHECK=always``
gives), the default (the first 2 forwards checked, then the hooks removed) and the check off. For each:
the collectives of a step after warm-up (CommDebugMode) and of the first step, and the step time in
interleaved blocks (paired ratios against the check off). Results: ``results/divergence.md`` (+ .json).

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_divergence.py
"""

from __future__ import annotations

import argparse

import torch
from _common import (
    QUICK_MODEL,
    Block,
    GPTConfig,
    ModelSpec,
    Report,
    add_timing_args,
    bench_parser,
    build_model,
    fmt_collectives,
    interleaved_block_times,
    make_batch,
    run_benchmark,
    timing_note,
    timing_table,
    train_step,
)

from zeta_fsdp import fsdp
from zeta_fsdp.measure import collectives_per_step

MODEL = ModelSpec(GPTConfig(vocab_size=2048, dim=128, n_heads=4, n_layers=8, max_seq_len=64), batch=4)
VARIANTS = {"check off": False, "default (first 2 forwards)": None, "check every forward": True}


def rank_main(args: argparse.Namespace) -> None:
    spec = QUICK_MODEL if args.quick else MODEL
    blocks, per_block = (2, 1) if args.quick else (args.blocks, args.steps_per_block)
    steps, comms = {}, {}
    for name, check in VARIANTS.items():
        model = fsdp(
            build_model(spec), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block, divergence_check=check
        )
        step = train_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), make_batch(spec))
        first = collectives_per_step(step)  # forward #1: checked unless off
        step()  # forward #2 (checked by default); warm-up
        comms[name] = (first, collectives_per_step(step))  # forward #3: checked only when on for every forward
        steps[name] = step
    times = interleaved_block_times(steps, blocks=blocks, steps_per_block=per_block, warmup=1)
    headers, rows, timing = timing_table(times, ["check off"])
    report = Report(
        name="divergence",
        title="The run-time divergence check: what it costs a step",
        command=args.command,
        what=f"{spec.describe()}; 2 CPU ranks (gloo), FULL_SHARD, fp32, AdamW; units: the blocks, embedding+head, root.",
    )
    report.table(
        "Collectives per training step (CommDebugMode)",
        ["variant", "step 1", "step 3 (after warm-up)"],
        [[n, fmt_collectives(a), fmt_collectives(b)] for n, (a, b) in comms.items()],
    )
    report.table("Step time after warm-up (the default has removed its hooks by then)", headers, rows)
    report.notes.append(timing_note(blocks, per_block))
    report.notes.append(
        "The check is one all-gather of 8 bytes per rank before each unit module's forward and one at the end of "
        "each checked forward; 'check every forward' is the cost of keeping it on for a whole run "
        "(ZETA_FSDP_DIVERGENCE_CHECK=always); the default costs that in its first 2 forwards only."
    )
    report.data.update(collectives={n: {"step1": a, "step3": b} for n, (a, b) in comms.items()}, timing=timing)
    report.publish(args.out_dir)


def main() -> None:
    parser = bench_parser(__doc__)
    add_timing_args(parser, blocks=8, steps_per_block=5)
    run_benchmark(rank_main, parser)


if __name__ == "__main__":
    main()
