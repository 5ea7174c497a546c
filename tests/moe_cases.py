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
from typing import Optional

import torch
import torch.nn as nn
from moe_models import DIM, VOCAB, HelperMoELayer, MoEBlock, MoELM, moe_loss, routed_batch
from worker import Cases, assert_close, full, local_slice, mean_over_ranks, reference_backward, run_cases, world

from zeta_fsdp import fsdp
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


if __name__ == "__main__":
    run_cases(CASES)
