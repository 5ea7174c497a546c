"""Gradient accumulation with ``no_sync`` and the cost of ``FSDP2Strategy`` over a plain ``fsdp()`` loop.

Two comparisons, each in one run at 2 CPU ranks (gloo), variants interleaved block by block:

1. ``no_sync`` over K=4 micro-batches: one optimizer step = 4 forward/backward passes, the
   first 3 inside ``zeta_fsdp.training.no_sync`` (no gradient reduce-scatter), vs the same 4
   passes each reducing its gradients. Collectives per optimizer step (``CommDebugMode``) and
   the step-time ratio.
2. ``FSDP2Strategy`` step (``training_step`` + ``backward`` + ``optimizer_step``) vs the loop a
   user writes around ``fsdp()`` (same units, same policy, same data). Two references: the plain
   loop with a per-rank mean cross-entropy (what users write), and the plain loop with the same
   ``MaskedTokenLossReduction`` the strategy uses (isolates the strategy's own overhead from the
   token-weighted loss, which costs one all-reduce of one number per micro-batch).

Run:
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_training.py
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import (  # noqa: E402
    BENCH_MODEL,
    QUICK_MODEL,
    Block,
    ModelSpec,
    Report,
    add_timing_args,
    bench_parser,
    build_model,
    interleaved_block_times,
    is_rank0,
    lm_loss,
    make_batch,
    run_benchmark,
    timing_note,
    timing_table,
)

from zeta_fsdp import fsdp  # noqa: E402
from zeta_fsdp.loss import MaskedTokenLossReduction  # noqa: E402
from zeta_fsdp.measure import collectives_per_step  # noqa: E402
from zeta_fsdp.strategy import FSDP2Strategy  # noqa: E402
from zeta_fsdp.training import no_sync  # noqa: E402

K = 4


def _wrap(spec: ModelSpec) -> torch.nn.Module:
    return fsdp(build_model(spec), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)


def accumulation_steps(spec: ModelSpec) -> dict[str, list[Callable[[], Any]]]:
    """One optimizer step over K micro-batches, with and without ``no_sync``, as a list of phases.

    Phases (each micro-batch, then the optimizer step) run one after another; they are kept
    apart so collectives can be counted phase by phase (``CommDebugMode``'s module tracker in
    torch 2.13 loses its place across several forward/backward passes in one context).
    """
    micro = [make_batch(spec, seed=10 + k) for k in range(K)]
    steps = {}
    for name, skip in (("no_sync (K-1 of K skipped)", True), ("reduce every micro-batch", False)):
        model = _wrap(spec)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        phases: list[Callable[[], Any]] = []
        for k, (x, y) in enumerate(micro):

            def micro_step(model=model, x=x, y=y, quiet=skip and k < K - 1) -> None:
                with no_sync(model) if quiet else contextlib.nullcontext():
                    (lm_loss(model(x), y) / K).backward()

            phases.append(micro_step)

        def optimizer_step(opt=opt) -> None:
            opt.step()
            opt.zero_grad(set_to_none=True)

        phases.append(optimizer_step)
        steps[name] = phases
    return steps


def _run_all(phases: list[Callable[[], Any]]) -> Callable[[], None]:
    def step() -> None:
        for phase in phases:
            phase()

    return step


def strategy_steps(spec: ModelSpec) -> dict[str, Callable[[], Any]]:
    """One optimizer step: the strategy vs plain fsdp() loops on the same model and data."""
    x, y = make_batch(spec, seed=3)
    batch = {"input_ids": x, "labels": y}
    base = build_model(spec)
    steps = {}

    plain = fsdp(copy.deepcopy(base), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    def plain_step() -> None:
        lm_loss(plain(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    weighted = fsdp(copy.deepcopy(base), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    weighted_opt = torch.optim.AdamW(weighted.parameters(), lr=1e-4)
    reduction = MaskedTokenLossReduction()

    def weighted_step() -> None:
        loss, _ = reduction.forward(batch, weighted(x))
        loss.backward()
        weighted_opt.step()
        weighted_opt.zero_grad(set_to_none=True)

    strategy = FSDP2Strategy(TransformerBlock=Block)
    strategy.connect(copy.deepcopy(base))
    strategy.setup_optimizers(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))

    def strategy_step() -> None:
        strategy.training_step(batch).backward()
        strategy.optimizer_step()

    steps["plain fsdp() loop"] = plain_step
    steps["plain fsdp() + token-weighted loss"] = weighted_step
    steps["FSDP2Strategy"] = strategy_step
    return steps


def _counts(phases: list[Callable[[], Any]]) -> dict[str, int]:
    """Collectives of one optimizer step, counted phase by phase and summed."""
    total: dict[str, int] = {}
    for phase in phases:
        for op, n in collectives_per_step(phase).items():
            total[op.strip("_")] = total.get(op.strip("_"), 0) + n
    return dict(sorted(total.items()))


def rank_main(args: argparse.Namespace) -> None:
    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    blocks, per_block = (2, 1) if args.quick else (args.blocks, args.steps_per_block)
    warmup = 1 if args.quick else 2

    acc = accumulation_steps(spec)
    acc_counts = {name: _counts(phases) for name, phases in acc.items()}
    acc_steps = {name: _run_all(phases) for name, phases in acc.items()}
    acc_times = interleaved_block_times(acc_steps, blocks=blocks, steps_per_block=per_block, warmup=warmup)
    acc_headers, acc_rows, acc_timing = timing_table(acc_times, ["reduce every micro-batch"])

    strat = strategy_steps(spec)
    strat_counts = {name: _counts([step]) for name, step in strat.items()}
    strat_times = interleaved_block_times(strat, blocks=blocks, steps_per_block=per_block, warmup=warmup)
    strat_headers, strat_rows, strat_timing = timing_table(
        strat_times, ["plain fsdp() loop", "plain fsdp() + token-weighted loss"]
    )

    report = Report(
        name="training",
        title="Gradient accumulation with no_sync; FSDP2Strategy vs a plain fsdp() loop",
        command=args.command,
        what=(
            f"Same model, same run, {dist.get_world_size()} CPU ranks (gloo), FULL_SHARD, fp32, AdamW. "
            f"{spec.describe()}."
        ),
    )
    ops = sorted({op for c in list(acc_counts.values()) + list(strat_counts.values()) for op in c})
    report.table(
        f"Collectives per optimizer step, K={K} micro-batches (CommDebugMode)",
        ["variant", *ops, "total"],
        [[n, *(str(c.get(op, 0)) for op in ops), str(sum(c.values()))] for n, c in acc_counts.items()],
    )
    report.table(f"Step time per optimizer step (K={K} micro-batches)", acc_headers, acc_rows)
    report.table(
        "Collectives per optimizer step: strategy vs plain loops",
        ["variant", *ops, "total"],
        [[n, *(str(c.get(op, 0)) for op in ops), str(sum(c.values()))] for n, c in strat_counts.items()],
    )
    report.table("Step time: FSDP2Strategy vs plain fsdp() loops (1 micro-batch per step)", strat_headers, strat_rows)
    report.notes.append(timing_note(blocks, per_block))
    report.notes.append(
        "The token-weighted loss adds one all-reduce of one number per micro-batch (the global token count "
        "that scales the backward loss); the strategy adds no collective of its own beyond it."
    )
    report.data.update(
        {
            "model": spec.describe(),
            "k": K,
            "accumulation": {"collectives": acc_counts, "timing": acc_timing},
            "strategy": {"collectives": strat_counts, "timing": strat_timing},
        }
    )
    if is_rank0():
        path = report.write(args.out_dir)
        print(report.markdown())
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__.splitlines()[0])
    add_timing_args(parser, blocks=30, steps_per_block=2)
    run_benchmark(rank_main, parser, argv)


if __name__ == "__main__":
    main()
