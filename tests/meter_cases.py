"""Multi-rank cases for ``zeta_fsdp.training.StepMeter`` (real gloo ranks, the demo GPT under ``fsdp()``)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from worker import SEQ, Cases, rank, run_cases, tokens, world

from zeta_fsdp import fsdp
from zeta_fsdp.models.gpt import Block, lm_loss, small
from zeta_fsdp.training import StepMeter, training_flops_per_token

CASES = Cases()
case = CASES.case


def _train(meter: StepMeter, steps: int, delay_rank: int = -1, delay_s: float = 0.0) -> list:
    torch.manual_seed(0)
    model = fsdp(small(), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    reports = []
    for step in range(steps):
        x, y = tokens(2, seed=step + 100 * rank())
        if rank() == delay_rank:
            time.sleep(delay_s)  # a slow data loader on one rank
        report = meter.step(tokens=x.numel())
        if report is not None:
            reports.append(report)
        lm_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    reports.append(meter.finish())
    return reports


@case
def meter_names_the_rank_that_sleeps():
    lines: list[str] = []
    meter = StepMeter(every=3, log=lines.append)
    reports = _train(meter, steps=7, delay_rank=1, delay_s=0.4)
    assert [r.step for r in reports] == [3, 6, 7] and [r.steps for r in reports] == [3, 3, 1], reports
    for r in reports[:2]:  # rank 1 sleeps 0.4 s before each step; the others wait for it in the step
        assert r.slowest_rank == 1, r
        assert 0.3 < r.slowest_lag_ms / 1000 < 2.0, r
    gathered: list = [None] * world()
    dist.all_gather_object(gathered, [(r.slowest_rank, r.tokens_per_s) for r in reports])
    assert all(g == gathered[0] for g in gathered), gathered  # every rank got the same report
    if rank() == 0:
        assert len(lines) == 3 and lines[0].startswith("zeta_fsdp step=3 step_ms="), lines
        assert " slowest_rank=1 slowest_lag_ms=" in lines[0], lines
    else:
        assert lines == [], lines  # rank 0 alone logs


@case
def meter_tokens_and_mfu_add_up_over_ranks():
    model = small()
    fpt = training_flops_per_token(model)
    meter = StepMeter(every=2, flops_per_token=fpt, peak_flops=1e9, log=None)
    reports = _train(meter, steps=4)
    per_rank_tokens = 2 * SEQ  # tokens(2, ...): 2 sequences of SEQ tokens
    for r in reports[:2]:
        seconds = r.step_ms / 1000 * r.steps
        # every rank's tokens are counted: the global rate, step time from the same window
        assert abs(r.tokens_per_s * seconds - world() * per_rank_tokens * r.steps) < 1e-9 * r.tokens_per_s, r
        assert abs(r.mfu - r.tokens_per_s / world() * fpt / 1e9) < 1e-12, r
        assert r.peak_mem_mib > 10 and r.peak_reserved_mib is None, r  # CPU: peak RSS of the worst rank


if __name__ == "__main__":
    run_cases(CASES)
