"""What ``set_reduce_scatter_unused_params(True)`` (which ``fsdp()`` turns on for every unit) costs.

A dense model (every parameter used on every rank, the common case) with the setting on (what
``fsdp()`` does) and off (FSDP2's default), in ONE run at 2 ranks (gloo, CPU, FULL_SHARD, fp32,
AdamW): the collectives of one step (CommDebugMode), the peak memory per rank over one step
(FSDPMemTracker) and the step time in interleaved blocks (paired ratios). The setting only acts
when a rank holds a parameter without a gradient, so a dense model should see no difference.
Results: ``results/unused_params.md``.

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_unused_params.py
"""

from __future__ import annotations

import argparse
import datetime

import torch
from _common import (
    BENCH_MODEL,
    Block,
    add_timing_args,
    bench_parser,
    build_model,
    fmt_collectives,
    interleaved_block_times,
    is_rank0,
    machine_info,
    make_batch,
    run_benchmark,
    timing_note,
    timing_table,
    train_step,
)

from zeta_fsdp import fsdp
from zeta_fsdp.measure import collectives_per_step, peak_memory_by_category

VARIANTS = {"fsdp() (unused params reduced: on)": True, "same, setting off (FSDP2 default)": False}


def rank_main(args: argparse.Namespace) -> None:
    spec = BENCH_MODEL
    steps, rows = {}, []
    for name, on in VARIANTS.items():
        model = fsdp(build_model(spec), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
        model.set_reduce_scatter_unused_params(on)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = train_step(model, opt, make_batch(spec))
        step()
        comms = collectives_per_step(step)
        peak = peak_memory_by_category(model, opt, step)["Total"]
        steps[name] = step
        rows.append((name, comms, peak))
    times = interleaved_block_times(steps, blocks=args.blocks, steps_per_block=args.steps_per_block)
    headers, timing_rows, _ = timing_table(times, [next(iter(VARIANTS))])
    if not is_rank0():
        return
    info = machine_info()
    lines = [
        "# set_reduce_scatter_unused_params: what it costs a dense model",
        "",
        f"{spec.describe()}; 2 CPU ranks (gloo), FULL_SHARD, fp32, AdamW.",
        "",
        "Reproduce (from the repository root):",
        "",
        "```bash",
        args.command,
        "```",
        "",
        f"- torch {torch.__version__}; {info.get('cpu', '')}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        "| variant | collectives / step | peak MiB (rank 0, FSDPMemTracker) |",
        "|---|---|---|",
    ]
    lines += [f"| {n} | {fmt_collectives(c)} | {p / 2**20:.3f} |" for n, c, p in rows]
    lines += ["", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in timing_rows]
    lines += ["", timing_note(args.blocks, args.steps_per_block)]
    (args.out_dir / "unused_params.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = bench_parser(__doc__)
    add_timing_args(parser, blocks=8, steps_per_block=5)
    run_benchmark(rank_main, parser)


if __name__ == "__main__":
    main()
