"""Measure what the planner predicts, on real gloo ranks (run by ``torchrun``, see test_planner.py).

For each case (strategy x mp x tied/untied demo GPT) every rank trains one warm-up step, then
tracks one step with ``FSDPMemTracker`` and records, by category:
  * ``current``: the snapshot right after ``optimizer.step()`` (steady state: sharded parameters,
    sharded gradients and optimizer state all exist),
  * ``max``: each category's maximum over the step, plus ``"UP+AG"``, the maximum of unsharded
    parameters + all-gather buffers alive at the same moment (the planner's all-gather peak).
Results go to ``--out``/rank{N}.json as ``{case: {"current": ..., "max": ...} | traceback}`` (the
main loop is ``worker.run_cases``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor
from worker import SEQ, Cases, rank, run_cases

from zeta_fsdp import fsdp, fsdp_engine
from zeta_fsdp.measure import gradient_bucket_bytes, memtracker_categories, restore_fsdp_hooks
from zeta_fsdp.models.gpt import lm_loss, small

BATCH = 4


class MeasureCases(Cases):
    """The named cases, and any ``"<strategy>-<mp>-<tied|untied>"`` name: ``measure`` that configuration."""

    def __missing__(self, name: str) -> Callable[[], dict]:
        return lambda: measure(name)


CASES = MeasureCases()


def parse_case(name: str) -> tuple[str, str, bool]:
    """``"FULL_SHARD-fp32-tied"`` -> (strategy, mp, tied)."""
    strategy, mp, tie = name.split("-")
    return strategy, mp, tie == "tied"


def build(strategy: str, mp: str, tied: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    extra = {"replicate_size": 2} if strategy.startswith("HYBRID") else {}
    model = fsdp(small(tie_weights=tied), auto_wrap=True, mp=mp, shard_strat=strategy, **extra)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def measure(name: str) -> dict:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    model, opt = build(*parse_case(name))
    tokens = torch.randint(0, 37, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank()))

    def forward_backward():
        lm_loss(model(tokens[:, :-1]).float(), tokens[:, 1:]).backward()

    forward_backward()  # warm-up: optimizer state exists before the tracked step
    opt.step()
    opt.zero_grad()
    maxima: dict[str, int] = {}
    replicated = fsdp_engine(model) == "replicate"
    # DDP's engine (NO_SHARD, fp32): MemTracker under FSDPMemTracker's names; the gradient
    # buckets DDP made at the warm-up forward are resident, added to "Sharded Grad".
    buckets = {"Sharded Grad": gradient_bucket_bytes(model)} if replicated else {}
    with restore_fsdp_hooks(model):
        if replicated:
            tracker = MemTracker()
            tracker.track_external(model, opt, tokens)
        else:
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((tokens,))
        update = tracker._update_peak_stats

        def snapshot() -> dict[str, int]:
            snap = memtracker_categories(next(iter(tracker.get_tracker_snapshot("current").values())))
            return {k: snap.get(k, 0) + buckets.get(k, 0) for k in {*snap, *buckets}}

        # The tracker keeps only the snapshot at the total peak; record each category's own
        # maximum too (called after every op it tracks).
        def update_and_record(state):
            update(state)
            snap = snapshot()
            snap["UP+AG"] = snap.get("Unsharded Param", 0) + snap.get("All Gather", 0)
            for k, v in snap.items():
                maxima[k] = max(maxima.get(k, 0), v)

        tracker._update_peak_stats = update_and_record
        with tracker:
            forward_backward()
            opt.step()
            current = snapshot()
            opt.zero_grad()
    return {"current": current, "max": maxima}


@CASES.case
def tied_group_residency() -> dict:
    """Without a tracker: is the tied [embedding, head] unit unsharded while the blocks run?"""
    model, _ = build("FULL_SHARD", "fp32", True)
    seen = {}

    def probe(module, args):
        seen["head_sharded"] = isinstance(model.head.weight, DTensor)
        seen["block0_sharded"] = isinstance(model.blocks[0].attn.qkv.weight, DTensor)

    model.blocks[1].register_forward_pre_hook(probe)
    tokens = torch.randint(0, 37, (BATCH, SEQ))
    model(tokens).sum().backward()
    return {"current": seen, "max": {}}


if __name__ == "__main__":
    run_cases(CASES)
