"""The façade: ``fsdp(model, ...)`` shards any model with FSDP2 in one line.

Steps, in order (each a plain function below):
    validate every argument (nothing changes if one is bad)
    -> plan the units (pure, ``wrapping.build_wrap_plan``)
    -> process group + device + mesh (``distributed``)
    -> activation checkpointing, torch.compile (each block, optional)
    -> ``fully_shard`` bottom-up, the SAME MixedPrecisionPolicy on every unit
    -> materialize a meta-device model (``to_empty``, init, re-tie).

Example:
    from zeta_fsdp import fsdp
    model = fsdp(nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)))
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Iterable, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from .distributed import (
    build_mesh,
    choose_device,
    ensure_process_group,
    shard_group_size,
    validate_mesh,
)
from .options import resolve_mixed_precision, resolve_sharding, validate_reshard_after_forward
from .wrapping import BlockSpec, WrapPlan, build_wrap_plan

__all__ = ["fsdp", "fsdp_param_groups", "fsdp_state", "get_wrap_plan", "is_fsdp_wrapped"]

_PLAN_ATTR = "_zeta_fsdp_plan"


def is_fsdp_wrapped(model: nn.Module) -> bool:
    """``True`` if ``model`` or any submodule has already been passed to ``fully_shard``.

    Example:
        >>> is_fsdp_wrapped(nn.Linear(2, 2))
        False
    """
    return any(isinstance(m, FSDPModule) for m in model.modules())


def fsdp_state(module: nn.Module) -> Optional[Any]:
    """FSDP2's private per-module state (``module._get_fsdp_state()``), or ``None`` when the module
    is not sharded or this torch does not expose it. The one place the package reads it.

    Example:
        >>> fsdp_state(nn.Linear(2, 2)) is None
        True
    """
    if not isinstance(module, FSDPModule):
        return None
    try:
        return module._get_fsdp_state()
    except Exception:  # noqa: BLE001 - an unreadable state: callers fall back to FSDP's defaults
        return None


def fsdp_param_groups(module: nn.Module) -> Optional[list]:
    """The FSDP parameter groups of one sharded module (``[]`` if it owns none), or ``None`` when
    they cannot be read.

    Private torch attributes: ``_fsdp_param_groups`` (a list, newer torch) or
    ``_fsdp_param_group`` (one group or ``None``, older torch; in newer torch a property that
    raises when a unit has several groups).

    Example:
        >>> fsdp_param_groups(nn.Linear(2, 2)) is None  # not sharded: no state to read
        True
    """
    state = fsdp_state(module)
    if state is None:
        return None
    for name in ("_fsdp_param_groups", "_fsdp_param_group"):
        try:
            groups = getattr(state, name)
        except Exception:  # noqa: BLE001 - absent, or the property refused: try the other name
            continue
        if groups is None:
            return []
        return list(groups) if isinstance(groups, (list, tuple)) else [groups]
    return None


def get_wrap_plan(model: nn.Module) -> Optional[WrapPlan]:
    """The ``WrapPlan`` ``fsdp()`` applied to ``model`` (``None`` if ``fsdp()`` did not wrap it).

    Example:
        model = fsdp(small(), auto_wrap=True)
        print(get_wrap_plan(model).table())
    """
    return model.__dict__.get(_PLAN_ATTR)


def _require_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"fsdp(): {name}={value!r} is not accepted. Accepted: True or False.")


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
            torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"fsdp(): device={device!r} is not accepted. Accepted: None, 'cpu', 'cuda', 'cuda:N' or a torch.device."
            ) from err
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
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
    ignored = set(ignored_params) if ignored_params is not None else set()
    for module in ignored_modules or ():
        if not isinstance(module, nn.Module):
            raise ValueError(f"fsdp(): ignored_modules must hold nn.Module objects, got {module!r}.")
        ignored.update(module.parameters())
    stray = [p for p in ignored if id(p) not in own]
    if stray:
        raise ValueError(f"fsdp(): {len(stray)} ignored parameter(s) do not belong to the model.")
    return ignored


def _check_uniform_dtypes(plan: WrapPlan, model: nn.Module) -> None:
    """FSDP2 all-gathers one flat buffer per unit, so a unit's parameters must share one dtype."""
    dtype_of = dict(model.named_parameters())
    for unit in plan.units:
        if len(unit.dtypes) > 1:
            by_dtype: dict[torch.dtype, list[str]] = {}
            for name in unit.param_names:
                by_dtype.setdefault(dtype_of[name].dtype, []).append(name)
            detail = "; ".join(
                f"{str(d).replace('torch.', '')}: {', '.join(n[:3])}{' ...' if len(n) > 3 else ''}"
                for d, n in ((d, names) for d, names in by_dtype.items())
            )
            raise ValueError(
                f"fsdp(): FSDP unit {unit.name} mixes parameter dtypes ({detail}). FSDP2 needs one "
                "dtype per unit: cast the model to one dtype first (e.g. model.float()) and use "
                "mp='bf16'/'fp16' for low-precision compute, or pass the odd ones in ignored_params."
            )


def _checkpointed_forward(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(plan: WrapPlan) -> None:
    """Recompute each block's activations in backward instead of storing them.

    The block's ``forward`` is wrapped in place (no wrapper module), so parameter names and
    state-dict keys stay exactly those of the unwrapped model, and FSDP's hooks still run around
    the whole checkpointed call.
    """
    for unit in plan.blocks:
        for module in unit.modules:
            if "forward" not in vars(module):
                module.forward = functools.partial(_checkpointed_forward, module.forward)


def apply_compile(plan: WrapPlan, options: Union[bool, dict]) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile``: names unchanged)."""
    kwargs = options if isinstance(options, dict) else {}
    for unit in plan.blocks:
        for module in unit.modules:
            module.compile(**kwargs)


def shard_units(
    plan: WrapPlan,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: Union[bool, int],
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter],
) -> None:
    """Call ``fully_shard`` on every unit, bottom-up, with one policy for all.

    Mixed precision is not inherited by child units in FSDP2: a unit sharded without the policy
    would all-gather and compute in fp32 while its neighbours run in bf16. So every call gets it.
    The root keeps its parameters after forward (``reshard_after_forward=None``): backward starts
    with it, so freeing and re-gathering would be pure waste.
    """
    for unit in plan.units:
        is_root = unit.kind == "root"
        fully_shard(
            unit.target,
            mesh=mesh,
            reshard_after_forward=None if is_root else reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params or None,
        )


def _retie(model: nn.Module, tied_params: list[list[str]]) -> None:
    for names in tied_params:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if getattr(owner, attr) is not first:
                owner.register_parameter(attr, first)


def _unrefilled_modules(model: nn.Module) -> list[str]:
    """Modules owning tensors that no ``init_weights()``/``reset_parameters()`` will refill."""
    if callable(getattr(model, "init_weights", None)):
        return []  # the model's own init is trusted to cover everything
    return [
        name or "<root>"
        for name, module in model.named_modules()
        if (any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)))
        and not callable(getattr(module, "reset_parameters", None))
    ]


def materialize_meta_model(
    model: nn.Module,
    device: torch.device,
    tied_params: list[list[str]],
    *,
    shard_index: int = 0,
    offload_to_cpu: bool = False,
) -> bool:
    """Allocate a sharded ``meta`` model on ``device`` and initialise it. Returns ``True`` if it did.

    Each rank allocates only its shards (``to_empty``), then the model's own initialisation runs:
    ``init_weights()`` on the root when defined, else ``reset_parameters()`` on every module that
    has one (buffers included, when those methods refill them). Ties are restored and nothing is
    allowed to stay on ``meta``.

    ``shard_index`` is this rank's coordinate on the shard dimension of the mesh. On CUDA, DTensor
    random ops keep shards of one parameter distinct by themselves; on CPU they draw from each
    rank's own generator, so every shard would get the same numbers (a weight made of one block
    repeated). We therefore seed the init with ``shard_index`` on CPU: distinct across shards,
    equal across replicas (HYBRID/NO_SHARD replicas must hold identical copies). The caller's RNG
    state is left as it was.

    Example:
        materialize_meta_model(meta_built_and_sharded, torch.device("cpu"), [])
        # -> True
    """
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    if not any(t.is_meta for t in tensors.values()):
        return False
    unrefilled = _unrefilled_modules(model)
    # FSDP2's CPU offload expects the sharded parameters on CPU; buffers stay on the compute device.
    model.to_empty(device="cpu" if offload_to_cpu else device)
    if offload_to_cpu and device.type != "cpu":
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                module.register_buffer(
                    name, buffer.to(device), persistent=name not in module._non_persistent_buffers_set
                )
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        if device.type == "cpu":
            base_seed = int(torch.randint(0, 2**31 - 1, ()).item())  # same on every rank seeded alike
            torch.manual_seed(base_seed + 7919 * shard_index)
        if callable(getattr(model, "init_weights", None)):
            model.init_weights()
        else:
            for module in model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
    _retie(model, tied_params)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"fsdp(): these tensors are still on the meta device after materialization: {left[:10]}")
    if unrefilled:
        warnings.warn(
            "fsdp(): these meta-built modules hold parameters or buffers that nothing initialised "
            f"(no init_weights() on the model, no reset_parameters() on them), so they contain "
            f"uninitialised memory: {unrefilled[:10]}. Define init_weights() on the model, or load "
            "weights with zeta_fsdp.load_full_state_dict().",
            stacklevel=3,
        )
    return True


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
) -> nn.Module:
    """Shard ``model`` with FSDP2 (``fully_shard``) and return the same object, now an ``FSDPModule``.

    Args:
        model: any ``nn.Module``, on CPU, CUDA or ``meta``.
        auto_wrap: one FSDP unit per transformer block (plus embeddings, head, root). ``False``:
            the whole model is one unit.
        mp: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (compute in the low dtype, reduce
            gradients in fp32; fp16 needs ``torch.amp.GradScaler``), or a ``MixedPrecisionPolicy``.
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
        materialize: allocate and initialise a ``meta``-built model after sharding (default).
            ``False`` leaves it on ``meta``: for dry runs that only inspect the sharding.

    Raises:
        ValueError: for any bad argument, before a process group starts or the model changes.

    Example:
        model = fsdp(model, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD", TransformerBlock=Block)
        optimizer = torch.optim.AdamW(model.parameters())  # after wrapping: DTensor parameters
    """
    # 1. Validate everything first: nothing below may run if an argument is bad.
    if not isinstance(model, nn.Module):
        raise ValueError(f"fsdp(): model must be a torch.nn.Module, got {type(model).__name__}.")
    if is_fsdp_wrapped(model):
        raise ValueError(
            f"fsdp(): {type(model).__name__} (or one of its submodules) is already wrapped with "
            "FSDP2 (fully_shard). Call fsdp() once, on the unwrapped model."
        )
    _require_bool("auto_wrap", auto_wrap)
    _require_bool("cpu_offload", cpu_offload)
    _require_bool("activation_checkpointing", activation_checkpointing)
    _require_bool("materialize", materialize)
    _check_compile_options(compile)
    mp_policy = resolve_mixed_precision(mp)
    spec = resolve_sharding(shard_strat)
    if mesh is not None:
        validate_mesh(spec, mesh)
        if replicate_size is not None:
            raise ValueError(
                f"fsdp(): replicate_size={replicate_size!r} cannot be combined with mesh=: the mesh's "
                f"shape {tuple(mesh.shape)} already fixes the replicas. Pass one or the other."
            )
    reshard = validate_reshard_after_forward(
        reshard_after_forward, shard_group_size(spec, mesh, replicate_size=replicate_size)
    )
    if reshard is None:
        reshard = spec.reshard_after_forward
    ignored = _ignored_parameters(model, ignored_params, ignored_modules)
    plan = build_wrap_plan(model, auto_wrap=auto_wrap, transformer_block=TransformerBlock, ignored_params=ignored)
    _check_uniform_dtypes(plan, model)
    compute_device = _check_device(model, device)

    # 2. Environment: a process group (ours only if none exists) and the mesh.
    ensure_process_group(compute_device, cpu_offload=cpu_offload)
    if mesh is None:
        mesh = build_mesh(spec, compute_device, replicate_size=replicate_size)

    # 3. Per-block transforms, then sharding bottom-up, then meta materialization.
    if activation_checkpointing:
        apply_activation_checkpointing(plan)
    if compile:
        apply_compile(plan, compile)
    # Pinned host memory needs an accelerator; on a CPU-only run offloading is a no-op anyway.
    offload = CPUOffloadPolicy(pin_memory=compute_device.type != "cpu") if cpu_offload else OffloadPolicy()
    shard_units(plan, mesh, mp_policy, reshard, offload, ignored)
    if materialize:
        shard_index = mesh.get_local_rank(mesh.ndim - 1) if mesh.size(mesh.ndim - 1) > 1 else 0
        materialize_meta_model(
            model, compute_device, plan.tied_params, shard_index=shard_index, offload_to_cpu=cpu_offload
        )
    model.__dict__[_PLAN_ATTR] = plan  # so get_wrap_plan() can show what was done
    return model
