"""Cases that check the test harness itself (see ``tests/test_harness.py``): how failures report."""

from __future__ import annotations

import torch
import torch.distributed as dist
from worker import Cases, rank, run_cases

CASES = Cases()
case = CASES.case


def _sum_of_ranks() -> float:
    t = torch.tensor([float(rank())])
    dist.all_reduce(t)
    return t.item()


@case
def first_case_passes():
    assert _sum_of_ranks() == 1.0


@case
def rank0_fails_between_collectives():
    """Rank 0 fails where rank 1 goes on into a collective: rank 1 must not wait for the timeout."""
    _sum_of_ranks()
    if rank() == 0:
        raise AssertionError("rank 0 breaks on purpose")
    _sum_of_ranks()


@case
def case_after_the_failure_still_reports():
    assert _sum_of_ranks() == 1.0


@case
def every_rank_fails_alike():
    _sum_of_ranks()
    raise ValueError(f"rank {rank()} fails on purpose")


@case
def case_after_an_agreed_failure():
    assert _sum_of_ranks() == 1.0
    return {"rank": rank()}


if __name__ == "__main__":
    run_cases(CASES)
