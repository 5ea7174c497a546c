"""StepMeter's overhead on the demo GPT (FULL_SHARD) at 2 CPU ranks.

Run:  OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_meter.py
Two figures per ``every``: the time spent inside ``meter.step()`` (report steps included) as a share
of the training time, and the median step time with and without the meter (interleaved runs).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from zeta_fsdp import fsdp, shutdown
from zeta_fsdp.models.gpt import Block, lm_loss, small
from zeta_fsdp.training import StepMeter

STEPS, ROUNDS = 60, 3


def run(every: int) -> tuple[float, float]:
    """(seconds inside meter.step / total seconds, median step seconds); every=0: no meter."""
    torch.manual_seed(0)
    model = fsdp(small(), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meter = StepMeter(every=every, log=None) if every else None
    x = torch.randint(0, model.cfg.vocab_size, (4, 13), generator=torch.Generator().manual_seed(dist.get_rank()))
    inside, steps, start = 0.0, [], time.perf_counter()
    for _ in range(STEPS):
        t0 = time.perf_counter()
        if meter is not None:
            meter.step(tokens=x[:, :-1].numel())
            inside += time.perf_counter() - t0
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
        steps.append(time.perf_counter() - t0)
    return inside / (time.perf_counter() - start), statistics.median(steps[5:])


def main() -> None:
    torch.set_num_threads(1)
    results: dict[int, list] = {0: [], 10: [], 50: []}
    for _ in range(ROUNDS):
        for every in results:
            results[every].append(run(every))
    if dist.get_rank() == 0:
        base = statistics.median(m for _, m in results[0])
        lines = ["| every | time inside meter.step | median step ms | vs no meter |", "|---|---|---|---|"]
        for every, runs in results.items():
            share = statistics.median(s for s, _ in runs)
            median = statistics.median(m for _, m in runs)
            label = "no meter" if every == 0 else str(every)
            lines.append(
                f"| {label} | {share * 100:.3f} % | {median * 1000:.2f} | {(median / base - 1) * 100:+.1f} % |"
            )
        print("\n".join(lines))
        sys.stdout.flush()
    shutdown()


if __name__ == "__main__":
    main()
