"""The façade: ``fsdp(model, ...)`` shards any model with FSDP2 in one line.

Validation lives here (nothing changes if an argument is bad); each later step is a plain function
of its own module: plan the units (``wrapping``), process group and mesh (``distributed``), per-block
checkpointing and compile (``sharding``), ``fully_shard`` bottom-up with one MixedPrecisionPolicy, or
DDP's engine (``engines``), materialize a meta-device model (``materialize``). What was done is
recorded on the model and read back by ``wrapped``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterable, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from .distributed import choose_device, ensure_process_group, expected_world_size, local_world_size
from .divergence import add_divergence_check, resolve_forwards
from .engines import Engine, WrapOptions, engine_named, fsdp_engine, get_wrap_plan, is_fsdp_wrapped, record_wrap
from .fp32_modules import Fp32Selection, KeepFp32Spec, add_cast_hooks, select_fp32
from .materialize import materialize_meta_model
from .optim import forget_snapshot, snapshot_params, track_fsdp_model
from .options import (
    ShardingSpec,
    choose_engine,
    resolve_master_dtype,
    resolve_mesh_shape,
    resolve_mixed_precision,
    resolve_sharding,
    validate_keep_tail_unsharded,
    validate_prefetch,
    validate_reshard_after_forward,
)
from .sharding import apply_activation_checkpointing, apply_compile, cast_to_fp32, cast_to_master
from .start import start_from_first_rank
from .unfreeze import guard_unfreezing
from .wrapping import BlockSpec, WrapPlan, build_wrap_plan

# fsdp_engine, get_wrap_plan, is_fsdp_wrapped: public names that have always been importable from here.
__all__ = ["fsdp", "fsdp_engine", "get_wrap_plan", "is_fsdp_wrapped"]


def _check_compile_options(options: Any) -> None:
    if isinstance(options, bool):
        return
    if not isinstance(options, dict):
        raise ValueError(
            f"fsdp(): compile={options!r} is not accepted. Accepted: True, False, or a dict of torch.compile options."
        )
    accepted = [p for p in inspect.signature(torch.compile).parameters if p != "model"]
    unknown = [k for k in options if k not in accepted]
    if unknown:
        raise ValueError(f"fsdp(): compile= has unknown torch.compile option(s) {unknown}. Accepted: {accepted}.")


def _check_device(model: nn.Module, device: Union[str, torch.device, None]) -> torch.device:
    if device is not None:
        try:
            cuda = torch.device(device).type == "cuda"
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"fsdp(): device={device!r} is not accepted. Accepted: None, 'cpu', 'cuda', 'cuda:N' or a torch.device."
            ) from err
        if torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError(
                f"fsdp(): device={device!r} is not accepted. Accepted: None, 'cpu', 'cuda', 'cuda:N' or a torch.device "
                "of those types (build the model on meta, not the compute device: fsdp() materializes it)."
            )
        if cuda and not torch.cuda.is_available():
            raise ValueError(f"fsdp(): device={device!r} but CUDA is not available here. Accepted: None or 'cpu'.")
    return choose_device(model, device)


def _ignored_parameters(
    model: nn.Module, ignored_params: Optional[Iterable[nn.Parameter]], ignored_modules: Optional[Iterable[nn.Module]]
) -> set[nn.Parameter]:
    own = {id(p) for p in model.parameters()}
    if isinstance(ignored_params, torch.Tensor):  # one parameter passed bare
        ignored_params = [ignored_params]
    if isinstance(ignored_modules, nn.Module):
        ignored_modules = [ignored_modules]
    ignored = set(ignored_params or ())
    for module in ignored_modules or ():
        if not isinstance(module, nn.Module):
            raise ValueError(f"fsdp(): ignored_modules must hold nn.Module objects, got {module!r}.")
        ignored.update(module.parameters())
    stray = [p for p in ignored if id(p) not in own]
    if stray:
        raise ValueError(f"fsdp(): {len(stray)} ignored parameter(s) do not belong to the model.")
    return ignored


def fsdp(
    model: nn.Module,
    auto_wrap: bool = False,
    mp: Union[str, MixedPrecisionPolicy] = "fp32",
    shard_strat: Any = "NO_SHARD",
    TransformerBlock: BlockSpec = None,  # noqa: N803 - Zeta's public parameter name
    *,
    mesh: Optional[DeviceMesh] = None,
    device: Union[str, torch.device, None] = None,
    reshard_after_forward: Union[bool, int, None] = None,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    compile: Union[bool, dict] = False,  # noqa: A002 - the documented keyword
    ignored_params: Optional[Iterable[nn.Parameter]] = None,
    ignored_modules: Optional[Iterable[nn.Module]] = None,
    replicate_size: Optional[int] = None,
    materialize: bool = True,
    master_dtype: Union[str, torch.dtype, None] = "fp32",
    keep_tail_unsharded: Union[bool, int] = False,
    prefetch: Optional[int] = None,
    keep_fp32: KeepFp32Spec = None,
    divergence_check: Union[bool, int, None] = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 (``fully_shard``) and return the same object, now an ``FSDPModule``
    (under NO_SHARD in fp32 or bf16: replicated with DDP's engine, see Engines below).

    Every option in full, with the accepted values: docs/options.md.

    Args:
        model: any ``nn.Module``, on CPU, CUDA or ``meta``.
        auto_wrap: one FSDP unit per transformer block (plus embeddings, head, root); ``False``: one unit.
        mp: compute precision, ``"fp32"`` (default), ``"bf16"``, ``"fp16"`` (needs ``torch.amp.GradScaler``)
            or a ``MixedPrecisionPolicy``; gradients are reduced in fp32, weights stored in ``master_dtype``.
        shard_strat: ``"FULL_SHARD"`` (ZeRO-3), ``"SHARD_GRAD"`` (ZeRO-2), ``"NO_SHARD"`` (DDP-like,
            default), ``"HYBRID_SHARD"``, ``"HYBRID_SHARD_ZERO2"``, or an FSDP1 ``ShardingStrategy``.
        TransformerBlock: block class, tuple of classes, or class name. Detected when ``None``.
        mesh: a ``DeviceMesh`` to use instead of building one (1-D, or 2-D for HYBRID/NO_SHARD).
        device: compute device; default ``cuda:LOCAL_RANK`` when CUDA is available, else CPU.
        reshard_after_forward: override for the blocks: bool, or an int dividing the shard group.
        cpu_offload: keep sharded parameters, gradients and optimizer state on CPU.
        activation_checkpointing: recompute each block in backward.
        compile: ``torch.compile`` each block (``True`` or a dict of compile options).
        ignored_params / ignored_modules: parameters FSDP leaves alone (not sharded).
        replicate_size: number of replicas for HYBRID (default: number of nodes).
        materialize: allocate and initialise a ``meta``-built model after sharding (``reset_parameters()``,
            then the root's ``init_weights()``); ``False`` leaves it on ``meta`` (dry runs, loading next).
        master_dtype: storage dtype of trainable floating-point parameters (and so the optimizer state):
            ``"fp32"`` (default) whatever the model was loaded in; ``None`` keeps each one's dtype.
            Frozen parameters (a LoRA base; freeze before ``fsdp()``) keep their own (docs/finetuning.md).
        keep_tail_unsharded: ``True`` / an int ``n``: the head unit (and the last ``n - 1`` blocks) stay
            gathered after forward: one all-gather less per step, for a higher peak.
        prefetch: an int ``n``: each unit all-gathers the next ``n`` in forward, the previous ``n`` in
            backward (``None``: FSDP2's implicit prefetching). Neither option acts on DDP's engine.

    0-dim parameters (CLIP's ``logit_scale``), which ``fully_shard`` cannot shard, are kept whole
    on every rank in ``master_dtype`` with their gradient averaged across ranks: they train alike.

    Raises:
        ValueError: for any bad argument, before a process group starts or the model changes.

    Engines: sharding strategies run on FSDP2 (DTensor parameters). NO_SHARD with ``mp="fp32"`` or
    ``"bf16"`` (forward under ``torch.autocast``) runs on DDP's engine (composable ``replicate``: plain
    tensors, DDP's speed) unless it needs FSDP2 (``options.choose_engine``; ``fsdp_engine(model)`` says
    which ran). State dicts, checkpoints, ``no_sync``, clipping work on both.

    Example:
        model = fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block)
        optimizer = torch.optim.AdamW(model.parameters())  # after wrapping: DTensor parameters
    """
    # 1. Validate everything first: nothing below may run if an argument is bad.
    flags = dict(auto_wrap=auto_wrap, cpu_offload=cpu_offload, materialize=materialize)
    _check_call(model, dict(flags, activation_checkpointing=activation_checkpointing), compile)
    mp_policy = resolve_mixed_precision(mp)
    master = resolve_master_dtype(master_dtype)
    spec = resolve_sharding(shard_strat)
    layout = _layout(spec, mesh, replicate_size, reshard_after_forward, keep_tail_unsharded, prefetch)
    ignored = _ignored_parameters(model, ignored_params, ignored_modules)
    check_forwards = resolve_forwards(divergence_check)
    plan = build_wrap_plan(model, auto_wrap=auto_wrap, transformer_block=TransformerBlock, ignored_params=ignored)
    fp32 = select_fp32(model, keep_fp32, mp_policy)
    owned = dict(ignored=frozenset(ignored), fp32_params=tuple(fp32.param_names), cpu_offload=cpu_offload)
    options = WrapOptions(_check_device(model, device), mp_policy, **layout, **owned)
    name, engine = _checked_engine(model, plan, spec, options, master, fp32)

    # 2. Environment: a process group (ours only if none exists) and the mesh.
    ensure_process_group(options.device, cpu_offload=cpu_offload)
    options = dataclasses.replace(options, mesh=engine.mesh_for(options))

    # 3. Per-block transforms, then sharding bottom-up (or replication), then meta materialization.
    transforms = dict(activation_checkpointing=activation_checkpointing, compile=compile, materialize=materialize)
    _shard(model, plan, engine, options, master=master, fp32=fp32, **transforms)
    modules = [
        (n or "<root>" if len(u.modules) == 1 else f"{n} (unit {u.name})", m)
        for u in plan.units
        for n, m in zip(u.module_names, u.modules)
    ]
    add_divergence_check(model, modules, options.mesh, check_forwards)
    # what fsdp_engine(), get_wrap_plan(), compute_device() read
    record_wrap(model, name, plan, options.device, cpu_offload)
    return model


def _shard(
    model: nn.Module,
    plan: WrapPlan,
    engine: Engine,
    options: WrapOptions,
    *,
    master: Optional[torch.dtype],
    fp32: Fp32Selection,
    activation_checkpointing: bool,
    compile: Union[bool, dict],  # noqa: A002 - fsdp()'s keyword
    materialize: bool,
) -> None:
    """``fsdp()``'s changes, in order: per-block checkpointing and compile, the master/fp32 casts, the engine's
    wrap, fp32 cast hooks, materializing a ``meta`` model, the unfreeze guard, the optimizer registry."""
    before = snapshot_params(model)  # marks the originals: the "optimizer built before fsdp()" error
    try:
        start = start_from_first_rank(model, options.mesh)  # rank 0's weights everywhere, as DDP (zeta_fsdp.start)
        if activation_checkpointing:
            apply_activation_checkpointing(plan)
        if compile:
            apply_compile(plan, compile)
        if cast_to_master(model, master) + cast_to_fp32(model, fp32.param_names):
            plan.recount(model)
        shard_index = engine.wrap(model, plan, options)
        add_cast_hooks(model, fp32.cast_modules)
        plan.notes.extend(fp32.notes)
        if materialize:
            offload = options.cpu_offload
            materialize_meta_model(
                model, options.device, plan.tied_params, shard_index=shard_index, offload_to_cpu=offload
            )
            start_from_first_rank(model, options.mesh, only=start.on_meta)  # unsharded tensors: rank 0's draw
        guard_unfreezing(model, engine.unfreeze_check(model, master))
    except BaseException:
        forget_snapshot(model)  # nothing replaced for good: no parameter stays marked
        raise
    track_fsdp_model(model, before)  # optimizer checks; elementwise optimizers step on local shards (optim/)


def _check_call(model: Any, flags: dict[str, Any], compile: Any) -> None:  # noqa: A002 - fsdp()'s keyword
    """``model`` is an unwrapped ``nn.Module``, every flag a bool, ``compile`` a bool or torch.compile options."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"fsdp(): model must be a torch.nn.Module, got {type(model).__name__}.")
    if is_fsdp_wrapped(model):
        raise ValueError(
            f"fsdp(): {type(model).__name__} (or one of its submodules) is already wrapped with "
            "FSDP2 (fully_shard) or DDP's engine (replicate). Call fsdp() once, on the unwrapped model."
        )
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"fsdp(): {name}={value!r} is not accepted. Accepted: True or False.")
    _check_compile_options(compile)


def _layout(
    spec: ShardingSpec,
    mesh: Optional[DeviceMesh],
    replicate_size: Optional[int],
    reshard_after_forward: Union[bool, int, None],
    keep_tail_unsharded: Union[bool, int],
    prefetch: Optional[int],
) -> dict[str, Any]:
    """``WrapOptions``' mesh and per-block fields, each validated (``options``): the mesh shape,
    computed once per call, and the blocks' reshard (the strategy's unless overridden), tail, prefetch."""
    shape = resolve_mesh_shape(spec, mesh, replicate_size, expected_world_size(), local_world_size())
    reshard = validate_reshard_after_forward(reshard_after_forward, shape[-1])
    return dict(
        shape=shape,
        mesh=mesh,
        reshard=spec.reshard_after_forward if reshard is None else reshard,
        keep_tail=validate_keep_tail_unsharded(keep_tail_unsharded),
        prefetch=validate_prefetch(prefetch),
    )


def _checked_engine(
    model: nn.Module,
    plan: WrapPlan,
    spec: ShardingSpec,
    options: WrapOptions,
    master: Optional[torch.dtype],
    fp32: Fp32Selection,
) -> tuple[str, Engine]:
    """``options.choose_engine`` for this model and these options, and that engine's checks: its fp32
    units added to ``plan``, then what it refuses raised (the model is not changed)."""
    name, _ = choose_engine(
        spec,
        options.mp_policy,
        mesh_given=options.mesh is not None,
        cpu_offload=options.cpu_offload,
        has_ignored=bool(options.ignored),
        has_trainable=any(p.requires_grad for p in model.parameters()),
        has_fp32=bool(fp32),
    )
    engine = engine_named(name)
    engine.add_fp32_units(plan, model, fp32.param_names)
    engine.check(plan, model, master)
    return name, engine
