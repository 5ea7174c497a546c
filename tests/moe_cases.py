"""Ranks that use different parameters in one step (mixture of experts), on real gloo ranks.

Routing follows token ids (``moe_models.routed_batch``): at 2 ranks rank 0's tokens reach experts
{0, 1} and rank 1's {2, 3}; at 4 ranks rank ``r``'s reach expert ``r``. So every rank leaves some
experts unused, and each expert's true gradient comes from other ranks alone. The reference is a
``copy.deepcopy`` made before wrapping, run chunk by chunk on the global batch
(``worker.reference_backward``: an expert a chunk skipped adds a zero gradient, as the ranks do).
At 2 ranks and at 2x2 every reduction adds two numbers, exact in any order: parity is ``atol=0``.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections import Counter
from typing import Optional

import torch
import torch.nn as nn
from moe_models import DIM, VOCAB, HelperMoELayer, MoEBlock, MoELM, idle_batch, moe_loss, routed_batch
from torch.distributed.fsdp import MixedPrecisionPolicy
from worker import (
    Cases,
    assert_close,
    deferred_all_reduce_reference,
    full,
    local_slice,
    mean_over_ranks,
    reference_backward,
    run_cases,
    world,
)

from zeta_fsdp import fsdp, no_sync
from zeta_fsdp.engines import fsdp_engine, get_wrap_plan

warnings.filterwarnings("ignore")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

CASES = Cases()
case = CASES.case
UNEVEN = (6, 10, 12, 20)  # experts of different sizes: each one's flat gradient a different length


def _experts_used(x: torch.Tensor, n_experts: int) -> set[int]:
    return set((local_slice(x) * n_experts // VOCAB).unique().tolist())


def moe_parity(
    shard_strat: str, given: bool, hiddens: tuple = (8, 8, 8, 8), steps: int = 3, model: Optional[nn.Module] = None
) -> None:
    """Gradients after the first backward and parameters after ``steps`` AdamW steps equal the reference's."""
    torch.manual_seed(0)
    model = model if model is not None else MoELM(hiddens=hiddens)
    ref = copy.deepcopy(model)
    kwargs = {"replicate_size": 2} if shard_strat == "HYBRID_SHARD" else {}
    fsdp(model, auto_wrap=True, shard_strat=shard_strat, TransformerBlock=MoEBlock if given else None, **kwargs)
    assert [u.name for u in get_wrap_plan(model).blocks] == ["blocks.0", "blocks.1"], get_wrap_plan(model).table()
    replicas = world() if shard_strat == "NO_SHARD" else kwargs.get("replicate_size", 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_params = dict(ref.named_parameters())
    for step in range(steps):
        x, y = routed_batch(step, world())
        used = _experts_used(x, len(hiddens))
        assert len(used) < len(hiddens), f"rank uses every expert {used}: the case tests nothing"
        ref_loss = reference_backward(ref, moe_loss, x, y, replicas=replicas)
        loss = moe_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        if step == 0:
            for name, param in model.named_parameters():
                assert param.grad is not None, f"{name}: no gradient on this rank"
                assert_close(
                    f"grad {name} ({shard_strat}, experts used here {used})", param.grad, ref_params[name].grad, 0
                )
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_close(f"loss step {step}", mean_over_ranks(loss), ref_loss, 0)
    for name, param in model.named_parameters():
        assert_close(f"{name} after {steps} steps ({shard_strat})", full(param), ref_params[name], 0)


def _each(shard_strat: str) -> None:
    for hiddens in ((8, 8, 8, 8), UNEVEN):
        for given in (True, False):
            moe_parity(shard_strat, given, hiddens)


@case
def moe_full_shard():
    _each("FULL_SHARD")


@case
def moe_shard_grad():
    _each("SHARD_GRAD")


@case
def moe_no_shard():
    _each("NO_SHARD")
    torch.manual_seed(0)
    model = fsdp(MoELM(), auto_wrap=True, shard_strat="NO_SHARD")
    assert fsdp_engine(model) == "replicate", fsdp_engine(model)


@case(ranks=4)
def moe_hybrid_shard():
    _each("HYBRID_SHARD")


@case
def moe_experts_behind_a_helper():
    # experts in `self.layers` dispatched by a module-level helper: auto_wrap must keep them in their
    # block's unit (moe_parity asserts the blocks are the units) and train them right
    for given in (False, True):
        torch.manual_seed(0)
        moe_parity("FULL_SHARD", given, model=MoELM(layer=HelperMoELayer))


class GatedByRank(MoELM):
    """A 0-dim and a 1-D parameter used only when a batch holds upper-half token ids (rank 1's)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        route = ids * self.n_experts // VOCAB
        h = self.emb(ids)
        if bool((ids >= VOCAB // 2).any()):
            h = h * self.scale * self.gain
        for block in self.blocks:
            h = block(h, route)
        return self.head(self.norm(h))


@case
def parameters_used_on_one_rank():
    # rank 0 never uses scale (0-dim, kept whole by fsdp()) nor gain (1-D, sharded by the root unit)
    for shard_strat in ("FULL_SHARD", "SHARD_GRAD", "NO_SHARD"):
        torch.manual_seed(0)
        moe_parity(shard_strat, given=True, model=GatedByRank())


def _hf_moe(name: str) -> nn.Module:
    import transformers as T

    T.logging.set_verbosity_error()
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if name == "mixtral":
        cfg = T.MixtralConfig(**common, intermediate_size=24, num_local_experts=4, num_experts_per_tok=1)
        return T.MixtralForCausalLM(cfg)
    cfg = T.Qwen3MoeConfig(
        **common, intermediate_size=24, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=1, head_dim=8
    )
    return T.Qwen3MoeForCausalLM(cfg)


def hf_parity(name: str, shard_strat: str) -> None:
    """A Hugging Face MoE from a tiny config: each rank's tokens reach few experts (top-1 routing of
    a random router), gradients and 3 AdamW steps equal the reference (fused expert weights: one
    parameter per layer holds every expert, its unused rows get zero gradients)."""
    torch.manual_seed(0)
    model = _hf_moe(name).train()
    ref = copy.deepcopy(model)
    fsdp(model, auto_wrap=True, shard_strat=shard_strat)
    assert len(get_wrap_plan(model).blocks) == 2, get_wrap_plan(model).table()
    replicas = world() if shard_strat == "NO_SHARD" else 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def loss_fn(logits: object, targets: torch.Tensor) -> torch.Tensor:
        return moe_loss(logits.logits, targets)

    ref_params = dict(ref.named_parameters())
    for step in range(3):
        x, y = routed_batch(step, world())
        ref_loss = reference_backward(ref, loss_fn, x, y, replicas=replicas)
        loss = loss_fn(model(local_slice(x)), local_slice(y))
        loss.backward()
        if step == 0:
            for pname, param in model.named_parameters():
                assert_close(f"grad {pname} ({name}, {shard_strat})", param.grad, ref_params[pname].grad, 0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_close(f"loss step {step}", mean_over_ranks(loss), ref_loss, 0)
    for pname, param in model.named_parameters():
        assert_close(f"{pname} after 3 steps ({name}, {shard_strat})", full(param), ref_params[pname], 0)


@case
def hf_mixtral():
    for shard_strat in ("FULL_SHARD", "NO_SHARD"):
        hf_parity("mixtral", shard_strat)


@case
def hf_qwen3_moe():
    hf_parity("qwen3_moe", "FULL_SHARD")


# ---------------------------------------------------------------------------------------------
# Idle experts: an expert no rank's tokens reached in a step ends with `.grad is None`, as in one
# process (and under DDP), so Adam/AdamW skip it there too; experts any rank used keep exact gradients.
# Routing: moe_models.IDLE_ROUTES. Tolerance 0 throughout: the gradients are asserted bit-identical to
# the reference after every backward (2 ranks, 2x2: sums of two), and Adam/AdamW are elementwise, so
# each element runs the same arithmetic on the same numbers in both.


def _experts_of(ids: torch.Tensor, n_experts: int = 4) -> set[int]:
    return set((ids * n_experts // VOCAB).unique().tolist())


def _grads_like_reference(model: nn.Module, ref_params: dict, what: str, values: bool = True) -> int:
    """``.grad is None`` exactly where the reference's is, equal to it elsewhere (``values``); returns how
    many were None."""
    nones = 0
    for name, param in model.named_parameters():
        want = ref_params[name].grad
        if want is None:
            nones += 1
            assert param.grad is None, (
                f"{what}: {name} has a .grad (max {full(param.grad).abs().max():.1e}); no rank used it"
            )
        else:
            assert param.grad is not None, f"{what}: {name} has no .grad; the reference has one"
            if values:
                assert_close(f"{what}: grad {name}", param.grad, want, 0)
    return nones


def _idle_model(shard_strat: str, auto_wrap: bool = True) -> tuple[nn.Module, nn.Module, int]:
    """``(sharded model, reference, replicas)``: an MoELM and its copy made before wrapping."""
    torch.manual_seed(0)
    model = MoELM()
    with torch.no_grad():  # expert 0's `up` in block 0 gets an all-zero gradient where used: still used
        model.blocks[0].moe.experts[0].down.weight.zero_()
    model.blocks[1].moe.experts[2].requires_grad_(False)  # a frozen expert: no gradient, no hook
    ref = copy.deepcopy(model)
    kwargs = {"replicate_size": 2} if shard_strat == "HYBRID_SHARD" else {}
    fsdp(model, auto_wrap=auto_wrap, shard_strat=shard_strat, **kwargs)
    replicas = world() if shard_strat == "NO_SHARD" else kwargs.get("replicate_size", 1)
    return model, ref, replicas


def idle_parity(shard_strat: str, optimizer: type, steps: int = 12, auto_wrap: bool = True) -> None:
    """``steps`` steps of ``optimizer`` on ``idle_batch``: after every backward each ``.grad`` is None
    where the reference's is and equal elsewhere; the losses and the final parameters are the reference's."""
    model, ref, replicas = _idle_model(shard_strat, auto_wrap)
    what = f"{shard_strat} {optimizer.__name__}{'' if auto_wrap else ' (one unit)'}"
    opt, ref_opt = optimizer(model.parameters(), lr=1e-2), optimizer(ref.parameters(), lr=1e-2)
    ref_params = dict(ref.named_parameters())
    idle = one_rank = nones = zeros = 0
    for step in range(steps):
        x, y = idle_batch(step, world())
        ranks_of = Counter(e for r in range(world()) for e in _experts_of(local_slice(x, world(), r)))
        idle += sum(e not in ranks_of for e in range(4))
        one_rank += sum(n == 1 for n in ranks_of.values())
        ref_loss = reference_backward(ref, moe_loss, x, y, replicas=replicas)
        loss = moe_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        nones += _grads_like_reference(model, ref_params, f"{what} step {step}")
        zeros += sum(p.grad is not None and not p.grad.any() for p in ref_params.values())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_close(f"{what} loss step {step}", mean_over_ranks(loss), ref_loss, 0)
    assert idle and one_rank and nones, f"routing left no expert idle ({idle}) or on one rank ({one_rank})"
    assert zeros, "no used parameter had an all-zero gradient"
    for name, param in model.named_parameters():
        assert_close(f"{name} after {steps} steps ({what})", full(param), ref_params[name], 0)


def idle_cast_outputs(steps: int = 4) -> None:
    """Every expert in the root's unit, whose gradients FSDP2 reduces in its final callback, and outputs
    the policy casts (``output_dtype``): FSDP2's pre-backward hooks sit on the outputs before the cast,
    so its callback is queued after the one that clears unused gradients, which must still run after
    it. Values differ from the fp32 reference by the fp64 loss (the pattern of ``None`` is checked)."""
    torch.manual_seed(0)
    model = MoELM()
    ref = copy.deepcopy(model)
    fsdp(model, auto_wrap=False, mp=MixedPrecisionPolicy(output_dtype=torch.float64), shard_strat="FULL_SHARD")
    ref_params = dict(ref.named_parameters())
    nones = 0
    for step in range(steps):
        x, y = idle_batch(step, world())
        reference_backward(ref, moe_loss, x, y)
        out = model(local_slice(x))
        assert out.dtype == torch.float64, out.dtype
        moe_loss(out, local_slice(y)).backward()
        nones += _grads_like_reference(model, ref_params, f"output_dtype=float64 step {step}", values=False)
        model.zero_grad()
        ref.zero_grad()
    assert nones, "routing left no expert idle"


def idle_accumulation(shard_strat: str, defer: str, steps: int = 3) -> None:
    """Two micro-batches a step, the first under ``no_sync(defer=...)``, Adam: an expert used in one
    micro-batch only keeps its gradient, one idle in both ends with ``.grad is None``."""
    model, ref, replicas = _idle_model(shard_strat)
    what = f"{shard_strat} no_sync(defer={defer!r})"
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_params = dict(ref.named_parameters())
    seen: Counter = Counter()
    for step in range(steps):
        (x1, y1), (x2, y2) = idle_batch(2 * step, world()), idle_batch(2 * step + 1, world())
        first, second = _experts_of(x1), _experts_of(x2)
        seen.update(first=len(first - second), second=len(second - first), neither=4 - len(first | second))
        x, y = torch.cat([x1, x2]), torch.cat([y1, y2])

        def loss_fn(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            return moe_loss(out, tgt) / 2

        if defer == "all_reduce":
            deferred_all_reduce_reference(ref, loss_fn, x, y, 2, replicas)
        else:
            reference_backward(ref, loss_fn, x, y, replicas=replicas, micro_batches=2)
        with no_sync(model, defer=defer):
            loss_fn(model(local_slice(x1)), local_slice(y1)).backward()
        loss_fn(model(local_slice(x2)), local_slice(y2)).backward()
        _grads_like_reference(model, ref_params, f"{what} step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert all(seen[k] for k in ("first", "second", "neither")), f"routing misses a kind of expert: {seen}"
    for name, param in model.named_parameters():
        assert_close(f"{name} after {steps} steps ({what})", full(param), ref_params[name], 0)


def idle_after_dropped_accumulation(shard_strat: str, defer: str) -> None:
    """A micro-batch under ``no_sync`` used expert 3, then ``zero_grad()`` dropped it: a backward where
    no rank uses expert 3 leaves its ``.grad`` None (what the dropped micro-batch used does not count)."""
    model, ref, replicas = _idle_model(shard_strat)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x1, y1 = idle_batch(2, world())  # expert 3 on every rank
    x2, y2 = idle_batch(0, world())  # expert 0 only
    assert 3 in _experts_of(x1) and _experts_of(x2) == {0}
    with no_sync(model, defer=defer):
        moe_loss(model(local_slice(x1)), local_slice(y1)).backward()
    opt.zero_grad()  # drops the block's accumulation (training.pending)
    moe_loss(model(local_slice(x2)), local_slice(y2)).backward()
    reference_backward(ref, moe_loss, x2, y2, replicas=replicas)
    _grads_like_reference(model, dict(ref.named_parameters()), f"{shard_strat} defer={defer!r} after zero_grad()")


@case
def idle_experts_full_shard():
    for optimizer in (torch.optim.Adam, torch.optim.AdamW):
        idle_parity("FULL_SHARD", optimizer)
    # every expert in the root's unit: FSDP2 reduces it in its final callback, after the autograd graph
    idle_parity("FULL_SHARD", torch.optim.Adam, steps=6, auto_wrap=False)
    idle_cast_outputs()


@case
def idle_experts_shard_grad():
    for optimizer in (torch.optim.Adam, torch.optim.AdamW):
        idle_parity("SHARD_GRAD", optimizer)
    # DDP's engine (find_unused_parameters) leaves a parameter no rank used without a gradient too
    idle_parity("NO_SHARD", torch.optim.AdamW)


@case(ranks=4)
def idle_experts_hybrid_shard():
    for optimizer in (torch.optim.Adam, torch.optim.AdamW):
        idle_parity("HYBRID_SHARD", optimizer)
    for defer in ("all", "all_reduce"):  # unsharded sums held, or reduce-scattered sums awaiting the all-reduce
        idle_accumulation("HYBRID_SHARD", defer)
        idle_after_dropped_accumulation("HYBRID_SHARD", defer)


@case
def idle_experts_accumulation():
    for defer in ("all", "all_reduce"):  # on a 1-D mesh "all_reduce" reduce-scatters every micro-batch
        idle_accumulation("FULL_SHARD", defer)
        idle_after_dropped_accumulation("FULL_SHARD", defer)


if __name__ == "__main__":
    run_cases(CASES)
