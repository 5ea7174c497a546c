"""Multi-rank cases of "one start on every rank" (``zeta_fsdp.start``), run by ``torchrun``.

Each rank seeds itself differently before building the model (``torch.manual_seed(1337 + rank)``:
nanoGPT's and most DDP scripts' habit). Whatever ``shard_strat``, ``fsdp()`` must start every rank
from rank 0's weights, parameters and buffers, as DDP does; a ``meta`` model must come out the same
on every replica, decided by rank 0's seed. The reference is a ``copy.deepcopy`` made before
wrapping, with rank 0's copy broadcast to every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from worker import (
    Cases,
    assert_close,
    expect_error,
    full,
    global_batch,
    local_slice,
    mean_over_ranks,
    rank,
    reference_backward,
    run_cases,
    world,
)

from zeta_fsdp import fsdp
from zeta_fsdp.distributed import build_mesh, init_mesh
from zeta_fsdp.measure import collectives_per_step
from zeta_fsdp.models.gpt import GPT, Block, GPTConfig, lm_loss
from zeta_fsdp.options import resolve_sharding
from zeta_fsdp.start import start_from_first_rank

CASES = Cases()
case = CASES.case


class GPTWithOddTensors(GPT):
    """The test GPT (tied embedding/head, a bool causal mask) plus what a sync must carry bit for bit:
    buffers drawn at random (float stored transposed: non-contiguous; int64; bool) and a frozen bf16
    parameter. ``init_weights()`` refills them all, so the model can be built on ``meta``. (FSDP2 refuses
    non-contiguous parameters: ``fully_shard`` raises ``NotImplementedError``.)"""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)  # runs init_weights() before the extras exist: it skips them
        self.register_buffer("noise", torch.empty(5, 7).t())  # (7, 5), strides (1, 7)
        self.register_buffer("ids", torch.empty(6, dtype=torch.int64))
        self.register_buffer("keep", torch.empty(9, dtype=torch.bool))
        self.frozen_bf16 = nn.Parameter(torch.empty(3, 4, dtype=torch.bfloat16), requires_grad=False)
        self._fill_extras()

    @torch.no_grad()
    def _fill_extras(self) -> None:
        self.noise.normal_()
        self.ids.random_(0, 1000)
        self.keep.copy_(torch.rand(self.keep.shape) > 0.5)
        nn.init.normal_(self.frozen_bf16)

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        if hasattr(self, "frozen_bf16"):
            self._fill_extras()


def build(seed: int) -> GPTWithOddTensors:
    torch.manual_seed(seed)
    return GPTWithOddTensors(GPTConfig())


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (gathered: ``full_tensor()``) and buffer, by name, as plain tensors."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name: full(t).detach().clone() for name, t in tensors.items()}


def from_rank0(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rank 0's ``tensors`` on every rank (each broadcast as bytes: bool and bf16 alike)."""
    out = {}
    for name, t in tensors.items():
        data = t.detach().contiguous().clone()
        dist.broadcast(data.view(-1).view(torch.uint8), src=0)
        out[name] = data
    return out


def differ_across_ranks(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names whose value on some rank is not rank 0's (every rank gets the same list)."""
    mine = [n for n, t in from_rank0(tensors).items() if not torch.equal(t, tensors[n])]
    everyone: list[Any] = [None] * world()
    dist.all_gather_object(everyone, mine)
    return sorted({n for names in everyone for n in names})


def assert_equal_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert list(got) == list(want), f"{what}: names {list(got)} vs {list(want)}"
    wrong = [n for n in got if got[n].dtype != want[n].dtype or not torch.equal(got[n], want[n])]
    assert not wrong, f"{what}: rank {rank()} differs from rank 0's model in {wrong}"


def replicas_of(fsdp_kwargs: dict[str, Any]) -> int:
    """Over how many replicas the gradient is averaged after the shard group (``reference_backward``)."""
    if str(fsdp_kwargs.get("shard_strat", "NO_SHARD")).upper() == "NO_SHARD":
        return world()
    return fsdp_kwargs.get("replicate_size", 1)


def starts_from_rank0_and_trains(steps: int = 2, **fsdp_kwargs: Any) -> None:
    """Per-rank seeds, then ``fsdp()``: every tensor equals rank 0's, the ranks' own RNG states are as
    they were, and ``steps`` AdamW steps match one process trained from rank 0's weights, exactly."""
    model = build(1337 + rank())
    assert differ_across_ranks(state(model)), "the ranks built the same model: the case tests nothing"
    ref = copy.deepcopy(model)
    ref.load_state_dict(from_rank0(ref.state_dict()))
    rng_before = torch.get_rng_state()
    fsdp(model, auto_wrap=True, TransformerBlock=Block, **fsdp_kwargs)
    assert torch.equal(torch.get_rng_state(), rng_before), "fsdp() moved this rank's RNG state"
    assert_equal_state(state(model), state(ref), "after fsdp()")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        x, y = global_batch(step)
        ref_loss = reference_backward(ref, lm_loss, x, y, replicas=replicas_of(fsdp_kwargs))
        ref_opt.step()
        ref_opt.zero_grad()
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        # exact: a 2-rank (or 2x2) reduction adds two numbers, exact in any order (tests/README.md)
        assert_close(f"loss step {step}", mean_over_ranks(loss), ref_loss, 0.0)
    assert_equal_state(state(model), state(ref), f"after {steps} steps")


@case
def rank0_start_full_shard():
    starts_from_rank0_and_trains(shard_strat="FULL_SHARD")


@case
def rank0_start_shard_grad():
    starts_from_rank0_and_trains(shard_strat="SHARD_GRAD")


@case
def rank0_start_no_shard():
    # DDP's engine: its parameters were broadcast before too; the buffers were not
    starts_from_rank0_and_trains(shard_strat="NO_SHARD")


@case
def rank0_start_no_shard_fsdp2_mesh():
    mesh = build_mesh(resolve_sharding("NO_SHARD"), torch.device("cpu"))  # (world, 1): FSDP2's engine
    starts_from_rank0_and_trains(shard_strat="NO_SHARD", mesh=mesh)


@case(ranks=4)
def rank0_start_hybrid_shard():
    # a 2x2 (replicate, shard) mesh: synced along each dimension in turn, every rank ends with (0, 0)'s
    starts_from_rank0_and_trains(shard_strat="HYBRID_SHARD", replicate_size=2)


@case(ranks=4)
def rank0_start_hybrid_shard_zero2():
    starts_from_rank0_and_trains(shard_strat="HYBRID_SHARD_ZERO2", replicate_size=2)


@case
def sync_collectives_and_shape_errors():
    """Ranks that agree: one all-gather and nothing else; ranks that differ: plus broadcasts of what differs
    (rank 1 replaces it); ranks that built different shapes: a ValueError on every rank, before any change."""
    mesh = init_mesh((world(),), torch.device("cpu"))
    model = build(0)
    agree = collectives_per_step(lambda: start_from_first_rank(model, mesh))
    assert agree == {"_allgather_base_": 1}, agree
    model = build(1337 + rank())
    built, want = state(model), state(build(1337))
    done: list[Any] = []
    differ = collectives_per_step(lambda: done.append(start_from_first_rank(model, mesh)))
    assert differ["_allgather_base_"] == 1 and differ.get("broadcast_", 0) >= 1 and len(differ) == 2, differ
    assert_equal_state(state(model), want, "after the sync")
    # what rank 1 built otherwise (not the mask, LayerNorms, zero biases); the tied head counted once
    expected = [] if rank() == 0 else [n for n in want if not torch.equal(built[n], want[n])]
    assert expected or rank() == 0
    assert done[0].replaced == expected, (done[0].replaced, expected)
    odd = nn.Linear(3, 3 + rank())
    before = [t.clone() for t in odd.parameters()]
    message = expect_error(ValueError, lambda: fsdp(odd, shard_strat="FULL_SHARD"), "different sizes", "weight")
    assert "bias" in message and all(torch.equal(a, b) for a, b in zip(before, odd.parameters())), message


@case(ranks=4)
def sync_after_sharding_only_along_replicas():
    """On a 2-D mesh a DTensor is synced only along the dimension it is replicated on: a replica whose shard
    was changed gets replica 0's back, and the two shards stay different. Agreeing ranks: one all-gather per
    dimension."""
    torch.manual_seed(0)
    model = GPTWithOddTensors(GPTConfig())
    fsdp(model, auto_wrap=True, TransformerBlock=Block, shard_strat="HYBRID_SHARD", replicate_size=2)
    weight = model.blocks[0].mlp[0].weight
    mesh = weight.device_mesh
    assert collectives_per_step(lambda: start_from_first_rank(model, mesh)) == {"_allgather_base_": 2}
    mine = weight.to_local().detach().clone()
    replica, shard = mesh.get_local_rank(0), mesh.get_local_rank(1)
    if replica == 1:
        with torch.no_grad():
            weight.to_local().add_(1.0)
            model.noise.add_(1.0)
    replaced = start_from_first_rank(model, mesh).replaced
    assert replaced == ([] if replica == 0 else ["blocks.0.mlp.0.weight", "noise"]), replaced
    assert torch.equal(weight.to_local(), mine), f"shard {shard} of replica {replica} is not replica 0's"
    locals_ = [torch.empty_like(mine) for _ in range(world())]
    dist.all_gather(locals_, weight.to_local().contiguous())
    ranks = mesh.mesh.tolist()
    assert not torch.equal(locals_[ranks[0][0]], locals_[ranks[0][1]]), "the shards were made equal"


def meta_model_state(seed: int, **fsdp_kwargs: Any) -> dict[str, torch.Tensor]:
    """``build(seed)`` on ``meta``, through ``fsdp()``: the full state it materialized on this rank (checked
    to be every rank's) and the RNG state left as it was."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPTWithOddTensors(GPTConfig())
    rng_before = torch.get_rng_state()
    fsdp(model, auto_wrap=True, TransformerBlock=Block, **fsdp_kwargs)
    assert torch.equal(torch.get_rng_state(), rng_before), "fsdp() moved this rank's RNG state"
    got = state(model)
    assert not any(t.is_floating_point() and torch.isnan(t).any() for t in got.values()), "uninitialised memory"
    different = differ_across_ranks(got)
    assert not different, f"a meta model materialized differently across ranks: {different}"
    return got


def meta_init_rank0_seed_decides(**fsdp_kwargs: Any) -> None:
    """Seeded per rank, a meta model comes out one model on every rank, fixed by rank 0's seed alone."""
    first = meta_model_state(1337 + rank(), **fsdp_kwargs)
    # other ranks seeded otherwise: the same model
    assert_equal_state(meta_model_state(1337 if rank() == 0 else 4242 + rank(), **fsdp_kwargs), first, "same seed")
    # rank 0's seed changed: another model (the seed decides, not a constant)
    other = meta_model_state(1338 + rank(), **fsdp_kwargs)
    assert not torch.equal(other["blocks.0.mlp.0.weight"], first["blocks.0.mlp.0.weight"]), "rank 0's seed ignored"


@case
def meta_init_per_rank_seeds_full_shard():
    # buffers and whole tensors are not sharded: each shard drew its own (seed + shard index), now rank 0's
    meta_init_rank0_seed_decides(shard_strat="FULL_SHARD")


@case
def meta_init_per_rank_seeds_no_shard():
    meta_init_rank0_seed_decides(shard_strat="NO_SHARD")


@case(ranks=4)
def meta_init_per_rank_seeds_hybrid_shard():
    meta_init_rank0_seed_decides(shard_strat="HYBRID_SHARD", replicate_size=2)
    # replicas hold identical shards (the same shard index, the same seed); the two shards differ
    torch.manual_seed(1337 + rank())
    with torch.device("meta"):
        model = GPTWithOddTensors(GPTConfig())
    fsdp(model, auto_wrap=True, TransformerBlock=Block, shard_strat="HYBRID_SHARD", replicate_size=2)
    weight = model.blocks[0].mlp[0].weight
    assert isinstance(weight, DTensor)
    local = weight.to_local().contiguous()
    gathered = [torch.empty_like(local) for _ in range(world())]
    dist.all_gather(gathered, local)
    ranks = weight.device_mesh.mesh.tolist()  # [[replica 0's ranks], [replica 1's ranks]]
    for shard in range(2):
        assert torch.equal(gathered[ranks[0][shard]], gathered[ranks[1][shard]]), "replicas differ"
    assert not torch.equal(gathered[ranks[0][0]], gathered[ranks[0][1]]), "shards are copies"


if __name__ == "__main__":
    run_cases(CASES)
