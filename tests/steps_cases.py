"""Multi-rank cases for the training step's edges (issue 28, item 5 and the non-finite step), run by ``torchrun``.

A dropped accumulation, a NaN on one rank only, empty shards and ignored parameters in clipping,
memory measuring with frozen parameters, tied weights under tensor parallel. The reference is a
``copy.deepcopy`` made before wrapping (``worker.py``'s helpers).
"""

from __future__ import annotations

import copy
import math
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from strategy_cases import MaskedLM, assert_trains_like_reference
from torch.distributed.tensor import DTensor, Replicate
from training_cases import TPNet, tp_plan
from worker import (
    ARGS,
    UNIT_ROUNDOFF,
    Cases,
    assert_close,
    assert_close_scaled,
    expect_error,
    full,
    local_slice,
    rank,
    reference_backward,
    run_cases,
    tokens,
    world,
)

from zeta_fsdp import CheckpointError, CheckpointManager, fsdp
from zeta_fsdp.measure import peak_memory_by_category
from zeta_fsdp.models.gpt import Block, lm_loss, small
from zeta_fsdp.strategy import FSDP2Strategy
from zeta_fsdp.training import NonFiniteGuard, clip_grad_norm_, drop_accumulation, no_sync

CASES = Cases()
case = CASES.case


def wrapped_gpt(**kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = small()
    ref = copy.deepcopy(model)
    return fsdp(model, **{"auto_wrap": True, "TransformerBlock": Block, **kwargs}), ref


def assert_grads_equal(model: nn.Module, ref: nn.Module, what: str, atol: float = 0.0, ulps: float = 0.0) -> None:
    """``ulps`` > 0: within that many roundings of the largest element (sums grouped differently)."""
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{what}: {name} has no gradient"
        if ulps:
            assert_close_scaled(f"{what}: grad {name}", full(param.grad), ref_params[name].grad, ulps)
        else:
            assert_close(f"{what}: grad {name}", param.grad, ref_params[name].grad, atol)


def gather(value: float) -> list[float]:
    everyone = [None] * world()
    dist.all_gather_object(everyone, value)
    return everyone


def shared_dir() -> Path:
    box = [tempfile.mkdtemp(prefix="steps_", dir=ARGS.out) if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


# ---------------------------------------------------------------------------------------------
# a dropped accumulation


def _micro(model: nn.Module, seed: int, defer: str = "all") -> None:
    """One micro-batch inside no_sync, its forward inside too (DDP's engine needs it)."""
    x, y = tokens(8, seed=seed)
    with no_sync(model, defer=defer):
        lm_loss(model(local_slice(x)), local_slice(y)).backward()


def _dropped_accumulation(shard_strat: str, replicas: int = 1, **kwargs) -> None:
    """One micro-batch inside no_sync, then zero_grad (the optimizer's, the model's, set_to_none or
    zeroed in place, or drop_accumulation), then a normal step: the step's gradients are the new
    batch's alone, exactly as the reference computes them (at 2 ranks and 2x2 every reduction level
    adds two numbers, so atol=0)."""
    for defer in ("all", "all_reduce"):
        for how in ("optimizer", "model", "in place", "drop_accumulation", "between blocks"):
            model, ref = wrapped_gpt(shard_strat=shard_strat, **kwargs)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            _micro(model, seed=3, defer=defer)
            if how == "optimizer":
                opt.zero_grad()
            elif how == "model":
                opt.zero_grad()
                model.zero_grad()
            elif how == "in place":
                opt.zero_grad(set_to_none=False)
            elif how == "drop_accumulation":
                drop_accumulation(model)
            else:  # dropped, then a new accumulation of one micro-batch inside no_sync
                opt.zero_grad()
                _micro(model, seed=5, defer=defer)
            x, y = tokens(8, seed=4)
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
            if how == "between blocks":  # the new accumulation: seed 5's micro-batch, then seed 4's
                x5, y5 = tokens(8, seed=5)
                x, y = torch.cat([x5, x]), torch.cat([y5, y])
            reference_backward(ref, lm_loss, x, y, replicas=replicas, micro_batches=len(x) // 8)
            # defer="all_reduce" reduce-scatters each micro-batch (sum of means, not the reference's mean
            # of sums): 2 micro-batches, one more rounding per level (4 at most)
            ulps = 4.0 if defer == "all_reduce" and how == "between blocks" and shard_strat != "NO_SHARD" else 0.0
            assert_grads_equal(model, ref, f"{shard_strat} defer={defer} zero_grad ({how})", ulps=ulps)
    _accumulation_kept(shard_strat, replicas, **kwargs)


def _accumulation_kept(shard_strat: str, replicas: int, **kwargs) -> None:
    """Without zero_grad the accumulation counts: three micro-batches, two of them in separate no_sync
    blocks (the third's forward inside the second block and its backward outside, on FSDP2)."""
    for defer in ("all", "all_reduce"):
        model, ref = wrapped_gpt(shard_strat=shard_strat, **kwargs)
        x, y = tokens(24, seed=6)
        parts = [(local_slice(x[8 * i : 8 * (i + 1)]), local_slice(y[8 * i : 8 * (i + 1)])) for i in range(3)]
        with no_sync(model, defer=defer):
            lm_loss(model(parts[0][0]), parts[0][1]).backward()
        with no_sync(model, defer=defer):
            out = model(parts[1][0])
            lm_loss(out, parts[1][1]).backward()
            if shard_strat != "NO_SHARD":  # FSDP2: the synced backward's forward may run inside
                out = model(parts[2][0])
        if shard_strat == "NO_SHARD":  # DDP's engine: the synced backward's forward outside, as DDP
            out = model(parts[2][0])
        lm_loss(out, parts[2][1]).backward()
        micro_ref = copy.deepcopy(ref)
        reference_backward(micro_ref, lm_loss, x, y, replicas=replicas, micro_batches=3)
        ulps = 8.0 if defer == "all_reduce" and shard_strat != "NO_SHARD" else 0.0  # 3 sums of means, as above
        assert_grads_equal(model, micro_ref, f"{shard_strat} defer={defer} accumulation kept", ulps=ulps)


@case
def dropped_accumulation_full_shard_shard_grad_no_shard():
    for strategy in ("FULL_SHARD", "SHARD_GRAD", "NO_SHARD"):
        _dropped_accumulation(strategy, replicas=world() if strategy == "NO_SHARD" else 1)


@case
def dropped_accumulation_bf16_full_shard():
    """mp="bf16": the held sum is FSDP2's fp32 accumulated gradient; zero_grad drops it, and without
    zero_grad it still counts (the step differs from the same step with nothing before it)."""
    for how in ("optimizer", "keep"):
        model, _ = wrapped_gpt(shard_strat="FULL_SHARD", mp="bf16")
        clean, _ = wrapped_gpt(shard_strat="FULL_SHARD", mp="bf16")
        _micro(model, seed=6)
        if how == "optimizer":
            torch.optim.SGD(model.parameters(), lr=0.1).zero_grad()
        x2, y2 = tokens(8, seed=7)
        lm_loss(model(local_slice(x2)), local_slice(y2)).backward()
        lm_loss(clean(local_slice(x2)), local_slice(y2)).backward()  # the same step with nothing before it
        for (name, p), q in zip(model.named_parameters(), clean.parameters()):
            diff = (full(p.grad) - full(q.grad)).abs().max().item()
            assert (diff == 0.0) == (how == "optimizer"), f"bf16 {how}: {name} differs by {diff}"


@case(ranks=4)
def dropped_accumulation_hybrid_2x2():
    _dropped_accumulation("HYBRID_SHARD", replicas=2, replicate_size=2)


# ---------------------------------------------------------------------------------------------
# clip_grad_norm_


class ValueNet(nn.Module):
    """A value head ``Linear(d, 1)``: one row, so one of two ranks holds an empty shard of its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.value = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.value(torch.relu(self.body(x)))


@case
def clip_inf_norm_with_an_empty_shard():
    torch.manual_seed(0)
    model = ValueNet()
    ref = copy.deepcopy(model)
    fsdp(model, shard_strat="FULL_SHARD")
    empty = min(gather(min(p.to_local().numel() for p in model.value.parameters())))
    assert empty == 0, "no rank holds an empty shard: the case tests nothing"
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    for norm_type, max_norm in ((float("inf"), 1e-3), (2.0, 1e-3), (1.0, 1e6)):
        model.zero_grad()
        ref.zero_grad()
        reference_backward(ref, lambda out, _: out.pow(2).mean(), x, x)
        model(local_slice(x)).pow(2).mean().backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type).item()
        got = clip_grad_norm_(model, max_norm, norm_type=norm_type)
        assert len(set(gather(got))) == 1, f"norm {norm_type}: ranks disagree {gather(got)}"
        # inf: a max, exact; p-norms: a sum of ~100 terms regrouped over 2 shards, cascade on each side
        bound = 0.0 if math.isinf(norm_type) else 20 * UNIT_ROUNDOFF
        assert abs(got - want) <= bound * want, f"norm {norm_type}: {got} vs torch {want}"
        for name, p in ref.named_parameters():
            assert_close(f"clipped {name}", model.get_parameter(name).grad, p.grad, 8 * UNIT_ROUNDOFF * want)


@case
def clip_with_ignored_params_one_norm_one_factor():
    """Ignored parameters' gradients are each rank's own (nobody reduces them), so the ranks'
    shares differ: the norm is still one number on every rank, and every rank clips by it."""
    torch.manual_seed(0)
    plain = small()
    model = fsdp(
        plain, auto_wrap=True, TransformerBlock=Block, shard_strat="FULL_SHARD", ignored_params={plain.norm.weight}
    )
    x, y = tokens(4, seed=8)
    lm_loss(model(local_slice(x)), local_slice(y)).backward()
    mine = model.norm.weight.grad.clone()
    assert len(set(gather(mine.norm().item()))) == world(), "ignored gradients equal on every rank: nothing tested"
    before = {n: full(p.grad).clone() for n, p in model.named_parameters() if isinstance(p, DTensor)}
    norm = clip_grad_norm_(model, 1e-3)
    assert len(set(gather(norm))) == 1, f"ranks disagree on the norm: {gather(norm)}"
    factor = 1e-3 / (norm + 1e-6)
    assert_close("ignored grad clipped by the one factor", model.norm.weight.grad, mine * factor, 4 * UNIT_ROUNDOFF)
    for name, want in before.items():
        assert_close(f"{name} clipped by the one factor", model.get_parameter(name).grad, want * factor, 1e-9)


# ---------------------------------------------------------------------------------------------
# memory measuring


@case
def peak_memory_with_frozen_params_both_engines():
    for shard_strat in ("NO_SHARD", "FULL_SHARD"):
        torch.manual_seed(0)
        plain = small()
        plain.blocks[0].mlp[0].weight.requires_grad_(False)
        model = fsdp(plain, auto_wrap=True, TransformerBlock=Block, shard_strat=shard_strat)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(trainable, lr=0.1)
        x, y = tokens(4, seed=9)

        def step(model=model, opt=opt, x=x, y=y):
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
            opt.step()
            opt.zero_grad()

        peak = peak_memory_by_category(model, opt, step, inputs=(x,))
        if shard_strat == "NO_SHARD":  # whole parameters; DDP's buckets: the trainable ones' gradients
            assert peak["Sharded Param"] == sum(p.numel() * 4 for p in model.parameters()), peak
            assert peak["Sharded Grad"] == sum(p.numel() * 4 for p in trainable), peak
        else:  # FSDP2's padded shards: about half of everything
            assert 0 < peak["Sharded Param"] < sum(p.numel() * 4 for p in model.parameters()), peak
        assert all(p.grad is None for p in model.parameters()), "hooks left behind"
        step()  # still trains after measuring
        assert not any(hasattr(p, "register_hook") and "register_hook" in vars(p) for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# a non-finite step on one rank only


@case
def nonfinite_step_skipped_on_every_rank_and_checkpoint_kept():
    model, ref = wrapped_gpt(shard_strat="FULL_SHARD")
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    guard = NonFiniteGuard(model)
    root = shared_dir()
    manager = CheckpointManager(root, model, opt, keep_last=1, preemption_signals=())
    for step in range(3):
        x, y = tokens(4, seed=20 + step)
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        if step == 1 and rank() == 1:
            loss = loss * float("nan")  # this rank only
        loss.backward()
        stepped = guard.step(opt, loss)
        assert gather(stepped) == [step != 1] * world(), f"step {step}: {gather(stepped)}"
        if step != 1:  # the skipped step leaves the reference alone too
            reference_backward(ref, lm_loss, x, y)
            ref_opt.step()
            ref_opt.zero_grad()
        for name, p in ref.named_parameters():
            assert_close(f"step {step} {name}", model.get_parameter(name), p, 0.0)
        if step == 0:
            manager.save(1)
    assert guard.skipped == 1 and len(set(gather(guard.skipped))) == 1
    # a diverged model (on one rank's shard only) is refused on every rank; the finite checkpoint stays
    with torch.no_grad():
        if rank() == 1:
            model.blocks[1].mlp[0].weight.to_local().fill_(float("inf"))
    message = expect_error(CheckpointError, lambda: manager.save(2), "refused", "blocks.1.mlp.0.weight", "NaN/inf")
    assert len(set(gather(message))) == 1, "the error differs between ranks"
    assert manager.latest() == root / "step_1" and not (root / "step_2").exists(), sorted(root.iterdir())
    manager.close()


@case
def strategy_skip_nonfinite_option():
    torch.manual_seed(0)
    model = small()
    ref = copy.deepcopy(model)
    strategy = FSDP2Strategy(TransformerBlock=Block, skip_nonfinite=True)
    strategy.connect(model)
    strategy.setup_optimizers(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = tokens(4, seed=30)
    batch = {"input_ids": local_slice(x), "labels": local_slice(y)}
    strategy.training_step(batch).backward()
    if rank() == 0:
        next(p for p in strategy.model.parameters() if p.grad is not None).grad.to_local().fill_(float("nan"))
    strategy.optimizer_step(max_norm=1.0)
    assert strategy.skipped_steps == 1 and int(strategy.current_epoch_step) == 0, strategy.skipped_steps
    assert all(p.grad is None for p in strategy.model.parameters()), "gradients of the skipped step kept"
    for name, p in ref.named_parameters():
        assert_close(f"skipped: {name}", strategy.model.get_parameter(name), p, 0.0)
    strategy.training_step(batch).backward()
    strategy.optimizer_step()
    assert strategy.skipped_steps == 1 and int(strategy.current_epoch_step) == 1
    expect_error(ValueError, lambda: FSDP2Strategy(skip_nonfinite="yes"), "skip_nonfinite", "'yes'")


@CASES.case
def strategy_meter_every_reports_global_tokens():
    """FSDP2Strategy(meter_every=2): a StepMeter report after every 2 optimizer steps, counting every
    micro-batch's tokens on every rank (2 steps x 2 micro-batches x world x local tokens)."""
    strategy = FSDP2Strategy(TransformerBlock=Block, meter_every=2)
    strategy.connect(small())
    strategy.setup_optimizers(lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    x, y = tokens(4, seed=31)
    batch = {"input_ids": local_slice(x), "labels": local_slice(y)}
    for _ in range(3):
        for _ in range(2):
            strategy.training_step(batch).backward()
        strategy.optimizer_step()
    report = strategy.meter.last
    assert report is not None and report.steps == 2, report
    counted = report.tokens_per_s * report.step_ms * report.steps / 1000
    want = 2 * 2 * world() * batch["input_ids"].numel()
    assert abs(counted - want) <= 1e-6 * want, (counted, want)
    expect_error(ValueError, lambda: FSDP2Strategy(meter_every=0), "meter_every", "0")


# ---------------------------------------------------------------------------------------------
# tied weights under tensor parallel


class TiedTPNet(TPNet):
    def __init__(self) -> None:
        super().__init__(vocab=37)
        self.head.weight = self.emb.weight


def tied_plan() -> dict:
    from torch.distributed.tensor.parallel import RowwiseParallel

    return {**tp_plan(), "emb": RowwiseParallel(input_layouts=Replicate())}


@case(ranks=4)
def tied_head_survives_tensor_parallel_dp2_tp2():
    torch.manual_seed(0)
    model = TiedTPNet()
    ref = copy.deepcopy(model)
    strategy = FSDP2Strategy(tensor_parallel_size=2, tp_plan=tied_plan())
    strategy.connect(model)
    strategy.parallelize()
    assert strategy.model.head.weight is strategy.model.emb.weight, "untied by parallelize()"
    assert_trains_like_reference(strategy, ref, 3, world() // 2, max_norm=0.5, data=MaskedLM(vocab=37))
    assert strategy.model.head.weight is strategy.model.emb.weight, "untied by training"
    # a plan that shards the head but not the embedding it is tied to: refused before any change
    untouched = TiedTPNet()
    bad = FSDP2Strategy(tensor_parallel_size=2, tp_plan=tp_plan())
    bad.connect(untouched)
    expect_error(ValueError, bad.parallelize, "emb.weight", "head.weight", "tied", "RowwiseParallel")
    assert not any(isinstance(p, DTensor) for p in untouched.parameters()), "the module changed before the error"


if __name__ == "__main__":
    run_cases(CASES)
