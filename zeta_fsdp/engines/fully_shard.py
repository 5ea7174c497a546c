"""FSDP2 (``fully_shard``, DTensor parameters): every strategy but NO_SHARD in fp32/bf16.

``engines.SEAM``, as in ``engines.replicate``. A model neither engine manages lands here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..costs import AccumulationCost, accumulation_costs, gradient_wait_dtype, peak_by_device
from ..distributed import init_mesh
from ..options import stored_dtype
from ..torch_compat import HAS_PARAM_DTYPE_OVERRIDE, param_mp_policy
from ..wrapping import WrapPlan
from ..wrapping import add_fp32_units as plan_fp32_units
from . import unused
from .base import PlanTerms, WrapOptions
from .fsdp2_state import fsdp_param_groups, fsdp_state, refresh_reduce_dtypes
from .record import compute_device

# The name options.choose_engine gives this engine.
NAME = "fully_shard"
# Each rank holds its own shard: a parameter's rows come from the rank that owns them.
REPLICAS_EQUAL = False
# mp is a MixedPrecisionPolicy (parameters cast at all-gather), never torch.autocast.
AUTOCAST_MP = False

# torch >= 2.13: FSDP2 can reduce a zero gradient for a parameter this rank did not use. Older
# releases reduce-scatter only the gradients a rank has, so ranks that used different parameters
# (MoE routing) sum one parameter's gradient into another's, silently.
REDUCES_UNUSED_PARAMS = hasattr(FSDPModule, "set_reduce_scatter_unused_params")


def managed(model: nn.Module) -> list[nn.Module]:
    """The FSDP units in ``model``, itself included."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def check(plan: WrapPlan, model: nn.Module, master: Optional[torch.dtype]) -> None:
    """What ``fully_shard`` would reject in a unit, checked before any unit is sharded (a unit
    refused after others were would leave a half-wrapped model): mixed dtypes among a unit's
    trainable parameters as they WILL be stored (one reduce-scatter per unit; frozen ones may
    differ), or a container without ``forward`` as a unit; a forward that may skip parameters on
    some ranks where this torch cannot reduce them right.
    """
    _check_unused_params(plan)
    params = dict(model.named_parameters())
    for unit in plan.units:
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in unit.param_names:
            if params[name].requires_grad:
                by_dtype.setdefault(stored_dtype(params[name], master), []).append(name)
        if len(by_dtype) > 1:
            detail = "; ".join(
                f"{str(d).replace('torch.', '')}: {', '.join(n[:3])}{' ...' if len(n) > 3 else ''}"
                for d, n in by_dtype.items()
            )
            raise ValueError(
                f"fsdp(): FSDP unit {unit.name} mixes trainable parameter dtypes ({detail}). FSDP2 needs "
                "one dtype among a unit's trainable parameters (frozen ones may differ): keep "
                "master_dtype='fp32' (the default: trainable floating parameters are sharded in fp32), "
                "cast the model to one dtype first, freeze the odd ones (requires_grad=False), or pass "
                "them in ignored_params."
            )
        for name, module in zip(unit.module_names, unit.modules):
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
                raise ValueError(
                    f"fsdp(): {name or '<root>'} is a {type(module).__name__}, which has no forward(); "
                    "fully_shard cannot shard it as a unit. Pass the model that calls it (or, for "
                    "TransformerBlock, the class of the layers it holds)."
                )


def _check_unused_params(plan: WrapPlan) -> None:
    """On a torch without ``set_reduce_scatter_unused_params``, refuse a model whose forward may skip
    parameters on some ranks (``WrapPlan.skippable``): its gradients would come out wrong, silently."""
    if REDUCES_UNUSED_PARAMS or not plan.skippable:
        return
    name, why = next(iter(plan.skippable.items()))
    raise ValueError(
        f"fsdp(): {name} ({why}) may go unused on some ranks in a step, and torch {torch.__version__} "
        "cannot shard such a model correctly: its FSDP2 reduce-scatters only the gradients each rank has, "
        "so ranks that used different parameters add one parameter's gradient into another's. torch 2.13 "
        "added the fix (FSDPModule.set_reduce_scatter_unused_params): pip install 'torch>=2.13', or use "
        "shard_strat='NO_SHARD' in fp32/bf16 (DDP's engine finds unused parameters)."
    )


def add_fp32_units(plan: WrapPlan, model: nn.Module, names: Sequence[str], caller: str = "fsdp") -> None:
    """fp32 parameters get units of their own where this torch has no per-parameter dtype override
    (``wrapping.add_fp32_units``); on torch >= 2.15 ``unit_policy`` keeps them fp32 in place."""
    if names and not HAS_PARAM_DTYPE_OVERRIDE:
        plan_fp32_units(plan, model, names, caller=caller)


def mesh_for(options: WrapOptions) -> Optional[DeviceMesh]:
    """The caller's mesh, else one of ``options.shape`` (``options.resolve_mesh_shape``) over the default group."""
    return options.mesh if options.mesh is not None else init_mesh(options.shape, options.device)


def wrap(model: nn.Module, plan: WrapPlan, options: WrapOptions) -> int:
    """``fully_shard`` every unit bottom-up on ``options.mesh``; returns this rank's index in its shard group.

    One policy for every unit (FSDP2 does not inherit it). The root and the ``keep_tail`` units
    forward runs last keep their parameters after forward: backward would all-gather them again
    at once. 0-dim parameters, which ``fully_shard`` cannot shard, stay whole. ``fp32_params``
    compute and reduce in fp32 (``unit_policy``).
    """
    mesh, device = options.mesh, options.device
    scalars = [model.get_parameter(n) for n in plan.scalar_param_names]
    _shard_units(model, plan, options, set(options.ignored) | set(scalars))
    _set_prefetch(plan, options.prefetch)
    for scalar in scalars:  # FSDP does not move them
        if not scalar.is_meta and scalar.device != device:
            scalar.data = scalar.data.to(device)
    _average_whole_grads(model, scalars, mesh)
    _leave_unused_grads_none(model, plan, mesh)
    return mesh.get_local_rank(mesh.ndim - 1) if mesh.size(mesh.ndim - 1) > 1 else 0


def _shard_units(model: nn.Module, plan: WrapPlan, options: WrapOptions, ignored: set[nn.Parameter]) -> None:
    """``fully_shard`` each unit, bottom-up, with its policy and reshard setting."""
    # Pinned host memory needs an accelerator; on a CPU-only run offloading is a no-op anyway.
    offload = CPUOffloadPolicy(pin_memory=options.device.type != "cpu") if options.cpu_offload else OffloadPolicy()
    kept = {id(u) for u in [u for u in plan.backward_order if u.kind != "embedding"][: options.keep_tail]}
    fp32_ids = frozenset(id(model.get_parameter(n)) for n in options.fp32_params)
    for unit in plan.units:
        fully_shard(
            unit.target,
            mesh=options.mesh,
            reshard_after_forward=None if unit.kind == "root" else False if id(unit) in kept else options.reshard,
            mp_policy=unit_policy(unit, options.mp_policy, fp32_ids),
            offload_policy=offload,
            ignored_params=ignored or None,
        )
        if REDUCES_UNUSED_PARAMS:
            # A parameter this rank did not use (an expert no token reached) reduces a zero gradient,
            # so every rank's reduce-scatter has the same layout (where NO rank used it, the zero is
            # dropped: _leave_unused_grads_none). Free when every parameter is used
            # (benchmarks/results/unused_params.md).
            unit.modules[0].set_reduce_scatter_unused_params(True, recurse=False)


def _leave_unused_grads_none(model: nn.Module, plan: WrapPlan, mesh: DeviceMesh) -> None:
    """A parameter no rank used in a step ends with ``.grad is None``, as in one process, not with the zero
    ``set_reduce_scatter_unused_params`` reduces for it (``engines.unused``). Only the parameters the plan
    says a forward may skip are watched; a model without them gets no hook and no collective."""
    if not REDUCES_UNUSED_PARAMS:  # check() refused such a model on this torch
        return
    tracker = unused.track(model, _param_groups(model), list(plan.skippable), mesh)
    if tracker is not None:
        model.register_forward_hook(lambda _module, _inputs, output: tracker.after_forward(output_tensors(output)))


def _set_prefetch(plan: WrapPlan, prefetch: Optional[int]) -> None:
    """Each unit all-gathers the next ``prefetch`` units in forward, the previous ones in backward."""
    for order, setter in ((plan.forward_order, "forward"), (plan.backward_order, "backward")):
        for i, unit in enumerate(order if prefetch else ()):
            targets = [u.modules[0] for u in order[i + 1 : i + 1 + prefetch]]
            if targets:
                getattr(unit.modules[0], f"set_modules_to_{setter}_prefetch")(targets)


def unit_policy(unit: Any, mp_policy: MixedPrecisionPolicy, fp32_ids: frozenset) -> MixedPrecisionPolicy:
    """The policy of one unit: ``mp``'s, except for fp32 parameters (``fp32_modules``). An ``"fp32"``
    unit (``wrapping.add_fp32_units``, torch < 2.15) computes in its parameters' own dtype (fp32) and
    reduces in fp32; on torch >= 2.15 every unit keeps ``mp`` with a per-parameter override instead
    (no extra unit, no extra all-gather); gradients of a unit mixing dtypes reduce in fp32.

    Example:
        >>> from types import SimpleNamespace
        >>> unit_policy(SimpleNamespace(kind="fp32"), MixedPrecisionPolicy(torch.bfloat16), frozenset()).param_dtype
    """
    if unit.kind == "fp32":
        return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, output_dtype=mp_policy.output_dtype)
    if not fp32_ids or not HAS_PARAM_DTYPE_OVERRIDE:
        return mp_policy

    def keep_own_dtype(param: nn.Parameter) -> Optional[torch.dtype]:
        return param.dtype if id(param) in fp32_ids else None

    return dataclasses.replace(
        mp_policy, reduce_dtype=mp_policy.reduce_dtype or torch.float32, param_dtype_override_fn=keep_own_dtype
    )


def unfreeze_check(model: nn.Module, master: Optional[torch.dtype]) -> Callable[[], Optional[str]]:
    """``unfreeze.guard_unfreezing``'s check on FSDP2: a parameter frozen at wrap time in another dtype than
    it would have had trainable may not be unfrozen; one frozen in that dtype is trained once its unit
    re-derives its gradient dtypes."""
    params = dict(model.named_parameters())
    watched = {}
    for name, param in params.items():
        if param.requires_grad or not param.is_floating_point():
            continue
        would_be = master if master is not None else param.dtype
        if param.dtype != would_be:
            watched[name] = (param, would_be)

    # Frozen at wrap time in the dtype they would have had trainable: FSDP2 trains them once a unit that
    # had no trainable parameter at its first forward re-derives its gradient dtypes.
    allowed = [p for n, p in params.items() if not p.requires_grad and p.is_floating_point() and n not in watched]
    seen_trainable: set[int] = set()

    def check() -> Optional[str]:
        unfrozen = {id(p) for p in allowed if p.requires_grad} - seen_trainable
        if unfrozen:
            refresh_reduce_dtypes(model)
            seen_trainable.update(unfrozen)
        for name, (param, would_be) in watched.items():
            if param.requires_grad:
                return (
                    f"{name} was frozen when fsdp() wrapped the model, so it was kept in "
                    f"{str(param.dtype).replace('torch.', '')} (frozen parameters keep their dtype); trainable, it "
                    f"would be stored in {str(would_be).replace('torch.', '')}, and its master weight, gradient "
                    "reduction and optimizer state would not be. Wrap with it trainable (requires_grad=True "
                    "during fsdp(), then freeze it: parameters frozen after fsdp() can be unfrozen later), or "
                    f"cast it to {str(would_be).replace('torch.', '')} before fsdp()."
                )
        return None

    return check


def _param_groups(model: nn.Module) -> list:
    """Every FSDP parameter group in ``model``, once (a unit of several modules shares its groups)."""
    groups = {id(g): g for module in managed(model) for g in fsdp_param_groups(module) or ()}
    return list(groups.values())


def _average_whole_grads(model: nn.Module, params: list[nn.Parameter], mesh: DeviceMesh) -> None:
    """Average whole parameters' gradients over ``mesh`` at the end of each backward, as FSDP does.

    On every rank alike, whether or not this rank used them (a parameter it did not use adds a zero
    gradient): a per-parameter gradient hook fires only where the parameter was used, and a rank
    whose hook never fires would leave its peers waiting in the all-reduce. The end of backward is
    an autograd-engine callback queued from a hook on the model's outputs (FSDP2 and DDP do the
    same). Under ``no_sync`` too: the already-averaged part is equal on every rank, so the mean is
    the same.
    """
    groups = [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]
    trainable = [p for p in params if p.requires_grad]
    if not trainable or not groups:
        return
    queued = [False]

    def average() -> None:
        queued[0] = False
        for param in trainable:  # in the same order on every rank
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            for group in groups:
                dist.all_reduce(grad, group=group)
            param.grad = grad.div_(mesh.size())

    def on_output_grad(grad: torch.Tensor) -> None:
        if not queued[0]:
            queued[0] = True
            torch.autograd.Variable._execution_engine.queue_callback(average)

    def after_forward(_module: nn.Module, _inputs: Any, output: Any) -> None:
        if torch.is_grad_enabled():
            for tensor in output_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(on_output_grad)

    model.register_forward_hook(after_forward)


def output_tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output: a tensor, or inside tuples, lists and dicts (``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from output_tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from output_tensors(item)


def _set_sync(settings: list[tuple[FSDPModule, bool, bool]]) -> None:
    """Public FSDP2 API only: each unit's gradient sync (reduce-scatter, and HSDP's all-reduce), then its all-reduce."""
    for module, reduce, all_reduce in settings:
        module.set_requires_gradient_sync(reduce, recurse=False)
        module.set_requires_all_reduce(all_reduce, recurse=False)


@contextlib.contextmanager
def no_sync(model: nn.Module, reduce: bool) -> Iterator[None]:
    """``training.no_sync`` on FSDP2 units (none: a DDP model's own ``no_sync``, else nothing)."""
    modules = managed(model)
    if not modules:
        ddp_no_sync = getattr(model, "no_sync", None)
        with ddp_no_sync() if callable(ddp_no_sync) else contextlib.nullcontext():
            yield
        return
    # Save each unit's exact setting (FSDP's default, True, where its state cannot be read) so
    # nesting, or a user who already disabled sync on some units, is restored as it was.
    saved = []
    for module in modules:
        groups = fsdp_param_groups(module) or ()
        reduce_grads = all(getattr(g, "reduce_grads", True) for g in groups)
        saved.append((module, reduce_grads, all(getattr(g, "all_reduce_grads", True) for g in groups)))
    try:
        # reduce=True: FSDP2 adds each reduce-scattered gradient into a sharded buffer and
        # all-reduces that sum at the next backward with all-reduce on.
        _set_sync([(module, reduce, False) for module in modules])
        yield
    finally:
        _set_sync(saved)


def accumulation_bytes(model: nn.Module, micro_batches: int) -> dict[str, AccumulationCost]:
    """``costs.accumulation_costs`` from the units' parameter groups (their mesh, padded shard sizes
    and dtypes, as FSDP2 allocates them); parameters no unit manages (ignored ones, 0-dim ones)
    keep whole gradients in every choice."""
    sharded = unsharded = partial = rs_units = ar_units = 0
    managed_ids: set[int] = set()
    for group in _param_groups(model):
        shard_size = getattr(group.mesh_info, "shard_mesh_size", 1)
        trainable = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
        rs_units += bool(trainable) and shard_size > 1
        ar_units += bool(trainable) and getattr(group.mesh_info, "replicate_mesh_size", 1) > 1
        for fp in group.fsdp_params:
            managed_ids.add(id(fp.sharded_param))
            if not fp.sharded_param.requires_grad:
                continue
            # The sharded .grad is cast back to the parameter's dtype; the rest waits in
            # gradient_wait_dtype. (Read from the policy: FSDP2 sets its own dtype fields lazily.)
            dtype = fp.sharded_param.dtype
            wait_dtype = gradient_wait_dtype(param_mp_policy(group, fp), dtype)
            padded = fp.padded_sharded_param_size.numel()
            unsharded += fp.sharded_param.numel() * wait_dtype.itemsize  # a DTensor: the global numel
            partial += padded * wait_dtype.itemsize
            sharded += padded * dtype.itemsize
    whole = sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad and id(p) not in managed_ids
    )
    return accumulation_costs(
        micro_batches,
        sharded=sharded + whole,
        unsharded=unsharded + whole,
        partial=partial + whole,
        reduce_scatter_units=rs_units,
        all_reduce_units=ar_units,
    )


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs")


@contextlib.contextmanager
def restore_fsdp_hooks(model: nn.Module) -> Iterator[None]:
    """Put every module's forward hooks, FSDP's hook handles and patched methods back as they were.

    ``FSDPMemTracker`` (torch 2.13) re-registers FSDP's hooks per module on exit, which breaks a
    unit of several modules (``fully_shard([norm, head])``: its shared hook lost, tracker hooks
    and patched backward methods left behind): the model would not train after a measurement.
    """
    saved = [(m, {name: dict(getattr(m, name)) for name in _HOOK_DICTS}) for m in model.modules()]
    states = [s for s in map(fsdp_state, model.modules()) if s is not None]
    handles = [(s, s._pre_forward_hook_handle, s._post_forward_hook_handle) for s in states]
    patched = ("pre_backward", "post_backward")
    group_attrs = [(g, {a: vars(g)[a] for a in patched if a in vars(g)}) for g in _param_groups(model)]
    try:
        yield
    finally:
        for module, tables in saved:
            for name, table in tables.items():
                hooks = getattr(module, name)
                hooks.clear()
                hooks.update(table)
        for state, pre_handle, post_handle in handles:
            state._pre_forward_hook_handle, state._post_forward_hook_handle = pre_handle, post_handle
        for group, attrs in group_attrs:  # drop instance-level patches, keep the class methods
            for attr in patched:
                vars(group).pop(attr, None)
            vars(group).update(attrs)


def peak_memory(
    model: nn.Module, optimizer: Optional[torch.optim.Optimizer], step: Callable[[], Any], inputs: tuple
) -> dict[str, int]:
    """``measure.peak_memory_by_category`` with ``FSDPMemTracker``."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    with restore_fsdp_hooks(model):
        tracker = FSDPMemTracker(model, optimizer)
        if inputs:
            tracker.track_inputs(inputs)
        with tracker:
            step()
    return peak_by_device(tracker.get_tracker_snapshot("peak"), compute_device(model))


# Units gathered from forward until backward even under ZeRO-3: the root, and a unit whose modules
# run at both ends of the forward (a tied embedding + head), across every block in between.
_RESIDENT_KINDS = ("root", "embedding+head")


def plan_costs(terms: PlanTerms) -> tuple[int, int, list[str]]:
    """The planner's engine terms: ``(all-gather peak, all-reduces per synced backward, notes)``.

    The peak: gathered parameters plus the flat all-gather buffers alive at once (a unit's lives
    until the next unit's copy-out; none with one rank per shard group); units not resharded
    before backward stay (``_RESIDENT_KINDS``, every unit under ZeRO-2).
    """
    units = terms.units
    if not units:
        return 0, 0, []
    flat = [u.unsharded_bytes if terms.shard_size > 1 else 0 for u in units]
    if not terms.reshard:
        return sum(u.unsharded_bytes for u in units) + max(flat), 0, []
    resident = sum(u.unsharded_bytes for u in units if u.kind in _RESIDENT_KINDS)
    moments = [0] + [b if u.kind in _RESIDENT_KINDS else u.unsharded_bytes + b for u, b in zip(units, flat)]
    return resident + max(moments), 0, []


def plan_accumulation(plan: Any, micro_batches: int) -> dict[str, AccumulationCost]:
    """``MemoryPlan.accumulation``: per-unit reduce-scatters (shard group > 1) and all-reduces
    (replicas); ignored parameters keep whole gradients in every choice."""
    whole = plan.ignored_bytes
    trainable = [u for u in plan.units if u.grad_bytes]
    replicas = plan.world_size // plan.shard_size
    return accumulation_costs(
        micro_batches,
        sharded=plan.grad_bytes,
        unsharded=sum(u.unsharded_grad_bytes for u in plan.units) + whole,
        partial=sum(u.partial_grad_bytes for u in plan.units) + whole,
        reduce_scatter_units=len(trainable) if plan.shard_size > 1 else 0,
        all_reduce_units=len(trainable) if replicas > 1 else 0,
    )
