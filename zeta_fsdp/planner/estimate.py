"""Sharding planner: what ``fsdp()`` will do to a model, and what it will cost per rank, before any run.

``plan()`` needs no process group and allocates nothing (a ``meta`` model is fine). The units come
from ``wrapping.build_wrap_plan`` (the same code ``fsdp()`` runs), the mesh from
``distributed.mesh_shape``, and the byte counts follow FSDP2's storage rules exactly:

* a parameter is split along dim 0 with ``torch.chunk``: every rank of the shard group stores
  ``ceil(dim0 / shard_size)`` rows (FSDP2 pre-pads its shard), while the *logical* local shard of
  the last ranks may be shorter or empty;
* the sharded gradient is a view into the padded reduce-scatter output (padded rows, original dtype);
* AdamW state is ``zeros_like`` of the logical local shard (2 tensors) plus a 4-byte ``step``;
* the all-gather buffers are ``shard_size * padded rows`` in the ``mp`` compute dtype.

Per-rank figures are for one rank (``rank=0`` by default: the largest shard). What depends on
the engine is the engine's (``engines``); ``dry_run()`` checks the bytes against the real ``fsdp()``.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Iterable, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..costs import accumulation_costs, gradient_wait_dtype
from ..engines import PlanTerms, engine_named
from ..fp32_modules import KeepFp32Spec, select_fp32
from ..options import choose_engine, resolve_master_dtype, resolve_mixed_precision, resolve_sharding, stored_dtype
from ..wrapping import BlockSpec, WrapUnit, build_wrap_plan
from .dry_run import dry_run_batch, dry_run_job, dtype_name, resolve_world_and_mesh
from .memory_plan import MemoryPlan, UnitEstimate

__all__ = ["OPTIMIZERS", "MemoryPlan", "UnitEstimate", "plan"]

# Optimizer name -> number of parameter-sized state tensors (Adam/AdamW: exp_avg, exp_avg_sq).
OPTIMIZERS: dict[str, int] = {"adamw": 2, "adam": 2, "none": 0}
# Adam's ``step`` is a 0-d float32 tensor per parameter (torch's default scalar dtype).
_STEP_BYTES = 4


def _shard_geometry(param: torch.Tensor, shard_size: int, shard_rank: int) -> tuple[int, int, int]:
    """(padded elements per rank, logical elements on ``shard_rank``, all-gathered elements).

    Mirrors FSDP2's ``_chunk_with_empty(param, shard_size, dim=0)``: chunks of ``ceil(dim0/n)``
    rows; rank ``r`` gets rows ``[r*c, (r+1)*c)`` clipped to ``dim0`` (possibly none).
    """
    dim0 = param.shape[0] if param.dim() > 0 else 1
    row = param.numel() // dim0 if dim0 else 0
    chunk = math.ceil(dim0 / shard_size)
    rows = max(0, min(chunk, dim0 - shard_rank * chunk))
    return chunk * row, rows * row, shard_size * chunk * row


def plan(
    model: nn.Module,
    world_size: Optional[int] = None,
    shard_strat: Any = "FULL_SHARD",
    mp: Union[str, MixedPrecisionPolicy] = "fp32",
    auto_wrap: bool = True,
    TransformerBlock: BlockSpec = None,  # noqa: N803 - the same name as fsdp()
    *,
    rank: int = 0,
    replicate_size: Optional[int] = None,
    local_world_size: Optional[int] = None,
    optimizer: str = "adamw",
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    dry_run: bool = False,
    master_dtype: Union[str, torch.dtype, None] = "fp32",
    micro_batches: Optional[int] = None,
    keep_fp32: KeepFp32Spec = None,
) -> MemoryPlan:
    """Plan ``fsdp(model, auto_wrap, mp, shard_strat, TransformerBlock)`` at ``world_size`` ranks.

    No process group, no allocation: ``model`` may live on ``meta``; the units are those ``fsdp()``
    would create. Bytes are for ``rank`` (default 0, the largest shard). HYBRID meshes use
    ``replicate_size`` replicas, else one per node of ``local_world_size`` ranks (default
    ``min(world_size, 8)``). ``optimizer``: ``"adamw"``, ``"adam"`` or ``"none"``. ``dry_run=True``
    attaches the real ``fsdp()`` on a meta copy under a fake process group (``MemoryPlan.dry_run``).
    ``master_dtype`` is ``fsdp()``'s (trainable parameters, gradients and optimizer state are
    counted in it); ``keep_fp32`` too (those parameters, and a Hugging Face model's declared ones, are
    counted at fp32, gathered and stored). ``micro_batches=K`` adds what each ``no_sync`` choice costs for K micro-batches.
    A bad argument raises ``ValueError`` listing the accepted values.

    Example:
        >>> from zeta_fsdp.models.gpt import small
        >>> with torch.device("meta"):
        ...     model = small()
        >>> p = plan(model, world_size=1024, shard_strat="HYBRID_SHARD", mp="bf16")
        >>> p.mesh_shape, p.param_bytes
        ((128, 8), 18260)
    """
    _check_plan_args(model, optimizer, micro_batches)
    policy, master, spec = _resolve_options(mp, master_dtype, shard_strat)
    world_size, shape = _world_and_mesh(spec, world_size, replicate_size, local_world_size, rank)
    ignored = set(ignored_params or ())
    wrap = build_wrap_plan(
        model, auto_wrap=auto_wrap, transformer_block=TransformerBlock, ignored_params=ignored, caller="plan"
    )
    fp32 = select_fp32(model, keep_fp32, policy, caller="plan")
    engine = _choose_engine(model, wrap, spec, policy, ignored, fp32)  # (name, why)
    job = dict(world_size=world_size, rank=rank, mesh_shape=tuple(shape), optimizer=optimizer)
    result = _memory_plan(model, wrap, spec, policy, master, fp32, engine, dict(job, micro_batches=micro_batches))
    _add_notes(result, dict(model.named_parameters()), wrap.notes)
    if dry_run:  # (the flag shadows the function dry_run(): call what it calls)
        result.dry_run = _dry_run(model, result, policy, auto_wrap, TransformerBlock, wrap, master)
    return result


def _memory_plan(
    model: nn.Module,
    wrap: Any,
    spec: Any,
    policy: MixedPrecisionPolicy,
    master: Optional[torch.dtype],
    fp32: Any,
    engine: tuple[str, str],
    job: dict[str, Any],
) -> MemoryPlan:
    """The plan's figures for ``job``'s rank (``MemoryPlan``'s world, rank, mesh, optimizer fields) on
    ``engine`` (``(name, why)``): each unit's bytes, the engine's terms, the ignored parameters' bytes,
    the stored dtypes."""
    engine, why = engine
    params, n_state = dict(model.named_parameters()), OPTIMIZERS[job["optimizer"]]
    stored = _stored_dtypes(params, master, fp32.param_names)
    shape = job["mesh_shape"]
    shard = (shape[-1], job["rank"] % shape[-1])  # meshes are row-major: (replicate, shard)
    units = [_estimate_unit(u, params, stored, policy, *shard, n_state, set(fp32.param_names)) for u in wrap.units]
    peak, all_reduces, notes = _engine_terms(engine, why, model, units, policy, spec, shape[-1], stored)
    ignored_bytes, ignored_state = _ignored_bytes(wrap, params, stored, n_state)
    stored_label = _stored_label(params, stored)
    return MemoryPlan(
        model_name=type(model).__name__,
        model_bytes=wrap.nbytes + ignored_bytes,
        strategy=spec.name,
        mp=_mp_label(policy),
        reshard_after_forward=spec.reshard_after_forward,
        units=units,
        ignored_param_names=list(wrap.ignored_param_names),
        ignored_bytes=ignored_bytes,
        ignored_optimizer_bytes=ignored_state,
        allgather_peak_bytes=peak,
        master_dtype=stored_label,
        optimizer_state_dtype=stored_label,  # torch optimizers keep state in the parameter's dtype
        engine=engine,
        ddp_all_reduce_count=all_reduces,
        notes=notes,
        **job,
    )


def _dry_run(
    model: nn.Module,
    result: MemoryPlan,
    policy: MixedPrecisionPolicy,
    auto_wrap: bool,
    block: BlockSpec,
    wrap: Any,
    master: Optional[torch.dtype],
) -> Any:
    """``plan(dry_run=True)``: the real ``fsdp()`` on a meta copy, as ``result``'s rank of its job."""
    replicas = result.mesh_shape[0] if len(result.mesh_shape) == 2 else None
    args = (result.world_size, result.strategy, policy, auto_wrap, block, result.rank, replicas)
    job = dry_run_job(*args, ignored_param_names=wrap.ignored_param_names, master_dtype=master)
    return dry_run_batch(model, [job])[0]


def _world_and_mesh(
    spec: Any, world_size: Optional[int], replicate_size: Optional[int], local_world_size: Optional[int], rank: Any
) -> tuple[int, tuple[int, ...]]:
    """``resolve_world_and_mesh``, and ``rank`` checked against the world size."""
    world_size, shape = resolve_world_and_mesh(spec, world_size, replicate_size, local_world_size, "plan")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"plan(): rank={rank!r} is not accepted. Accepted: an int in [0, {world_size - 1}].")
    return world_size, shape


def _choose_engine(
    model: nn.Module, wrap: Any, spec: Any, policy: MixedPrecisionPolicy, ignored: set, fp32: Any
) -> tuple[str, str]:
    """The engine ``fsdp()`` would pick, and why (``options.choose_engine``); its fp32 units added to ``wrap``."""
    trainable = any(p.requires_grad for p in model.parameters())
    engine, why = choose_engine(spec, policy, has_ignored=bool(ignored), has_trainable=trainable, has_fp32=bool(fp32))
    engine_named(engine).add_fp32_units(wrap, model, fp32.param_names, caller="plan")
    return engine, why


def _engine_terms(
    engine: str,
    why: str,
    model: nn.Module,
    units: list[UnitEstimate],
    policy: MixedPrecisionPolicy,
    spec: Any,
    shard_size: int,
    stored: dict[str, torch.dtype],
) -> tuple[int, int, list[str]]:
    """The engine's terms (``Engine.plan_costs``): all-gather peak, all-reduces per synced backward, notes."""
    grads = [(stored[n], p.numel() * stored[n].itemsize) for n, p in model.named_parameters() if p.requires_grad]
    terms = PlanTerms(model, units, policy, spec.reshard_after_forward, shard_size, grads, why)
    return engine_named(engine).plan_costs(terms)


def _resolve_options(
    mp: Union[str, MixedPrecisionPolicy], master_dtype: Union[str, torch.dtype, None], shard_strat: Any
) -> tuple[MixedPrecisionPolicy, Optional[torch.dtype], Any]:
    """``fsdp()``'s options as ``fsdp()`` resolves them, errors naming ``plan()``."""
    policy = resolve_mixed_precision(mp, caller="plan")
    master = resolve_master_dtype(master_dtype, caller="plan")
    return policy, master, resolve_sharding(shard_strat, caller="plan")


def _check_plan_args(model: Any, optimizer: str, micro_batches: Optional[int]) -> None:
    """``plan()``'s own arguments (the options ``fsdp()`` shares are checked by their resolvers)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"plan(): model must be a torch.nn.Module, got {type(model).__name__}.")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"plan(): unknown optimizer={optimizer!r}. Accepted: {', '.join(map(repr, OPTIMIZERS))}.")
    if micro_batches is not None:
        accumulation_costs(micro_batches, sharded=0, unsharded=0, partial=0, reduce_scatter_units=0, all_reduce_units=0)


def _ignored_bytes(
    wrap: Any, params: dict[str, nn.Parameter], stored: dict[str, torch.dtype], n_state: int
) -> tuple[int, int]:
    """(parameter bytes, optimizer bytes) of the ignored parameters: whole (unsharded) on every rank, as are
    their gradients."""
    sizes = {n: params[n].numel() * stored[n].itemsize for n in wrap.ignored_param_names}
    state = sum(n_state * b + _STEP_BYTES for n, b in sizes.items() if n_state and params[n].requires_grad)
    return sum(sizes.values()), state


def _stored_dtypes(
    params: dict[str, nn.Parameter], master: Optional[torch.dtype], fp32_names: Sequence[str]
) -> dict[str, torch.dtype]:
    """What ``fsdp(master_dtype=)`` stores each parameter in; fp32 modules' parameters in fp32."""
    stored = {name: stored_dtype(p, master) for name, p in params.items()}
    stored.update({n: torch.float32 for n in fp32_names if params[n].is_floating_point()})
    return stored


def _mp_label(policy: MixedPrecisionPolicy) -> str:
    """The policy in words: compute and reduce dtypes, or no casting."""
    if policy.param_dtype is None and policy.reduce_dtype is None:
        return "fp32 (no casting)"
    return f"compute {dtype_name(policy.param_dtype)}, reduce {dtype_name(policy.reduce_dtype)}"


def _stored_label(params: dict[str, nn.Parameter], stored: dict[str, torch.dtype]) -> str:
    """The dtype floating-point parameters are stored in: one name, ``"mixed: ..."`` or ``"none"``."""
    names = sorted({dtype_name(stored[n]) for n, p in params.items() if p.is_floating_point()})
    return names[0] if len(names) == 1 else ("mixed: " + ", ".join(names) if names else "none")


def _add_notes(result: MemoryPlan, params: dict[str, nn.Parameter], wrap_notes: list[str]) -> None:
    """The plan's notes after the engine's: frozen parameters, the wrap plan's own, dim-0 padding."""
    frozen = [p for p in params.values() if not p.requires_grad]
    if frozen:
        result.notes.append(
            f"{len(frozen)} frozen parameter(s) ({sum(p.numel() for p in frozen):,} elements) are stored in their "
            "own dtype, sharded, with no gradient and no optimizer state"
        )
    result.notes.extend(wrap_notes)
    if any(u.param_bytes != u.local_param_bytes for u in result.units):
        result.notes.append(
            f"dim-0 padding: each rank stores {result.param_bytes:,} parameter bytes; rank {result.rank}'s logical "
            f"shard is {result.local_param_bytes:,} (optimizer state follows the logical shard)"
        )


def _estimate_unit(
    unit: WrapUnit,
    params: dict[str, nn.Parameter],
    stored: dict[str, torch.dtype],
    policy: MixedPrecisionPolicy,
    shard_size: int,
    shard_rank: int,
    n_state: int,
    kept: frozenset = frozenset(),
) -> UnitEstimate:
    sizes: Counter = Counter()
    for name in unit.param_names:
        param, dtype = params[name], stored[name]
        padded, local, gathered = _shard_geometry(param, shard_size, shard_rank)
        # FSDP2 casts only floating-point parameters to the compute dtype.
        cast = policy.param_dtype and param.is_floating_point() and name not in kept  # kept: fp32 modules
        compute = policy.param_dtype if cast else dtype
        sizes["unsharded_bytes"] += gathered * compute.itemsize
        sizes["param_bytes"] += padded * dtype.itemsize
        sizes["local_param_bytes"] += local * dtype.itemsize
        if param.requires_grad:  # frozen parameters get neither gradients nor optimizer state
            wait = gradient_wait_dtype(policy, dtype).itemsize
            sizes["grad_bytes"] += padded * dtype.itemsize
            sizes["unsharded_grad_bytes"] += param.numel() * wait
            sizes["partial_grad_bytes"] += padded * wait
            sizes["optimizer_bytes"] += n_state * local * dtype.itemsize + _STEP_BYTES if n_state else 0
    return UnitEstimate(unit.name, unit.kind, len(unit.param_names), unit.numel, **sizes)
