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
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate import DDP as ReplicatedModule  # noqa: N811 - torch names the class DDP
from torch.distributed._composable.replicate import replicate
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
from .options import (
    autocast_dtype,
    choose_engine,
    resolve_master_dtype,
    resolve_mixed_precision,
    resolve_sharding,
    validate_keep_tail_unsharded,
    validate_prefetch,
    validate_reshard_after_forward,
)
from .wrapping import BlockSpec, WrapPlan, WrapUnit, build_wrap_plan

__all__ = [
    "autocast_forward",
    "fsdp",
    "fsdp_engine",
    "fsdp_param_groups",
    "fsdp_state",
    "get_wrap_plan",
    "is_fsdp_wrapped",
    "is_replicated",
    "replicated_modules",
    "unwrapped_class",
]

_PLAN_ATTR = "_zeta_fsdp_plan"
_ENGINE_ATTR = "_zeta_fsdp_engine"


def is_replicated(module: nn.Module) -> bool:
    """``True`` if ``module`` itself was passed to composable ``replicate`` (DDP's engine), as
    ``fsdp(shard_strat="NO_SHARD")`` does for an fp32 model.

    Example:
        >>> is_replicated(nn.Linear(2, 2))
        False
    """
    return isinstance(module, ReplicatedModule)


def is_fsdp_wrapped(model: nn.Module) -> bool:
    """``True`` if ``model`` or any submodule has already been passed to ``fully_shard`` or to
    ``replicate`` (what ``fsdp()`` uses for NO_SHARD).

    Example:
        >>> is_fsdp_wrapped(nn.Linear(2, 2))
        False
    """
    return any(isinstance(m, (FSDPModule, ReplicatedModule)) for m in model.modules())


def replicated_modules(model: nn.Module) -> list[nn.Module]:
    """The modules in ``model`` (itself included) that ``replicate`` manages: the model ``fsdp()``
    put on DDP's engine, also when it is reached through a wrapper (``torch.compile``'s
    ``OptimizedModule``, a container).

    Example:
        >>> replicated_modules(nn.Sequential(nn.Linear(2, 2)))
        []
    """
    return [m for m in model.modules() if isinstance(m, ReplicatedModule)]


def fsdp_engine(model: nn.Module) -> Optional[str]:
    """The engine ``fsdp()`` put ``model`` on: ``"fully_shard"`` (FSDP2, DTensor parameters) or
    ``"replicate"`` (NO_SHARD on DDP's engine, plain tensor parameters); ``None`` if ``fsdp()``
    did not wrap it. ``options.choose_engine`` says which and why.

    Example:
        >>> fsdp_engine(nn.Linear(2, 2)) is None
        True
    """
    return model.__dict__.get(_ENGINE_ATTR)


def unwrapped_class(model: nn.Module) -> type:
    """The model's own class: ``fully_shard`` and ``replicate`` swap in a generated subclass
    (``FSDP<Name>``, ``DDP<Name>``).

    Example:
        >>> unwrapped_class(nn.Linear(2, 2)).__name__
        'Linear'
    """
    return next(c for c in type(model).__mro__ if not issubclass(c, (FSDPModule, ReplicatedModule)))


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


def _dtype_after_cast(param: torch.Tensor, master: Optional[torch.dtype]) -> torch.dtype:
    return master if master is not None and param.is_floating_point() else param.dtype


def _check_uniform_dtypes(plan: WrapPlan, model: nn.Module, master: Optional[torch.dtype]) -> None:
    """FSDP2 all-gathers one flat buffer per unit, so a unit's parameters must share one dtype.

    Checked on the dtypes the parameters WILL have (floating ones cast to ``master``), before
    anything is cast: a bad model is refused with the model untouched.
    """
    dtype_of = dict(model.named_parameters())
    for unit in plan.units:
        by_dtype: dict[torch.dtype, list[str]] = {}
        for name in unit.param_names:
            by_dtype.setdefault(_dtype_after_cast(dtype_of[name], master), []).append(name)
        if len(by_dtype) > 1:
            detail = "; ".join(
                f"{str(d).replace('torch.', '')}: {', '.join(n[:3])}{' ...' if len(n) > 3 else ''}"
                for d, n in by_dtype.items()
            )
            raise ValueError(
                f"fsdp(): FSDP unit {unit.name} mixes parameter dtypes ({detail}). FSDP2 needs one "
                "dtype per unit: keep master_dtype='fp32' (the default: floating parameters are "
                "sharded in fp32), cast the model to one dtype first, or pass the odd ones in ignored_params."
            )


def _check_units_shardable(plan: WrapPlan) -> None:
    """Everything ``fully_shard`` would reject in a unit, checked before the first call.

    ``fully_shard`` validates each call on its own, so a unit it refuses after earlier units were
    sharded would leave a half-wrapped model that a retry calls "already wrapped". 0-dim
    parameters are handled (kept whole, see ``fsdp``); mixed dtypes are checked by
    ``_check_uniform_dtypes``; what is left is a container without ``forward``.
    """
    for unit in plan.units:
        for name, module in zip(unit.module_names, unit.modules):
            if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
                raise ValueError(
                    f"fsdp(): {name or '<root>'} is a {type(module).__name__}, which has no forward(); "
                    "fully_shard cannot shard it as a unit. Pass the model that calls it (or, for "
                    "TransformerBlock, the class of the layers it holds)."
                )


def _cast_to_master(model: nn.Module, master: Optional[torch.dtype]) -> list[str]:
    """Store every floating-point parameter in ``master`` (in place; ties stay one object)."""
    cast = []
    if master is None:
        return cast
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point() and param.dtype != master:
                param.data = param.data.to(master)
                cast.append(name)
    return cast


def _average_replicated_grads(params: Iterable[nn.Parameter], mesh: DeviceMesh) -> list[Any]:
    """Average the gradients of parameters kept whole on every rank over ``mesh``, as FSDP does.

    ``fully_shard`` cannot shard a 0-dim parameter (CLIP's ``logit_scale``), so ``fsdp()`` keeps
    those whole on every rank and trains them with this hook: after each backward accumulates
    into ``.grad``, the gradient is summed over every mesh dimension and divided by the mesh size
    (the mean FSDP's reduce-scatter takes). Under ``no_sync`` the mean is taken each micro-batch:
    the already-averaged part is equal on every rank, so the result is the same mean. Returns the
    hook handles.

    Example:
        handles = _average_replicated_grads([model.logit_scale], mesh)
    """
    groups = [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]
    size = mesh.size()

    def hook(param: torch.Tensor) -> None:
        if param.grad is None or not groups:
            return
        for group in groups:
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(size)

    return [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]


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
    keep_unsharded: Iterable[WrapUnit] = (),
) -> None:
    """Call ``fully_shard`` on every unit, bottom-up, with one policy for all.

    Mixed precision is not inherited by child units in FSDP2: a unit sharded without the policy
    would all-gather and compute in fp32 while its neighbours run in bf16. So every call gets it.
    The root keeps its parameters after forward (``reshard_after_forward=None``): backward starts
    with it, so freeing and re-gathering would be pure waste. The units in ``keep_unsharded``
    (see ``tail_units``) keep theirs too (``reshard_after_forward=False``).
    """
    kept = {id(u) for u in keep_unsharded}
    for unit in plan.units:
        is_root = unit.kind == "root"
        fully_shard(
            unit.target,
            mesh=mesh,
            reshard_after_forward=None if is_root else False if id(unit) in kept else reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            ignored_params=ignored_params or None,
        )


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """Run every forward of ``model`` under ``torch.autocast(device_type, dtype)``, as if the
    caller had written ``with torch.autocast(...): model(x)``.

    Entered by a forward pre-hook and left by a forward hook that runs even when the forward
    raises (``always_call``); a stack keeps nested or re-entrant forwards paired. Activation
    checkpointing recomputes under the same autocast state (``torch.utils.checkpoint`` records it).

    Example:
        >>> m = nn.Linear(4, 4)
        >>> autocast_forward(m, "cpu", torch.bfloat16)
        >>> m(torch.ones(1, 4)).dtype
        torch.bfloat16
    """
    entered: list = []

    def enter(module: nn.Module, args: Any) -> None:
        context = torch.autocast(device_type, dtype=dtype)
        context.__enter__()
        entered.append(context)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if entered:
            entered.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def replicate_model(model: nn.Module, device: torch.device, autocast: Optional[torch.dtype] = None) -> None:
    """Put ``model`` on DDP's engine (composable ``replicate``): NO_SHARD at DDP speed.

    ``autocast``: a low-precision dtype (``mp="bf16"``) to run the forward in, with
    ``torch.autocast``: parameters, gradients and their all-reduce stay fp32 (DDP + autocast).

    Parameters stay plain tensors under their own names; gradients are all-reduced (averaged) in
    25 MiB buckets overlapping backward. ``gradient_as_bucket_view`` makes each ``.grad`` a view
    into its bucket, so gradients cost no second copy. ``find_unused_parameters`` keeps models with
    parameters a forward does not use (a pooler, a branch) working as they do under FSDP2; its
    graph walk costs little (``benchmarks/results/no_shard.md``). DDP itself is built lazily at
    the first forward, so a ``meta`` model can be materialized (or loaded) after this call; DDP
    then checks every rank holds the same shapes and broadcasts rank 0's parameters. Buffers are
    not broadcast (DDP is built over the parameters only): like FSDP2, and unlike
    ``DistributedDataParallel(broadcast_buffers=True)``, a BatchNorm's running statistics stay
    each rank's own.
    """
    if not any(t.is_meta for t in model.parameters()):
        model.to(device)
    replicate(model, device_id=device, gradient_as_bucket_view=True, find_unused_parameters=True)
    if autocast is not None:
        autocast_forward(model, device.type, autocast)


def tail_units(plan: WrapPlan, count: int) -> list[WrapUnit]:
    """The ``count`` units forward runs last, last first: the output head, then blocks backwards.

    Backward starts with exactly these, so resharding them after forward only to all-gather them
    again at once costs one all-gather each (torchtitan keeps ``[norm, output]`` unsharded for
    this reason). Embedding units (first in forward, last in backward) are never counted.

    Example:
        >>> from zeta_fsdp.models.gpt import small
        >>> [u.name for u in tail_units(build_wrap_plan(small(), auto_wrap=True), 2)]
        ['[tok_emb, pos_emb, norm, head]', 'blocks.2']
    """
    return [u for u in plan.backward_order if u.kind != "embedding"][:count]


def set_prefetch_chains(plan: WrapPlan, depth: int) -> None:
    """Explicit FSDP2 prefetching: each unit all-gathers the next ``depth`` units of forward (and
    of backward) as soon as it starts, instead of FSDP2's implicit one-ahead in backward.

    Uses ``FSDPModule.set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``
    on each unit's first module (a unit's modules share one FSDP state), in the orders of
    ``WrapPlan.forward_order`` / ``backward_order``. Collective counts are unchanged: a
    prefetched all-gather replaces the one the unit would issue itself.

    Example:
        set_prefetch_chains(plan, 2)  # after shard_units(plan, ...)
    """
    for order, setter in (
        (plan.forward_order, "set_modules_to_forward_prefetch"),
        (plan.backward_order, "set_modules_to_backward_prefetch"),
    ):
        for i, unit in enumerate(order):
            targets = [u.modules[0] for u in order[i + 1 : i + 1 + depth]]
            if targets:
                getattr(unit.modules[0], setter)(targets)


def retie(model: nn.Module, tied_params: list[list[str]]) -> None:
    """Make every name of each group in ``tied_params`` hold the group's first parameter again.

    ``to_empty`` (meta init, loading into a meta model) hands tied names separate tensors.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> retie(model, [["0.weight", "1.weight"]])
        >>> model[1].weight is model[0].weight
        True
    """
    for names in tied_params:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if getattr(owner, attr) is not first:
                owner.register_parameter(attr, first)


# Written into every floating-point tensor (and the most negative value into integer ones) after
# ``to_empty``: whatever still holds it after initialisation was not initialised.
_SENTINEL = float("nan")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fill_sentinel(tensors: dict[str, torch.Tensor]) -> None:
    for t in tensors.values():
        local = _local(t)
        if local.is_floating_point() or local.is_complex():
            local.fill_(_SENTINEL)
        elif local.dtype != torch.bool:
            local.fill_(torch.iinfo(local.dtype).min)


def _still_sentinel(t: torch.Tensor) -> bool:
    local = _local(t)
    if local.numel() == 0 or local.dtype == torch.bool:
        return False
    if local.is_floating_point() or local.is_complex():
        return bool(torch.isnan(local).any())
    return bool((local == torch.iinfo(local.dtype).min).any())


def _agreed_seed() -> int:
    """A seed drawn from this rank's generator and made the same on every rank (rank 0's).

    Ranks' generators differ unless the user seeded them alike (torchrun starts each rank with a
    random seed), and replicas must be initialised identically whatever the user did.
    """
    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed.item())


def materialize_meta_model(
    model: nn.Module,
    device: torch.device,
    tied_params: list[list[str]],
    *,
    shard_index: int = 0,
    offload_to_cpu: bool = False,
) -> bool:
    """Allocate a sharded ``meta`` model on ``device`` and initialise it. Returns ``True`` if it did.

    Each rank allocates only its shards (``to_empty``), then initialises, in this order:

    1. every module's ``reset_parameters()`` (``nn.Linear``, ``nn.LayerNorm``, ... and yours),
    2. then the root's ``init_weights()``, if it defines one, on top (a model-wide scheme such
       as ``normal(0, 0.02)``, buffers such as a causal mask or RoPE tables),
    3. then ties are restored.

    Every floating-point tensor is filled with NaN (integer ones with their dtype's minimum)
    right after ``to_empty``; any parameter or buffer that still holds that marker after steps
    1-2 was initialised by nobody, and the call raises ``RuntimeError`` naming it (on each rank
    holding a non-empty shard of it). Boolean buffers cannot be checked this way. Nothing may
    stay on ``meta``.

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
    meta_names = [n for n, t in tensors.items() if t.is_meta]
    # FSDP2's CPU offload expects the sharded parameters on CPU; buffers stay on the compute device.
    model.to_empty(device="cpu" if offload_to_cpu else device)
    if offload_to_cpu and device.type != "cpu":
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                module.register_buffer(
                    name, buffer.to(device), persistent=name not in module._non_persistent_buffers_set
                )
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        fresh = dict(model.named_parameters())
        fresh.update(model.named_buffers())
        _fill_sentinel({n: fresh[n] for n in meta_names})
        if device.type == "cpu":
            torch.manual_seed(_agreed_seed() + 7919 * shard_index)
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
        if callable(getattr(model, "init_weights", None)):
            model.init_weights()
    retie(model, tied_params)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"fsdp(): these tensors are still on the meta device after materialization: {left[:10]}")
    now = dict(model.named_parameters())
    now.update(model.named_buffers())
    # Rank-local: init code runs alike on every rank, so a tensor nothing fills is caught on
    # every rank holding a non-empty shard of it, with no extra collective.
    unset = [n for n in meta_names if _still_sentinel(now[n])]
    if unset:
        raise RuntimeError(
            f"fsdp(): {len(unset)} meta-built parameter(s)/buffer(s) were initialised by nothing: "
            f"{unset[:10]}{' ...' if len(unset) > 10 else ''}. fsdp() runs every module's "
            "reset_parameters(), then the model's init_weights(); make one of them fill these "
            "(or load weights into the model built on meta with materialize=False)."
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
    master_dtype: Union[str, torch.dtype, None] = "fp32",
    keep_tail_unsharded: Union[bool, int] = False,
    prefetch: Optional[int] = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 (``fully_shard``) and return the same object, now an ``FSDPModule``
    (under NO_SHARD in fp32 or bf16: replicated with DDP's engine, see Engines below).

    Args:
        model: any ``nn.Module``, on CPU, CUDA or ``meta``.
        auto_wrap: one FSDP unit per transformer block (plus embeddings, head, root). ``False``:
            the whole model is one unit.
        mp: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (compute in the low dtype, reduce
            gradients in fp32; fp16 needs ``torch.amp.GradScaler``), or a ``MixedPrecisionPolicy``.
            ``mp`` is the compute precision only; the stored weights follow ``master_dtype``.
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
        materialize: allocate and initialise a ``meta``-built model after sharding (default):
            every module's ``reset_parameters()``, then the root's ``init_weights()`` on top; a
            tensor neither refilled raises. ``False`` leaves it on ``meta`` (dry runs, or
            loading weights next).
        master_dtype: the dtype sharded floating-point parameters (and so the optimizer state)
            are stored in. Default ``"fp32"``: a bf16/fp16-loaded model (``from_pretrained``)
            is sharded in fp32 and computes per ``mp`` (``mp="fp32"`` then computes in fp32 too).
            ``None`` keeps each parameter's dtype: pure low-precision training, opt-in.
        keep_tail_unsharded: ``True`` (or ``1``): the output head unit (tied ``embedding+head``
            too) is not resharded after forward, since backward all-gathers it again at once:
            one all-gather less per step, for its unsharded parameters held through the loss
            (a higher peak when the peak is at the loss). An int ``n``: also the last ``n - 1``
            blocks. Default ``False``: every unit follows ``shard_strat``, as hand-written.
        prefetch: ``None`` (default): FSDP2's implicit prefetching. An int ``n``: explicit
            chains, each unit all-gathers the next ``n`` in forward and the previous ``n`` in
            backward (more overlap on GPUs, up to ``n`` extra unsharded units held; no gain on
            CPU/gloo). Assumes blocks run in the order they are registered.
            Neither has an effect on DDP's engine (NO_SHARD in fp32 or bf16): nothing is gathered there.

    0-dim parameters (CLIP's ``logit_scale``), which ``fully_shard`` cannot shard, are kept whole
    on every rank in ``master_dtype`` and their gradient is averaged across ranks
    (``_average_replicated_grads``): they train exactly like sharded ones.

    Raises:
        ValueError: for any bad argument, before a process group starts or the model changes.

    Engines: every sharding strategy runs on FSDP2 (``fully_shard``: DTensor parameters). NO_SHARD
    with ``mp="fp32"`` runs on DDP's engine instead (composable ``replicate``: plain tensor
    parameters, bucketed all-reduce, DDP's speed), and so does ``mp="bf16"``, with the forward under
    ``torch.autocast(bfloat16)`` (fp32 parameters and gradients, all-reduced in fp32: DDP +
    autocast); ``mp="fp16"`` or a custom policy, ``cpu_offload``, ignored
    parameters, a ``mesh`` or a model with nothing to train keep NO_SHARD on FSDP2
    (``options.choose_engine``; ``fsdp_engine(model)`` says which ran). State dicts, checkpoints, ``no_sync`` and ``clip_grad_norm_`` work on both.

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
            "FSDP2 (fully_shard) or DDP's engine (replicate). Call fsdp() once, on the unwrapped model."
        )
    _require_bool("auto_wrap", auto_wrap)
    _require_bool("cpu_offload", cpu_offload)
    _require_bool("activation_checkpointing", activation_checkpointing)
    _require_bool("materialize", materialize)
    _check_compile_options(compile)
    mp_policy = resolve_mixed_precision(mp)
    master = resolve_master_dtype(master_dtype)
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
    keep_tail = validate_keep_tail_unsharded(keep_tail_unsharded)
    prefetch = validate_prefetch(prefetch)
    ignored = _ignored_parameters(model, ignored_params, ignored_modules)
    plan = build_wrap_plan(model, auto_wrap=auto_wrap, transformer_block=TransformerBlock, ignored_params=ignored)
    engine, _ = choose_engine(
        spec,
        mp_policy,
        mesh_given=mesh is not None,
        cpu_offload=cpu_offload,
        has_ignored=bool(ignored),
        has_trainable=any(p.requires_grad for p in model.parameters()),
    )
    if engine == "fully_shard":  # DDP buckets per dtype and has no unit to refuse
        _check_uniform_dtypes(plan, model, master)
        _check_units_shardable(plan)
    compute_device = _check_device(model, device)
    scalars = [model.get_parameter(n) for n in plan.scalar_param_names]

    # 2. Environment: a process group (ours only if none exists) and the mesh.
    ensure_process_group(compute_device, cpu_offload=cpu_offload)
    if mesh is None and engine == "fully_shard":
        mesh = build_mesh(spec, compute_device, replicate_size=replicate_size)

    # 3. Per-block transforms, then sharding bottom-up (or replication), then meta materialization.
    if activation_checkpointing:
        apply_activation_checkpointing(plan)
    if compile:
        apply_compile(plan, compile)
    if _cast_to_master(model, master):
        plan.recount(model)
    if engine == "replicate":
        replicate_model(model, compute_device, autocast_dtype(mp_policy))
        shard_index = 0
    else:
        # Pinned host memory needs an accelerator; on a CPU-only run offloading is a no-op anyway.
        offload = CPUOffloadPolicy(pin_memory=compute_device.type != "cpu") if cpu_offload else OffloadPolicy()
        shard_units(plan, mesh, mp_policy, reshard, offload, ignored | set(scalars), tail_units(plan, keep_tail))
        if prefetch is not None:
            set_prefetch_chains(plan, prefetch)
        # 0-dim parameters stay whole on every rank (FSDP does not move them): put them on the device.
        for scalar in scalars:
            if not scalar.is_meta and scalar.device != compute_device:
                scalar.data = scalar.data.to(compute_device)
        _average_replicated_grads(scalars, mesh)
        shard_index = mesh.get_local_rank(mesh.ndim - 1) if mesh.size(mesh.ndim - 1) > 1 else 0
    if materialize:
        materialize_meta_model(
            model, compute_device, plan.tied_params, shard_index=shard_index, offload_to_cpu=cpu_offload
        )
    model.__dict__[_ENGINE_ATTR] = engine
    model.__dict__[_PLAN_ATTR] = plan  # so get_wrap_plan() can show what was done
    return model
