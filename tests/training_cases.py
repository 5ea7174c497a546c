"""Multi-rank cases for ``zeta_fsdp.training`` and ``zeta_fsdp.loss``, run by ``torchrun``.

Same pattern as ``dist_cases.py`` (helpers and main loop from ``worker.py``). The reference is a
``copy.deepcopy`` made before wrapping, run on one process over the global (concatenated) batch.

``TPNet`` and ``tp_plan`` are shared with ``strategy_cases.py``.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Replicate
from worker import (
    ARGS,
    SEQ,
    UNIT_ROUNDOFF,
    VOCAB,
    Cases,
    assert_close,
    assert_close_scaled,
    deferred_all_reduce_reference,
    expect_error,
    full,
    local_slice,
    mean_over_ranks,
    rank,
    reference_backward,
    run_cases,
    tokens,
    world,
)

from zeta_fsdp import fsdp
from zeta_fsdp.engines import fsdp_engine, fsdp_param_groups, partial_reduce_output
from zeta_fsdp.loss import MaskedTokenLossReduction, PerSampleLossReduction
from zeta_fsdp.measure import collectives_per_step
from zeta_fsdp.models.gpt import Block, lm_loss, small
from zeta_fsdp.training import clip_grad_norm_, memory_report, no_sync

CASES = Cases()
case = CASES.case


# ---------------------------------------------------------------------------------------------
# shared helpers


def assert_grads_match(model: nn.Module, ref: nn.Module, atol: float = 0.0, ulps: Optional[float] = None) -> None:
    """Gradients equal the reference's: within ``atol``, or within ``ulps`` roundings of each tensor's
    largest element (``assert_close_scaled``) where the two sides group the arithmetic differently."""
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, param in model.named_parameters():
        want = ref_params[name].grad
        if want is None:
            assert param.grad is None, f"{name}: has a gradient, the reference has none"
            continue
        assert param.grad is not None, f"{name}: no gradient"
        if ulps is None:
            assert_close(f"grad {name}", param.grad, want, atol)
        else:
            assert_close_scaled(f"grad {name}", param.grad, want, ulps)
        checked += 1
    assert checked > 0, "no gradient compared"


def comm_counts(fn: Callable[[], object]) -> dict[str, int]:
    """``collectives_per_step(fn)`` keyed without the ops' underscores (``"_allgather_base_"`` ->
    ``"allgather_base"``). One forward/backward per call: CommDebugMode (torch 2.13) breaks when one
    context spans several passes of multi-module FSDP units, so callers count phase by phase."""
    counts: Counter[str] = Counter()
    for op, n in collectives_per_step(fn).items():
        counts[op.strip("_")] += n
    return dict(counts)


class TPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TPNet(nn.Module):
    """A small LM whose linear layers take a tensor-parallel plan (``TP_PLAN``)."""

    def __init__(self, vocab: int = 32, dim: int = 16, hidden: int = 32, n_layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(TPBlock(dim, hidden) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "layers.*.up": ColwiseParallel(),
        "layers.*.down": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }


def sharded_gpt(**fsdp_kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = small()
    ref = copy.deepcopy(model)
    kwargs = {"auto_wrap": True, "shard_strat": "FULL_SHARD", "TransformerBlock": Block, **fsdp_kwargs}
    return fsdp(model, **kwargs), ref


# While ``other_torch_state_layout`` is active, FSDP states hide their group names from the
# library under test; the test's own reads (``unit_groups``) see through the disguise.
_DISGUISE = {"on": False}


def unit_groups(module: nn.Module) -> list:
    """torch's FSDP parameter groups of one unit, through the library's reader
    (``zeta_fsdp.engines.fsdp_param_groups``: whichever name this torch release uses)."""
    was, _DISGUISE["on"] = _DISGUISE["on"], False
    try:
        groups = fsdp_param_groups(module)
    finally:
        _DISGUISE["on"] = was
    assert groups is not None, f"cannot read the FSDP parameter groups of {type(module).__name__} on this torch"
    return groups


def model_groups(model: nn.Module) -> list:
    """Every distinct FSDP parameter group of a wrapped model, in module order."""
    groups: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups.update((id(g), g) for g in unit_groups(module))
    return list(groups.values())


def sync_flags(model: nn.Module) -> list[tuple[bool, bool]]:
    """(reduce_grads, all_reduce_grads) of every FSDP parameter group, read from torch's own state."""
    return [(g.reduce_grads, g.all_reduce_grads) for g in model_groups(model)]


class _OtherTorchState:
    """An FSDP state as another torch release shows it: no ``_fsdp_param_groups`` (torch < 2.10 had
    one ``_fsdp_param_group``), and with ``singular=False`` neither name (a future layout)."""

    def __init__(self, state: object, singular: bool):
        self._state, self._singular = state, singular

    def __getattr__(self, name: str):
        hidden = name == "_fsdp_param_groups" or (name == "_fsdp_param_group" and not self._singular)
        if hidden and _DISGUISE["on"]:
            raise AttributeError(name)
        return getattr(self._state, name)


@contextlib.contextmanager
def other_torch_state_layout(singular: bool):
    """``FSDPModule._get_fsdp_state()`` returns ``_OtherTorchState``; the public
    ``set_requires_gradient_sync`` / ``set_requires_all_reduce`` still work, as they do on any torch."""
    real_state = FSDPModule.__dict__["_get_fsdp_state"]

    def groups(module, recurse):
        for m in module.modules() if recurse else [module]:
            if isinstance(m, FSDPModule):
                yield from unit_groups(m)

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        for group in groups(self, recurse):
            group.reduce_grads = group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        for group in groups(self, recurse):
            group.all_reduce_grads = requires_all_reduce

    patches = {
        "_get_fsdp_state": lambda self: _OtherTorchState(real_state(self), singular),
        "set_requires_gradient_sync": set_requires_gradient_sync,
        "set_requires_all_reduce": set_requires_all_reduce,
    }
    originals = {name: FSDPModule.__dict__[name] for name in patches}
    for name, fn in patches.items():
        setattr(FSDPModule, name, fn)
    _DISGUISE["on"] = True
    try:
        yield
    finally:
        _DISGUISE["on"] = False
        for name, fn in originals.items():
            setattr(FSDPModule, name, fn)


# ---------------------------------------------------------------------------------------------
# no_sync


def _accumulation(shard_strat: str, k: int = 4, **kwargs) -> None:
    """K micro-batches: K-1 inside no_sync issue no gradient collective, the last one does; the
    accumulated gradients equal the reference's on the K x global batch."""
    model, ref = sharded_gpt(shard_strat=shard_strat, **kwargs)
    n_units = len(sync_flags(model))
    shard_size = next(model.parameters()).device_mesh.size(-1)
    hybrid = shard_strat.startswith("HYBRID")
    x, y = tokens(4 * k, seed=1)
    replicas = kwargs.get("replicate_size", 1)
    reference_backward(ref, lambda out, tgt: lm_loss(out, tgt) / k, x, y, replicas=replicas, micro_batches=k)
    for i in range(k):
        xi, yi = local_slice(x[4 * i : 4 * (i + 1)]), local_slice(y[4 * i : 4 * (i + 1)])

        def micro_step(xi=xi, yi=yi):
            (lm_loss(model(xi), yi) / k).backward()

        if i < k - 1:
            with no_sync(model):
                counts = comm_counts(micro_step)
            assert counts.get("reduce_scatter_base", 0) == 0, f"micro-step {i} reduced: {counts}"
            assert counts.get("allreduce", 0) == 0, f"micro-step {i} all-reduced: {counts}"
            if shard_size > 1:  # parameters are still all-gathered: CommDebugMode is watching
                assert counts.get("allgather_base", 0) > 0, f"CommDebugMode saw nothing: {counts}"
        else:
            counts = comm_counts(micro_step)
            if shard_size > 1:
                assert counts.get("reduce_scatter_base", 0) == n_units, f"last micro-step: {counts} ({n_units} units)"
            if hybrid:
                assert counts.get("allreduce", 0) == n_units, f"HSDP replica all-reduce missing: {counts}"
    assert all(f == (True, True) for f in sync_flags(model)), "sync not restored"
    assert_grads_match(model, ref, atol=0.0)  # the reference accumulates and reduces as FSDP does


@case
def no_sync_full_shard_accumulation():
    _accumulation("FULL_SHARD")


@case
def no_sync_hybrid_accumulation():
    # 2 ranks: replicas of 1 shard each, so the replica all-reduce is the gradient collective
    _accumulation("HYBRID_SHARD", replicate_size=world())


@case(ranks=4)
def no_sync_hybrid_2x2_accumulation():
    _accumulation("HYBRID_SHARD", replicate_size=2)


@case
def no_sync_no_shard_replicate_accumulation():
    """NO_SHARD on DDP's engine: micro-batches inside no_sync keep each rank's own gradient (no
    all-reduce: the value proves it), nesting keeps sync off, the last one averages the sum."""
    k = 3
    model, ref = sharded_gpt(shard_strat="NO_SHARD")
    local_ref = copy.deepcopy(ref)
    assert fsdp_engine(model) == "replicate" and not isinstance(model, FSDPModule)
    x, y = tokens(4 * k, seed=1)
    reference_backward(ref, lambda out, tgt: lm_loss(out, tgt) / k, x, y, replicas=world(), micro_batches=k)
    for i in range(k):
        xi, yi = local_slice(x[4 * i : 4 * (i + 1)]), local_slice(y[4 * i : 4 * (i + 1)])
        if i < k - 1:
            # one collective: both choices defer it; a container (or torch.compile's wrapper) is searched
            target = model if i == 0 else nn.ModuleDict({"wrapped": model})
            with no_sync(target, defer="all" if i == 0 else "all_reduce"):
                with no_sync(model):  # an inner exit must not turn sync back on
                    pass
                counts = comm_counts(lambda xi=xi, yi=yi: (lm_loss(model(xi), yi) / k).backward())
            # DDP is built at the first forward (a shape check and rank 0's values broadcast)
            built = {"allgather": 1, "broadcast": 2} if i == 0 else {}
            assert counts == built, f"micro-batch {i} inside no_sync communicated: {counts}"
            (lm_loss(local_ref(xi), yi) / k).backward()
            assert_grads_match(model, local_ref, atol=0.0)  # this rank's own sum: nothing reduced
        else:
            counts = comm_counts(lambda xi=xi, yi=yi: (lm_loss(model(xi), yi) / k).backward())
    costs = memory_report(model, micro_batches=k)["accumulation"]
    assert counts == {"allreduce": costs["all"].all_reduces}, (counts, costs)  # DDP: its buckets
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert {c.grad_bytes for c in costs.values()} == {whole}, costs
    grad = model.blocks[0].mlp[0].weight.grad
    gathered = [torch.empty_like(grad) for _ in range(world())]
    dist.all_gather(gathered, grad)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "replicas' gradients differ after sync"
    assert_grads_match(model, ref, atol=0.0)  # (a + b) / 2 == a/2 + b/2 exactly: DDP's average


class _Autocast(nn.Module):
    """The reference for ``mp="bf16"`` NO_SHARD: the forward under ``torch.autocast``, as a DDP user writes it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x)


@case
def no_shard_bf16_is_ddp_with_autocast():
    """NO_SHARD with mp="bf16" runs on DDP's engine with autocast(bf16) around the forward: fp32
    parameters and gradients (all-reduced in fp32), bf16 logits, and the same losses, gradients
    and weights as a single process running the forward under ``torch.autocast`` (same kernels
    on the same shapes; a 2-member fp32 average is exact), over 3 AdamW steps. Then the NO_SHARD
    guarantees: no_sync communicates nothing, clip_grad_norm_ matches, state-dict keys and values
    are the model's own, a checkpoint round-trips."""
    from zeta_fsdp import load_checkpoint, save_checkpoint
    from zeta_fsdp.engines.replicate import autocast_forward

    model, ref = sharded_gpt(shard_strat="NO_SHARD", mp="bf16")
    assert fsdp_engine(model) == "replicate" and not isinstance(model, FSDPModule)
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in model.parameters())
    wrapped = _Autocast(ref)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    for step in range(3):
        x, y = tokens(4, seed=20 + step)
        ref_loss = reference_backward(wrapped, lm_loss, x, y, replicas=world())
        logits = model(local_slice(x))
        assert logits.dtype == torch.bfloat16, logits.dtype
        loss = lm_loss(logits, local_slice(y))
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters() if p.grad is not None)
        assert_grads_match(model, ref, atol=0.0)
        assert_close(f"loss step {step}", mean_over_ranks(loss), ref_loss, 0.0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (name, got), want in zip(model.state_dict().items(), ref.state_dict().values()):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert list(model.state_dict()) == list(ref.state_dict())

    x, y = tokens(8, seed=30)
    with no_sync(model):
        counts = comm_counts(lambda: lm_loss(model(local_slice(x)), local_slice(y)).backward())
    assert counts == {}, f"a backward inside no_sync communicated: {counts}"
    model.zero_grad()
    autocast_forward(ref, "cpu", torch.bfloat16)  # shown equal to the explicit autocast above
    _clip_parity(model, ref, tokens(4, seed=31), replicas=world())

    ckpt = save_checkpoint(Path(ARGS.out) / "bf16_no_shard_ckpt", model, opt, overwrite=True)
    again, _ = sharded_gpt(shard_strat="NO_SHARD", mp="bf16")
    load_checkpoint(ckpt, again)
    for (name, got), want in zip(again.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), f"{name} differs after a checkpoint round trip"


@case
def clip_grad_norm_no_shard_replicate():
    model, ref = sharded_gpt(shard_strat="NO_SHARD")
    assert fsdp_engine(model) == "replicate"
    x, y = tokens(4, seed=2)
    _clip_parity(model, ref, (x, y), replicas=world())


@case
def no_sync_restores_on_exception_and_nesting():
    model, _ = sharded_gpt()
    block = model.blocks[1]
    block.set_requires_gradient_sync(False, recurse=False)  # the user's own setting survives
    before = sync_flags(model)
    assert (False, False) in before
    try:
        with no_sync(model):
            assert all(f == (False, False) for f in sync_flags(model))
            with no_sync(model):
                pass
            assert all(f == (False, False) for f in sync_flags(model)), "inner exit re-enabled sync"
            raise KeyError("boom")
    except KeyError:
        pass
    else:
        raise AssertionError("exception swallowed")
    assert sync_flags(model) == before, f"{sync_flags(model)} != {before}"
    # a plain (unwrapped) module is accepted and left alone
    with no_sync(nn.Linear(2, 2)):
        pass


@case
def regression_no_sync_on_other_torch_state_layouts():
    """no_sync read torch's private ``_fsdp_param_groups``; where a torch release lacks it, it found
    no groups, treated the model as unsharded and gradients kept syncing without a word. It must
    disable sync through the public API, and restore each unit's setting read from whichever name
    exists (``_fsdp_param_group`` on older torch), or to sync when neither can be read."""
    x, y = tokens(4, seed=1)
    for singular in (True, False):
        model, _ = sharded_gpt(shard_strat="HYBRID_SHARD", replicate_size=world())
        model.blocks[1].set_requires_gradient_sync(False, recurse=False)  # the user's own setting
        before = sync_flags(model)
        assert (False, False) in before and (True, True) in before

        def micro_step(model=model):
            lm_loss(model(local_slice(x)), local_slice(y)).backward()

        with other_torch_state_layout(singular):
            with no_sync(model):
                assert all(f == (False, False) for f in sync_flags(model)), f"sync still on: {sync_flags(model)}"
                counts = comm_counts(micro_step)
            after = sync_flags(model)
        assert counts.get("reduce_scatter_base", 0) == 0 and counts.get("allreduce", 0) == 0, counts
        if singular:
            assert after == before, f"{after} != {before}"
        else:  # nothing readable: back to FSDP's default, sync on every unit
            assert all(f == (True, True) for f in after), after


# ---------------------------------------------------------------------------------------------
# no_sync(defer="all_reduce"): reduce-scatter every micro-batch, defer only the replica all-reduce


def held_grad_bytes(model: nn.Module) -> int:
    """Bytes of every distinct gradient storage FSDP2 holds for the model now: sharded ``.grad``,
    unsharded gradients (``defer="all"``) and the reduce-scattered sum waiting for its all-reduce
    (``defer="all_reduce"``), read from torch's own state (torch 2.13 names)."""
    storages: dict[int, int] = {}

    def add(t: Optional[torch.Tensor]) -> None:
        if t is not None:
            t = t.to_local() if hasattr(t, "to_local") else t
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for group in model_groups(model):
        add(group._partial_reduce_output)
        for fp in group.fsdp_params:
            add(fp.sharded_param.grad)
            add(fp._unsharded_param.grad)
            add(fp.unsharded_accumulated_grad)
    return sum(storages.values())


def _planned(shard_strat: str, k: int, **kwargs) -> dict:
    """The planner's accumulation figures for the demo GPT as ``sharded_gpt`` wraps it."""
    from zeta_fsdp.planner import plan

    with torch.device("meta"):
        meta = small()
    return plan(meta, world(), shard_strat, rank=rank(), TransformerBlock=Block, **kwargs).accumulation(k)


def _deferred_accumulation(shard_strat: str, k: int, **kwargs) -> None:
    """K micro-batches, the first K-1 inside ``no_sync(defer="all_reduce")``: every micro-batch
    reduce-scatters, only the last all-reduces (HYBRID); gradients equal FSDP2's order of sums
    exactly; the bytes held between micro-batches are the sharded figure memory_report and plan()
    give, and ``defer="all"`` holds the unsharded figure."""
    model, ref = sharded_gpt(shard_strat=shard_strat, **kwargs)
    replicas = kwargs.get("replicate_size", 1)
    n_units = len([f for f in sync_flags(model)])
    report = memory_report(model, micro_batches=k)["accumulation"]
    planned = _planned(shard_strat, k, **kwargs)
    assert report == planned, f"memory_report {report} != plan {planned}"
    x, y = tokens(4 * k, seed=3)
    deferred_all_reduce_reference(ref, lambda out, tgt: lm_loss(out, tgt) / k, x, y, k, replicas)
    reduce_scatters = all_reduces = 0
    for i in range(k):
        xi, yi = local_slice(x[4 * i : 4 * (i + 1)]), local_slice(y[4 * i : 4 * (i + 1)])

        def micro_step(xi=xi, yi=yi):
            (lm_loss(model(xi), yi) / k).backward()

        if i < k - 1:
            with no_sync(model, defer="all_reduce"):
                assert all(f == (True, False) for f in sync_flags(model)), sync_flags(model)
                counts = comm_counts(micro_step)
            assert counts.get("reduce_scatter_base", 0) == n_units, f"micro-step {i}: {counts} ({n_units} units)"
            assert counts.get("allreduce", 0) == 0, f"micro-step {i} all-reduced: {counts}"
            held = held_grad_bytes(model)
            assert held == report["all_reduce"].grad_bytes, f"holds {held} B, reported {report['all_reduce']}"
            if replicas > 1:  # FSDP2 keeps the sum in its own buffer; .grad only shows it (a view)
                held_storages = {
                    partial_reduce_output(g).untyped_storage().data_ptr()
                    for m in model.modules()
                    for g in fsdp_param_groups(m) or ()
                    if partial_reduce_output(g) is not None
                }
                shown = {p.grad.to_local().untyped_storage().data_ptr() for p in model.parameters()}
                assert shown <= held_storages, "a .grad of its own before the all-reduce"
                assert held < report["all"].grad_bytes, (held, report)
        else:
            counts = comm_counts(micro_step)
            assert counts.get("reduce_scatter_base", 0) == n_units, f"last micro-step: {counts}"
            assert counts.get("allreduce", 0) == (n_units if replicas > 1 else 0), f"last micro-step: {counts}"
            assert held_grad_bytes(model) == report["sync"].grad_bytes
        reduce_scatters += counts.get("reduce_scatter_base", 0)
        all_reduces += counts.get("allreduce", 0)
    want = (report["all_reduce"].reduce_scatters, report["all_reduce"].all_reduces)
    assert (reduce_scatters, all_reduces) == want, f"{(reduce_scatters, all_reduces)} collectives, reported {want}"
    assert all(f == (True, True) for f in sync_flags(model)), "sync not restored"
    assert_grads_match(model, ref, atol=0.0)  # same sums in the same order: exact
    # defer="all" holds the unsharded gradients, as reported
    model.zero_grad()
    with no_sync(model):
        micro_step()
    held = held_grad_bytes(model)
    assert held == report["all"].grad_bytes, f"defer='all' holds {held} B, reported {report['all']}"
    assert held > report["all_reduce"].grad_bytes, (held, report)


@case(ranks=4)
def no_sync_defer_all_reduce_hybrid_2x2():
    _deferred_accumulation("HYBRID_SHARD", 3, replicate_size=2)


@case
def no_sync_defer_all_reduce_1d_is_sync_every_micro_batch():
    # FULL_SHARD has no replica all-reduce: nothing is deferred, every micro-batch reduce-scatters
    _deferred_accumulation("FULL_SHARD", 2)


@case(ranks=4)
def no_sync_defer_bad_value_changes_nothing():
    model, _ = sharded_gpt(shard_strat="HYBRID_SHARD", replicate_size=2)
    model.blocks[1].set_requires_all_reduce(False, recurse=False)  # the user's own setting
    before = sync_flags(model)
    for bad in ("none", "allreduce", "", True, None, 0):

        def enter(bad=bad):
            with no_sync(model, defer=bad):
                raise AssertionError("entered the block")

        message = expect_error(ValueError, enter, "defer=", "'all'", "'all_reduce'")
        assert repr(bad) in message, message
        assert sync_flags(model) == before, f"{bad!r}: {sync_flags(model)} != {before}"
    with no_sync(model, defer=" ALL_REDUCE "):  # normalized like fsdp()'s strings
        assert all(f == (True, False) for f in sync_flags(model))
    assert sync_flags(model) == before


# ---------------------------------------------------------------------------------------------
# clip_grad_norm_


def _norm_bound(ref: nn.Module, norm_type: float) -> float:
    """Relative difference allowed between a norm over shards and torch's over whole tensors.

    The inf-norm is a max: exact. The 1- and 2-norms sum n non-negative terms; torch's cascade
    summation errs by at most ~log2(n) roundings relative, on each side, plus one for adding the
    shards' partial sums: (2 * log2(n) + 2) * u.
    """
    if math.isinf(norm_type):
        return 0.0
    n = sum(p.numel() for p in ref.parameters() if p.grad is not None)
    return (2 * math.ceil(math.log2(n)) + 2) * UNIT_ROUNDOFF


def _check_clip(model: nn.Module, ref: nn.Module, got: float, want: float, max_norm: float, norm_type: float) -> None:
    """The norm within ``_norm_bound``; the clipped gradients within what the two clip
    coefficients' difference explains (gradients before clipping are compared by the caller)."""
    bound = _norm_bound(ref, norm_type)
    assert abs(got - want) <= bound * want, f"norm {norm_type}: {got} vs {want} (relative bound {bound:.1e})"
    coef = lambda norm: min(1.0, max_norm / (norm + 1e-6))  # noqa: E731 - torch's clip coefficient
    spread = abs(coef(got) - coef(want)) / coef(want)
    assert_grads_match(model, ref, ulps=spread / UNIT_ROUNDOFF + 4)  # + each side's multiply


def _clip_parity(model: nn.Module, ref: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], *, replicas: int) -> None:
    x, y = batch
    for norm_type, max_norm in ((2.0, 0.05), (float("inf"), 1e-3), (1.0, 1e6), ("inf", 1e6)):
        model.zero_grad()
        ref.zero_grad()
        reference_backward(ref, lm_loss, x, y, replicas=replicas)
        lm_loss(model(local_slice(x)), local_slice(y)).backward()
        # parameters without a gradient are skipped, on both sides
        ref.norm.bias.grad = None
        model.norm.bias.grad = None
        assert_grads_match(model, ref, atol=0.0)  # before clipping: exact
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=float(norm_type)).item()
        got = clip_grad_norm_(model, max_norm, norm_type=norm_type)
        everyone = [None] * world()
        dist.all_gather_object(everyone, got)
        assert isinstance(got, float), type(got)
        assert len(set(everyone)) == 1, f"ranks disagree on the norm: {everyone}"
        _check_clip(model, ref, got, want, max_norm, float(norm_type))
        if max_norm < want:  # clipping happened: the new norm is max_norm * norm / (norm + eps)
            again = clip_grad_norm_(model.parameters(), 1e9, norm_type=norm_type)
            clipped = max_norm * got / (got + 1e-6)
            tolerance = (_norm_bound(ref, float(norm_type)) + 4 * UNIT_ROUNDOFF) * clipped
            assert abs(again - clipped) <= tolerance, (again, clipped)


@case
def clip_grad_norm_full_shard():
    model, ref = sharded_gpt()
    x, y = tokens(4, seed=2)
    _clip_parity(model, ref, (x, y), replicas=1)
    _clip_sees_a_nan_on_any_rank(model)
    _clip_follows_a_replaced_parameter(model)
    _clip_keeps_no_model_alive()


def _clip_sees_a_nan_on_any_rank(model: nn.Module) -> None:
    """A NaN in one rank's shard makes every rank's norm NaN, for the inf-norm too (a max over the ranks; gloo's
    MAX dropped a NaN that came second) and error_if_nonfinite raises on every rank."""
    for nan_rank in range(world()):
        for norm_type in (float("inf"), 2.0):
            for p in model.parameters():
                p.grad = torch.distributed.tensor.ones(p.shape, device_mesh=p.device_mesh, placements=p.placements)
            if rank() == nan_rank:
                model.head.weight.grad._local_tensor.view(-1)[0] = math.nan
            got = clip_grad_norm_(model, 1.0, norm_type)
            assert math.isnan(got), f"NaN on rank {nan_rank}, norm {norm_type}: got {got} on rank {rank()}"
            with contextlib.suppress(RuntimeError):
                clip_grad_norm_(model, 1.0, norm_type, error_if_nonfinite=True)
                raise AssertionError(f"NaN on rank {nan_rank}, norm {norm_type}: error_if_nonfinite did not raise")


def _clip_follows_a_replaced_parameter(model: nn.Module) -> None:
    """clip_grad_norm_ groups a model's parameters by layout once and reuses that while the model holds the
    same parameters: a parameter replaced by one laid out otherwise (Replicate: counted once, not summed over
    the ranks as a shard is) must be regrouped. A stale grouping counts its share once per rank."""
    from torch.distributed.tensor import distribute_tensor

    old = model.norm.weight
    model.norm.weight = nn.Parameter(distribute_tensor(old.full_tensor().detach(), old.device_mesh, [Replicate()]))
    for p in model.parameters():
        p.grad = torch.distributed.tensor.zeros(p.shape, device_mesh=p.device_mesh, placements=p.placements)
    model.norm.weight.grad = distribute_tensor(torch.full(old.shape, 2.0), old.device_mesh, [Replicate()])
    model.head.weight.grad = distribute_tensor(torch.ones(model.head.weight.shape), old.device_mesh, old.placements)
    want = math.sqrt(4.0 * old.numel() + model.head.weight.numel())
    got = clip_grad_norm_(model, 1e9)
    assert abs(got - want) <= 8 * UNIT_ROUNDOFF * want, f"after replacing norm.weight: norm {got}, want {want}"
    # Two layouts now: the ranks pass their parameters in different orders, and the groups' collectives still pair
    params = list(model.parameters())
    got = clip_grad_norm_(params if rank() == 0 else params[::-1], 1e9)
    assert abs(got - want) <= 8 * UNIT_ROUNDOFF * want, f"parameters in another order on rank 1: {got}, {want}"
    # A gradient laid out unlike its parameter (Replicate on a Shard parameter) is counted once, not per rank
    head = model.head.weight
    head.grad = head.grad.redistribute(head.device_mesh, [Replicate()])
    got = clip_grad_norm_(model, 1e9)
    assert abs(got - want) <= 8 * UNIT_ROUNDOFF * want, f"a Replicate gradient on a Shard parameter: {got}, {want}"
    # A parameter swapped in place for one laid out otherwise (same object, another layout) is regrouped
    replicated = nn.Parameter(distribute_tensor(head.full_tensor().detach(), head.device_mesh, [Replicate()]))
    torch.utils.swap_tensors(head, replicated)
    head.grad = distribute_tensor(torch.ones(head.shape), head.device_mesh, [Replicate()])
    got = clip_grad_norm_(model, 1e9)
    assert abs(got - want) <= 8 * UNIT_ROUNDOFF * want, f"head swapped in place to Replicate: {got}, {want}"
    head.grad = torch.ones(head.shape)  # a plain gradient on a DTensor parameter: the whole or a shard? refused
    with pytest.raises(ValueError, match="plain-tensor gradient"):
        clip_grad_norm_(model, 1e9)


def _clip_keeps_no_model_alive() -> None:
    """clip_grad_norm_'s per-model cache holds no parameter: one referring back to its model (an attribute, a
    hook's closure) must not keep the model alive."""
    import gc
    import weakref

    model, _ = sharded_gpt()
    for p in model.parameters():
        p.grad = torch.distributed.tensor.ones(p.shape, device_mesh=p.device_mesh, placements=p.placements)
        p.owner = model
    clip_grad_norm_(model, 1.0)
    alive = weakref.ref(model)
    del model, p
    gc.collect()
    assert alive() is None, "clip_grad_norm_ kept a model alive after its last reference went"


@case(ranks=4)
def clip_grad_norm_hybrid_2x2():
    model, ref = sharded_gpt(shard_strat="HYBRID_SHARD", replicate_size=2)
    x, y = tokens(4, seed=2)
    _clip_parity(model, ref, (x, y), replicas=2)


@case
def clip_grad_norm_across_meshes_tp():
    """TP on 2 ranks then FSDP on the (size-1) dp mesh: gradients on a 1-D and a 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (1, world()), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = TPNet()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], tp_plan())
    fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", mesh=mesh["dp"])
    meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
    assert meshes == {("dp",), ("dp", "tp")}, meshes
    x, y = tokens(4, seed=3, vocab=32)

    def loss_of(net, inputs, targets):
        return F.cross_entropy(net(inputs).flatten(0, 1), targets.flatten())

    for norm_type in (2.0, float("inf")):
        model.zero_grad()
        ref.zero_grad()
        loss_of(ref, x, y).backward()
        loss_of(model, x, y).backward()  # every TP rank sees the whole batch (dp = 1)
        # Row-parallel layers add two partial products where the reference has one dot product:
        # a regrouping of each sum, carried back through two layers. 64 roundings of each
        # tensor's largest gradient bounds that; a wrong TP gradient is off by O(1) relative.
        assert_grads_match(model, ref, ulps=64)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=norm_type).item()
        got = clip_grad_norm_(model, 0.01, norm_type=norm_type)
        bound = _norm_bound(ref, norm_type) + 64 * UNIT_ROUNDOFF
        assert abs(got - want) <= bound * want, f"norm {norm_type}: {got} vs {want}"


# ---------------------------------------------------------------------------------------------
# memory_report


@case
def memory_report_values():
    model, ref = sharded_gpt()
    n_params = len(list(ref.parameters()))
    full_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = memory_report(model, opt)
    assert isinstance(report, dict)
    assert report["rank"] == rank() and report["world_size"] == world()
    params = report["params"]
    assert params["full_bytes"] == full_bytes, (params, full_bytes)
    assert params["tensors"] == n_params
    local = torch.tensor(params["local_bytes"])
    dist.all_reduce(local)
    assert local.item() == full_bytes, f"shards sum to {local.item()}, not {full_bytes}"
    assert 0.45 <= params["local_bytes"] / full_bytes <= 0.55, params
    assert report["grads"]["local_bytes"] == 0 and report["optimizer_state"]["tensors"] == 0
    x, y = tokens(4, seed=4)
    lm_loss(model(local_slice(x)), local_slice(y)).backward()
    opt.step()
    report = memory_report(model, opt)
    assert report["grads"]["local_bytes"] == params["local_bytes"], report["grads"]
    assert report["grads"]["full_bytes"] == full_bytes
    # AdamW: exp_avg + exp_avg_sq (sharded like the parameter) + a float32 scalar step each
    opt_state = report["optimizer_state"]
    assert opt_state["local_bytes"] == 2 * params["local_bytes"] + 4 * n_params, opt_state
    assert opt_state["full_bytes"] == 2 * full_bytes + 4 * n_params, opt_state
    total = report["total"]
    assert total["local_bytes"] == sum(report[k]["local_bytes"] for k in ("params", "grads", "optimizer_state"))
    table = report.table()
    assert str(report) == table
    for label in ("parameters", "gradients", "optimizer state", "total", f"rank {rank()}/{world()}"):
        assert label in table, table
    assert "0.5" in table.splitlines()[2], table  # parameters row: local/full ratio ~0.50
    # unsharded (NO_SHARD): every rank holds everything
    no_shard, _ = sharded_gpt(shard_strat="NO_SHARD")
    assert memory_report(no_shard)["params"]["local_bytes"] == full_bytes


# ---------------------------------------------------------------------------------------------
# loss reduction


def _masked_batch(seed: int) -> dict[str, torch.Tensor]:
    """4 sequences; rank 0's half keeps ~90% of its tokens, rank 1's half ~10%."""
    x, y = tokens(4, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    keep = torch.cat([torch.rand(2, SEQ, generator=g) < 0.9, torch.rand(2, SEQ, generator=g) < 0.1])
    keep[2, 0] = True  # at least one token on the sparse half
    labels = torch.where(keep, y, torch.full_like(y, -100))
    return {"input_ids": x, "labels": labels, "loss_mask": keep.long()}


# The token-weighted reductions compute the reference's global mean by another grouping: each
# rank sums its own tokens' terms, scales them, and the ranks' partial gradients are averaged.
# Each value (the loss, every gradient element) is a sum of one term per token regrouped, so it
# differs from the reference by at most a few roundings per token of its largest magnitude:
# 4 * tokens in the global batch, in units of the largest element (see assert_close_scaled).
REGROUPED_ULPS = 4 * 4 * SEQ


def _slice_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: local_slice(v) for k, v in batch.items()}


def _reference_token_mean(ref: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = ref(batch["input_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


@case(group="loss")
def token_weighted_loss_and_grads():
    model, ref = sharded_gpt()
    batch = _masked_batch(seed=5)
    counts = batch["loss_mask"].view(2, -1).sum(dim=1)
    assert counts[0] > 3 * counts[1], counts  # very different mask counts per rank
    want = _reference_token_mean(ref, batch)
    want.backward()
    reduction = MaskedTokenLossReduction()
    mine = _slice_batch(batch)
    loss, record = reduction.forward(mine, model(mine["input_ids"]))
    loss.backward()
    got = reduction.reduce([record])
    assert_close_scaled("reduced loss", got, want, REGROUPED_ULPS)
    assert_grads_match(model, ref, ulps=REGROUPED_ULPS)
    # the NeMo-style mean of per-rank means is measurably different here: the test can fail
    local_mean = record["loss_sum_and_ub_size"][0] / record["loss_sum_and_ub_size"][1]
    mean_of_means = local_mean.clone()
    dist.all_reduce(mean_of_means)
    assert abs(mean_of_means.item() / world() - want.item()) > 1e-3, "batch not unbalanced enough"


@case(group="loss")
def token_weighted_loss_micro_batches_and_ignore_index():
    """Two micro-batches per rank, labels only (ignore_index): reduce over both records."""
    model, ref = sharded_gpt()
    b1, b2 = _masked_batch(seed=6), _masked_batch(seed=7)
    both = {k: torch.cat([b1[k], b2[k]]) for k in ("input_ids", "labels")}
    want = _reference_token_mean(ref, both).item()
    reduction = MaskedTokenLossReduction()
    records = []
    for b in (b1, b2):
        mine = {k: local_slice(b[k]) for k in ("input_ids", "labels")}
        _, record = reduction.forward(mine, model(mine["input_ids"]))
        records.append(record)
    got = reduction.reduce(records).item()
    # two batches' tokens: twice the regrouped terms
    assert abs(got - want) <= 2 * REGROUPED_ULPS * UNIT_ROUNDOFF * want, (got, want)
    # validation mode: the loss is this rank's own mean, and forward communicates nothing
    val = MaskedTokenLossReduction(validation_step=True)
    mine = {k: local_slice(b1[k]) for k in ("input_ids", "labels")}
    logits = model(mine["input_ids"]).detach()
    counts = comm_counts(lambda: val.forward(mine, logits))
    assert counts == {}, counts
    loss, _ = val.forward(mine, logits)
    local_want = F.cross_entropy(logits.flatten(0, 1), mine["labels"].flatten(), ignore_index=-100)
    assert_close_scaled("validation loss", loss, local_want, REGROUPED_ULPS)


@case(group="loss")
def reduce_is_one_all_reduce_of_two_numbers():
    reduction = MaskedTokenLossReduction()
    records = [reduction.forward(_slice_batch(_masked_batch(s)), torch.randn(2, SEQ, VOCAB))[1] for s in (8, 9, 10)]
    seen = []
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        seen.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        reduction.reduce(records)
    finally:
        dist.all_reduce = original
    assert seen == [2], f"reduce() all-reduced tensors of sizes {seen}"


@case(group="loss")
def all_masked_rank_gives_no_nan():
    model, ref = sharded_gpt()
    batch = _masked_batch(seed=11)
    batch["loss_mask"][2:] = 0  # rank 1: nothing to learn from
    batch["labels"][2:] = -100
    want = _reference_token_mean(ref, batch)
    want.backward()
    reduction = MaskedTokenLossReduction()
    mine = _slice_batch(batch)
    loss, record = reduction.forward(mine, model(mine["input_ids"]))
    assert torch.isfinite(loss), loss
    if rank() == 1:
        assert loss.item() == 0.0, loss
    loss.backward()
    got = reduction.reduce([record])
    assert torch.isfinite(got), got
    assert_close_scaled("reduced loss", got, want, REGROUPED_ULPS)
    for name, param in model.named_parameters():
        assert torch.isfinite(full(param.grad)).all(), f"{name}: non-finite gradient"
    assert_grads_match(model, ref, ulps=REGROUPED_ULPS)
    # every rank all-masked: 0, not NaN
    empty = {k: torch.zeros_like(v) if k == "loss_mask" else v for k, v in mine.items()}
    loss, record = reduction.forward(empty, model(empty["input_ids"]))
    assert loss.item() == 0.0 and reduction.reduce([record]).item() == 0.0


@case(group="loss")
def per_sample_mean_uneven_batches():
    """Rank 0 holds 3 samples, rank 1 holds 1: every sample weighs the same globally."""
    model, ref = sharded_gpt()
    batch = _masked_batch(seed=12)
    x, labels = batch["input_ids"], batch["labels"]

    def per_sample(logits, lab):
        ce = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="none").view(lab.shape)
        valid = (lab != -100).float()
        return (ce * valid).sum(1) / valid.sum(1)

    want = per_sample(ref(x), labels).mean()
    want.backward()
    mine = slice(0, 3) if rank() == 0 else slice(3, 4)
    reduction = PerSampleLossReduction()
    loss, record = reduction.forward({"labels": labels[mine]}, model(x[mine]))
    loss.backward()
    got = reduction.reduce([record])
    assert_close_scaled("reduced loss", got, want, REGROUPED_ULPS)
    assert_grads_match(model, ref, ulps=REGROUPED_ULPS)
    # one loss per sample (no labels): plain mean over all ranks' samples
    values = torch.tensor([1.0, 2.0, 3.0]) if rank() == 0 else torch.tensor([10.0])
    _, record = reduction.forward({}, values)
    assert reduction.reduce(record).item() == 4.0


if __name__ == "__main__":
    run_cases(CASES)
