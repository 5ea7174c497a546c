"""Multi-rank test cases of the façade, run by ``torchrun`` (see ``conftest.run_dist``).

Each case is a plain function that raises on failure; one launch runs many cases (process
start-up dominates). The reference model is always a ``copy.deepcopy`` made before wrapping,
trained on one process on the global batch while each rank trains its slice.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from worker import (
    Cases,
    assert_close,
    full,
    global_batch,
    local_slice,
    mean_over_ranks,
    reference_backward,
    run_cases,
    world,
)

from zeta_fsdp import fsdp, no_sync
from zeta_fsdp.distributed import build_mesh
from zeta_fsdp.divergence import DEFAULT_FORWARDS
from zeta_fsdp.engines import fsdp_engine
from zeta_fsdp.models.gpt import GPT, Block, GPTConfig, lm_loss, small
from zeta_fsdp.options import choose_engine, resolve_mixed_precision, resolve_sharding

CASES = Cases()
case = CASES.case


def train_parity(steps: int = 4, atol: float = 0.0, before_training=None, model_fn=small, **fsdp_kwargs) -> nn.Module:
    """Loss every step and every parameter after training equal the single-process reference.

    The reference computes FSDP's gradient bit for bit (``reference_backward``), so fp32 parity
    is exact (``atol=0``) on any CPU; only cases whose arithmetic differs pass a bound.
    """
    torch.manual_seed(0)
    model = model_fn()
    ref = copy.deepcopy(model)
    fsdp(model, **fsdp_kwargs)
    engine = fsdp_engine(model)
    expected = choose_engine(
        resolve_sharding(fsdp_kwargs.get("shard_strat", "NO_SHARD")),
        resolve_mixed_precision(fsdp_kwargs.get("mp", "fp32")),
        mesh_given="mesh" in fsdp_kwargs,
        cpu_offload=fsdp_kwargs.get("cpu_offload", False),
    )[0]
    assert engine == expected, (engine, expected)
    # NO_SHARD in fp32 runs on DDP's engine: plain tensor parameters, no FSDP unit
    assert isinstance(model, FSDPModule) == (engine == "fully_shard"), type(model).__mro__
    if before_training is not None:
        before_training(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    replicas = fsdp_kwargs.get("replicate_size", 1)
    if str(fsdp_kwargs.get("shard_strat", "NO_SHARD")).upper() == "NO_SHARD":
        replicas = world()  # NO_SHARD: gradients all-reduced (averaged) across whole replicas
    for step in range(steps):
        x, y = global_batch(step)
        ref_loss = reference_backward(ref, lm_loss, x, y, replicas=replicas)
        ref_opt.step()
        ref_opt.zero_grad()
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert_close(f"loss step {step}", mean_over_ranks(loss), ref_loss, atol)
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params), f"parameter names changed: {names} vs {list(ref_params)}"
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) == (engine == "fully_shard"), f"{name}: {type(param).__name__} on {engine}"
        assert_close(name, full(param), ref_params[name], atol)
    # the tie survives training: one parameter object, updated once
    if ref.head.weight is ref.tok_emb.weight:
        assert model.head.weight is model.tok_emb.weight
    return model


def finds_unused(model: nn.Module) -> bool:
    """Whether DDP's engine searches for unused parameters (``find_unused_parameters``) on ``model``."""
    return replicate.state(model)._ddp.find_unused_parameters


@case
def parity_full_shard():
    train_parity(auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)


@case
def parity_full_shard_keep_tail_and_prefetch():
    # the options only move all-gathers in time (or skip a re-gather): gradients stay bit-exact
    train_parity(auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block, keep_tail_unsharded=2, prefetch=2)


@case
def parity_shard_grad():
    train_parity(auto_wrap=True, shard_strat="SHARD_GRAD", TransformerBlock=Block)


@case
def parity_no_shard():
    model = train_parity(auto_wrap=True, shard_strat="NO_SHARD", TransformerBlock=Block)
    # the search runs although every parameter is used: a later step may leave some out
    # (no_shard_used_parameters_change); DDP's notice about it stays off stderr (test_notebook)
    assert finds_unused(model)


@case
def parity_no_shard_on_fsdp2_mesh():
    # a (world, 1) mesh asks for FSDP2's engine (DTensor parameters) under NO_SHARD
    mesh = build_mesh(resolve_sharding("NO_SHARD"), torch.device("cpu"))
    train_parity(auto_wrap=True, shard_strat="NO_SHARD", TransformerBlock=Block, mesh=mesh)


def _small_with_unused_parameter() -> GPT:
    model = small()
    model.unused = nn.Linear(4, 4)  # never called by forward: DDP must not hang or raise on it
    return model


class _WithAuxOutput(GPT):
    """Two outputs, the loss reads one: the aux head is in the forward's graph but gets no gradient
    (a Hugging Face model's ``pooler_output`` beside ``last_hidden_state``)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.aux = nn.Linear(cfg.dim, 2)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x, self.causal_mask)
        return self.head(self.norm(x)), self.aux(x)


class _SkipsABlock(GPT):
    """A branch not taken: the forward leaves block 1 out (a layer drop, an expert no token chose)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for i, block in enumerate(self.blocks):
            x = x if i == 1 else block(x, self.causal_mask)
        return self.head(self.norm(x))


class _SkipsWhenTold(GPT):
    """Uses every block unless told to skip block 1 (a layer drop, an expert no token chose this step)."""

    skip = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for i, block in enumerate(self.blocks):
            x = x if i == 1 and self.skip else block(x, self.causal_mask)
        return self.head(self.norm(x))


@case
def no_shard_used_parameters_change():
    """The first step uses every parameter, a later one does not: on every rank (parity with one
    process), then on one rank only (no hang, replicas stay equal). Without DDP's per-step search
    the first would apply half-reduced gradients and fail a step later; the second would hang."""
    torch.manual_seed(0)
    model = _SkipsWhenTold(GPTConfig())
    ref = copy.deepcopy(model)
    fsdp(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, skip in enumerate([False, True, False]):
        model.skip = ref.skip = skip
        x, y = global_batch(step)
        ref_loss = reference_backward(ref, lm_loss, x, y, replicas=world())
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        assert_close(f"loss step {step}", mean_over_ranks(loss), ref_loss, 0.0)
    for step in range(2):  # rank 1 skips block 1, rank 0 uses it
        model.skip = dist.get_rank() == 1 and step == 1
        x, y = global_batch(3 + step)
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        opt.step(), opt.zero_grad()
    for name, param in model.named_parameters():
        gathered = [torch.empty_like(param) for _ in range(world())]
        dist.all_gather(gathered, param.detach())
        assert all(torch.equal(g, gathered[0]) for g in gathered), f"replicas differ: {name}"


@case
def no_shard_replicate_engine_details():
    """NO_SHARD on DDP's engine: an unused parameter keeps no gradient and is not updated (as on
    one process), meta init gives identical replicas, wrapping twice is refused, the state-dict
    keys are the model's own; a frozen model (which DDP refuses) runs on FSDP2 instead. The first
    training forward shows the unused parameters (an unused head, a branch not taken, under
    no_sync too), so DDP searches for them every step."""
    assert finds_unused(train_parity(steps=3, model_fn=_small_with_unused_parameter))
    assert finds_unused(train_parity(steps=3, model_fn=lambda: _SkipsABlock(GPTConfig()), auto_wrap=True))
    torch.manual_seed(0)
    skips = _SkipsABlock(GPTConfig())
    skips_ref = copy.deepcopy(skips)
    fsdp(skips)
    x, y = global_batch(0)
    half = x.shape[0] // 2
    with no_sync(skips):  # the first forward runs inside no_sync: accumulated locally, synced next
        (lm_loss(skips(local_slice(x[:half])), local_slice(y[:half])) / 2).backward()
    (lm_loss(skips(local_slice(x[half:])), local_slice(y[half:])) / 2).backward()
    reference_backward(skips_ref, lambda out, t: lm_loss(out, t) / 2, x, y, replicas=world(), micro_batches=2)
    assert finds_unused(skips)
    for (name, got), want in zip(skips.named_parameters(), skips_ref.parameters()):
        assert (got.grad is None) == (want.grad is None) and (got.grad is None) == name.startswith("blocks.1."), name
        assert got.grad is None or torch.equal(got.grad, want.grad), name
    # an output the loss ignores: every parameter is in the graph, yet the aux head gets no gradient
    torch.manual_seed(0)
    aux = _WithAuxOutput(GPTConfig())
    aux_ref = copy.deepcopy(aux)
    fsdp(aux)
    opt, ref_opt = torch.optim.AdamW(aux.parameters(), lr=1e-2), torch.optim.AdamW(aux_ref.parameters(), lr=1e-2)
    for step in range(3):  # the second forward is where DDP would fail without the search
        x, y = global_batch(step)
        ref_loss = reference_backward(aux_ref, lambda out, t: lm_loss(out[0], t), x, y, replicas=world())
        loss = lm_loss(aux(local_slice(x))[0], local_slice(y))
        loss.backward()
        assert aux.aux.weight.grad is None and aux.head.weight.grad is not None
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        assert_close(f"aux-output loss step {step}", mean_over_ranks(loss), ref_loss, 0.0)
    assert finds_unused(aux)
    for (name, got), want in zip(aux.named_parameters(), aux_ref.parameters()):
        assert_close(name, got, want, 0.0)
    with torch.device("meta"):
        model = small()
    fsdp(model, auto_wrap=True, TransformerBlock=Block)
    assert fsdp_engine(model) == "replicate"
    weight = model.blocks[0].mlp[0].weight
    assert not weight.is_meta and not torch.isnan(weight).any()
    gathered = [torch.empty_like(weight) for _ in range(world())]
    dist.all_gather(gathered, weight.detach())
    assert all(torch.equal(g, gathered[0]) for g in gathered), "replicas differ after meta init"
    keys = list(model.state_dict())
    assert keys == list(small().state_dict()), keys
    frozen = small().requires_grad_(False)
    frozen_ref = copy.deepcopy(frozen)
    fsdp(frozen)
    assert fsdp_engine(frozen) == "fully_shard", fsdp_engine(frozen)
    x, _ = global_batch(0)
    assert torch.equal(frozen(local_slice(x)), frozen_ref(local_slice(x)))
    try:
        fsdp(model)
    except ValueError as e:
        assert "already wrapped" in str(e), e
    else:
        raise AssertionError("wrapping a replicated model twice was accepted")


@case
def parity_auto_detect():
    torch.manual_seed(0)
    probe = fsdp_plan_of(small())
    assert probe == ["block"] * 3 + ["embedding+head", "root"], probe
    train_parity(auto_wrap=True, shard_strat="FULL_SHARD")


def fsdp_plan_of(model: nn.Module) -> list[str]:
    from zeta_fsdp.wrapping import build_wrap_plan

    return [u.kind for u in build_wrap_plan(model, auto_wrap=True).units]


@case
def parity_root_only_default_args():
    # Zeta's defaults: no auto-wrap, NO_SHARD, fp32
    train_parity()


@case
def parity_class_name_and_checkpointing():
    train_parity(auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock="Block", activation_checkpointing=True)


def _small_with_layers_sharing_a_weight() -> GPT:
    model = small()
    model.blocks[1].mlp[0].weight = model.blocks[0].mlp[0].weight
    return model


@case
def parity_weights_shared_across_blocks():
    # the planner folds blocks 0 and 1 into the root unit; the shared weight stays one tensor
    train_parity(auto_wrap=True, shard_strat="FULL_SHARD", model_fn=_small_with_layers_sharing_a_weight)


@case(ranks=4)
def meta_init_replicas_identical_shards_distinct():
    # HYBRID 2x2 at 4 ranks: replicas must hold identical copies, the two shards must differ
    with torch.device("meta"):
        model = small()
    fsdp(model, auto_wrap=True, shard_strat="HYBRID_SHARD", replicate_size=2)
    local = model.blocks[0].mlp[0].weight.to_local().contiguous()
    gathered = [torch.empty_like(local) for _ in range(world())]
    dist.all_gather(gathered, local)
    mesh = model.blocks[0].mlp[0].weight.device_mesh
    ranks = mesh.mesh.tolist()  # [[replica 0 ranks], [replica 1 ranks]]
    for shard in range(2):
        assert torch.equal(gathered[ranks[0][shard]], gathered[ranks[1][shard]]), "replicas differ"
    assert not torch.equal(gathered[ranks[0][0]], gathered[ranks[0][1]]), "shards are copies"


@case
def single_ignored_parameter_is_accepted():
    torch.manual_seed(0)
    model = small()
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", ignored_params=model.pos_emb.weight)
    assert not isinstance(model.pos_emb.weight, DTensor) and isinstance(model.tok_emb.weight, DTensor)


@case
def parity_cpu_offload():
    train_parity(auto_wrap=True, shard_strat="FULL_SHARD", cpu_offload=True)


@case
def parity_compiled_blocks():
    # aot_eager exercises torch.compile's tracing without a C++ toolchain build per rank
    train_parity(steps=2, auto_wrap=True, shard_strat="FULL_SHARD", compile={"backend": "aot_eager"})
    torch._dynamo.reset()


def _measure_memory_without_training(model: nn.Module) -> None:
    from zeta_fsdp.measure import peak_memory_by_category

    x, y = global_batch(99)

    def forward_backward():
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        model.zero_grad(set_to_none=True)

    peak = peak_memory_by_category(model, None, forward_backward, warmup=0)
    assert peak["Sharded Param"] > 0 and peak["Total"] >= peak["Sharded Param"], peak


@case
def parity_after_memory_measurement():
    # FSDPMemTracker rewires FSDP hooks; the model must train exactly as before after measuring
    train_parity(auto_wrap=True, shard_strat="FULL_SHARD", before_training=_measure_memory_without_training)


@case(ranks=4)
def parity_hybrid_shard():
    train_parity(auto_wrap=True, shard_strat="HYBRID_SHARD", TransformerBlock=Block, replicate_size=2)


@case(ranks=4)
def parity_hybrid_shard_zero2():
    train_parity(auto_wrap=True, shard_strat="HYBRID_SHARD_ZERO2", TransformerBlock=Block, replicate_size=2)


@case(ranks=4)
def parity_hybrid_shard_keep_tail_and_prefetch():
    train_parity(auto_wrap=True, shard_strat="HYBRID_SHARD", replicate_size=2, keep_tail_unsharded=True, prefetch=1)


@case(ranks=4)
def parity_int_reshard_after_forward():
    """One SGD step with ``reshard_after_forward=2`` (resharding to 2 of the 4 ranks) is exact up to
    the one rounding FSDP does differently from any reference: a flat 4-rank reduce-scatter sums
    the four chunk gradients in gloo's own order (which differs from chunk to chunk). A 4-term sum
    in another order differs by at most 3u * S, S = sum_r |g_r| (u = 2^-24). One step of
    ``p - lr * g`` then adds its own roundings on each side: lr * g (u * lr * |g| <= u * lr * S
    each) and the subtraction (u/2 * |p| each). So each element is within
    lr * 5u * S + u * |p| of the reference, and twice that is asserted (higher-order terms).
    Losses before the step are exact.
    """
    u, lr = 2.0**-24, 0.1
    torch.manual_seed(0)
    model = small()
    ref = copy.deepcopy(model)
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block, reshard_after_forward=2)
    x, y = global_batch(0)
    params = dict(ref.named_parameters())
    abs_sum = {n: torch.zeros_like(p) for n, p in params.items()}
    for r in range(world()):
        chunk_loss = lm_loss(ref(local_slice(x, world(), r)), local_slice(y, world(), r))
        for n, g in zip(params, torch.autograd.grad(chunk_loss, list(params.values()))):
            abs_sum[n] += g.abs()
    ref_loss = reference_backward(ref, lm_loss, x, y)
    loss = lm_loss(model(local_slice(x)), local_slice(y))
    loss.backward()
    assert_close("loss", mean_over_ranks(loss), ref_loss, 0.0)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    for name, param in model.named_parameters():
        want = params[name].detach()
        bound = 2 * (lr * 5 * u * abs_sum[name] + u * want.abs())
        err = (full(param).detach() - want).abs()
        assert bool((err <= bound).all()), f"{name}: {(err - bound).max().item():.3e} over the bound"
        assert isinstance(param, DTensor)


@case(ranks=4)
def user_mesh_is_honoured():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world() // 2), mesh_dim_names=("rep", "shard"))
    torch.manual_seed(0)
    model = fsdp(small(), auto_wrap=True, shard_strat="HYBRID_SHARD", mesh=mesh)
    param = model.blocks[0].attn.qkv.weight
    assert param.device_mesh is mesh, "fsdp() built its own mesh instead of the user's"
    assert param.device_mesh.mesh_dim_names == ("rep", "shard")


@case
def bf16_policy_on_every_unit():
    torch.manual_seed(0)
    model = small()
    seen: dict[str, torch.dtype] = {}

    def record(name):
        def hook(module, args):
            seen[name] = module.weight.dtype

        return hook

    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            module.register_forward_pre_hook(record(name))
    fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        x, y = global_batch(0)  # same batch: the loss must go down
        logits = model(local_slice(x))
        loss = lm_loss(logits.float(), local_slice(y))
        loss.backward()
        for name, param in model.named_parameters():
            assert param.dtype == torch.float32, f"{name} stored as {param.dtype}"
            assert param.grad is not None and param.grad.dtype == torch.float32, f"{name}.grad is {param.grad.dtype}"
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss).item())
    # Every unit (blocks, embedding+head, root) computes in bf16: a policy on the root alone
    # would leave block and head weights in fp32 here.
    wrong = {n: d for n, d in seen.items() if d != torch.bfloat16}
    assert not wrong, f"modules computing outside bf16: {wrong}"
    assert len(seen) == sum(1 for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)))
    assert logits.dtype == torch.bfloat16
    assert losses[-1] < losses[0] - 0.1, f"bf16 loss did not decrease: {losses}"


@case
def meta_device_init():
    with torch.device("meta"):
        model = small()
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    tensors = list(model.parameters()) + list(model.buffers())
    assert not any(t.is_meta for t in tensors), "a tensor stayed on meta"
    assert model.head.weight is model.tok_emb.weight, "tie lost"
    assert torch.equal(model.causal_mask, torch.ones(16, 16, dtype=torch.bool).tril()), "buffer not refilled"
    std = full(model.blocks[0].attn.qkv.weight).std().item()
    assert 0.015 < std < 0.025, f"init_weights() did not run (std {std})"
    # every rank sees the same full weights (initialised consistently, not per-rank noise) ...
    w = full(model.tok_emb.weight)
    gathered = [torch.empty_like(w) for _ in range(world())]
    dist.all_gather(gathered, w)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    # ... and the shards of one weight are not copies of each other (CPU DTensor init draws
    # from each rank's own generator: without per-shard seeding every shard is identical)
    qkv = full(model.blocks[0].attn.qkv.weight)
    halves = qkv[: qkv.shape[0] // 2], qkv[qkv.shape[0] // 2 :]
    assert not torch.equal(*halves), "every rank initialised its shard with the same numbers"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        x, y = global_batch(0)
        loss = lm_loss(model(local_slice(x)), local_slice(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss).item())
    assert losses[-1] < losses[0], losses


def count_one_step(model: nn.Module, warmup: int = DEFAULT_FORWARDS) -> dict[str, int]:
    """The collectives of one training step after ``warmup`` steps (by default the forwards fsdp()'s
    divergence check runs in: its gathers are counted in ``divergence_check_costs_its_forwards_only``)."""
    from torch.distributed.tensor.debug import CommDebugMode

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = global_batch(0)
    for _ in range(warmup + 1):
        comm = CommDebugMode()
        with comm:
            lm_loss(model(local_slice(x)), local_slice(y)).backward()
            opt.step()
            opt.zero_grad()
    return {str(k): v for k, v in comm.get_comm_counts().items()}


@case
def comm_parity_with_hand_written():
    torch.manual_seed(0)
    model = small()
    hand = hand_written(copy.deepcopy(model))
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    ours, theirs = count_one_step(model), count_one_step(hand)
    assert sum(ours.values()) > 0, "CommDebugMode saw no collectives"
    assert ours == theirs, f"fsdp() collectives {ours} != hand-written {theirs}"


@case
def divergence_check_costs_its_forwards_only():
    """In its forwards the check adds one all-gather per unit module and one per forward, nothing else."""
    torch.manual_seed(0)
    model = small()
    hand = hand_written(copy.deepcopy(model))
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    ours, theirs = count_one_step(model, warmup=0), count_one_step(hand, warmup=0)
    checks = 3 + 4 + 1 + 1  # 3 blocks, the tied [tok_emb, pos_emb, norm, head] unit's modules, the root, the end
    gather = next(op for op in theirs if "allgather" in op)
    assert ours == {**theirs, gather: theirs[gather] + checks}, (ours, theirs)


def hand_written(model: GPT) -> GPT:
    """The plain recipe a careful user writes: blocks, the tied [emb, norm, head] unit, the root."""
    mesh = build_mesh(resolve_sharding("FULL_SHARD"), torch.device("cpu"))
    policy = MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard([model.tok_emb, model.pos_emb, model.norm, model.head], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def unsharded_after_forward(model: GPT) -> dict[str, bool]:
    """Per unit: are its parameters unsharded between forward and backward?

    FSDP2 registers a unit's unsharded parameters on its modules while they are unsharded and
    the sharded DTensors otherwise, so this reads what a user would see.
    """
    if model.cfg.tie_weights:
        units = {"head": [model.tok_emb, model.pos_emb, model.norm, model.head]}
    else:
        units = {"embedding": [model.tok_emb, model.pos_emb], "head": [model.norm, model.head]}
    units.update({f"blocks.{i}": [b] for i, b in enumerate(model.blocks)})
    x, y = global_batch(0)
    loss = lm_loss(model(local_slice(x)), local_slice(y))
    status = {
        name: not any(isinstance(p, DTensor) for m in modules for p in m.parameters())
        for name, modules in units.items()
    }
    loss.backward()  # finish the step: every unit is resharded again
    return status


@case
def keep_tail_unsharded_keeps_exactly_the_last_units():
    torch.manual_seed(0)
    base = small()
    plain = unsharded_after_forward(hand_written(copy.deepcopy(base)))
    assert not any(plain.values()), f"hand-written recipe: every unit resharded after forward, got {plain}"
    default = fsdp(copy.deepcopy(base), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    assert unsharded_after_forward(default) == plain, "fsdp()'s default must be the hand-written recipe"
    for keep, expected in (
        (True, {"head"}),
        (2, {"head", "blocks.2"}),
        (99, {"head", "blocks.0", "blocks.1", "blocks.2"}),
    ):
        model = fsdp(
            copy.deepcopy(base),
            auto_wrap=True,
            shard_strat="FULL_SHARD",
            TransformerBlock=Block,
            keep_tail_unsharded=keep,
        )
        status = unsharded_after_forward(model)
        assert {n for n, u in status.items() if u} == expected, f"keep_tail_unsharded={keep}: {status}"
        for p in model.parameters():  # after backward, everything is sharded again
            assert isinstance(p, DTensor)


@case
def untied_head_keep_tail_and_prefetch():
    # untied: separate [tok_emb, pos_emb] and [norm, head] units; the embedding is never kept
    kwargs = dict(auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block, keep_tail_unsharded=2, prefetch=2)
    torch.manual_seed(0)
    status = unsharded_after_forward(fsdp(small(tie_weights=False), **kwargs))
    assert {n for n, u in status.items() if u} == {"head", "blocks.2"}, status
    train_parity(model_fn=lambda: small(tie_weights=False), **kwargs)


@case
def prefetch_chains_follow_forward_and_backward_order():
    from zeta_fsdp.engines import fsdp_state

    torch.manual_seed(0)
    model = fsdp(small(), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block, prefetch=2)
    b = list(model.blocks)
    head = model.tok_emb  # one FSDP state for the whole tied [tok_emb, pos_emb, norm, head] unit

    def targets(module: nn.Module, attr: str) -> list:
        return [id(s) for s in getattr(fsdp_state(module), attr)]

    def states(*modules: nn.Module) -> list:
        return [id(fsdp_state(m)) for m in modules]

    forward = {head: [b[0], b[1]], b[0]: [b[1], b[2]], b[1]: [b[2]], b[2]: []}
    backward = {head: [b[2], b[1]], b[2]: [b[1], b[0]], b[1]: [b[0]], b[0]: []}
    for module, expected in forward.items():
        assert targets(module, "_states_to_forward_prefetch") == states(*expected), f"forward chain of {module}"
    for module, expected in backward.items():
        assert targets(module, "_states_to_backward_prefetch") == states(*expected), f"backward chain of {module}"
    assert fsdp_state(model.head) is fsdp_state(model.tok_emb)
    plain = fsdp(small(), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    assert all(not targets(m, "_states_to_forward_prefetch") for m in [plain.tok_emb, *plain.blocks])


@case
def comm_options_never_exceed_hand_written():
    torch.manual_seed(0)
    base = small()
    theirs = count_one_step(hand_written(copy.deepcopy(base)))
    assert any("gather" in op for op in theirs), f"CommDebugMode saw no all-gather: {theirs}"
    for kwargs, fewer_gathers in ((dict(prefetch=1), 0), (dict(prefetch=2, keep_tail_unsharded=2), 2)):
        model = fsdp(copy.deepcopy(base), auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block, **kwargs)
        ours = count_one_step(model)
        assert ours.keys() == theirs.keys(), (kwargs, ours, theirs)
        for op, n in theirs.items():
            expected = n - fewer_gathers if "gather" in op else n
            assert ours[op] == expected, f"{kwargs}: {op} {ours[op]} != {expected} (hand-written {theirs})"


@case
def memory_full_shard_halves_params():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    torch.manual_seed(0)
    model = small(dim=60, n_heads=3, vocab_size=101)
    unsharded = sum(p.numel() * p.element_size() for p in model.parameters())
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tracker = FSDPMemTracker(model, opt)
    x, y = global_batch(0, GPTConfig(vocab_size=101))
    tracker.track_inputs((local_slice(x),))
    with tracker:
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        opt.step()
    snapshot = tracker.get_tracker_snapshot("current")
    per_device = {getattr(k, "value", str(k)): v for k, v in next(iter(snapshot.values())).items()}
    sharded = per_device["Sharded Param"]
    ratio = sharded / unsharded
    assert ratio <= 0.51, f"per-rank parameter bytes {sharded} = {ratio:.3f} of unsharded {unsharded}"
    assert ratio >= 0.49, f"suspiciously small: {ratio:.3f}"


@case
def wrapping_twice_is_a_clear_error():
    torch.manual_seed(0)
    model = fsdp(small(), auto_wrap=True, shard_strat="FULL_SHARD")
    try:
        fsdp(model, shard_strat="FULL_SHARD")
    except ValueError as e:
        assert "already wrapped" in str(e), e
    else:
        raise AssertionError("second fsdp() call did not raise")
    # a model containing an already-sharded block is refused too
    other = small()
    fully_shard(other.blocks[0])
    try:
        fsdp(other)
    except ValueError as e:
        assert "already wrapped" in str(e), e
    else:
        raise AssertionError("partly wrapped model was accepted")


if __name__ == "__main__":
    run_cases(CASES)
