"""How ``FSDP2Strategy.parallelize`` shards its module: tensor parallel, then ``fsdp()``, then meta materialization."""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from ..distributed import choose_device
from ..engines import is_fsdp_wrapped
from ..fsdp import fsdp
from ..materialize import materialize_meta_model
from ..options import resolve_sharding
from ..ties import retie, tied_parameter_groups

__all__ = ["default_parallelize", "shard_module"]


def user_parallelized(module: nn.Module) -> bool:
    """``True`` when the module holds FSDP units or ``DTensor`` parameters (the user parallelized it)."""
    return is_fsdp_wrapped(module) or any(isinstance(p, DTensor) for p in module.parameters())


def tp_style(style: Any) -> Any:
    """Hugging Face style plan strings to torch ``ParallelStyle`` objects; objects pass through."""
    if not isinstance(style, str):
        return style
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if style.lower() not in styles:
        raise ValueError(f"FSDP2Strategy: unknown tensor-parallel style {style!r}. Accepted: {sorted(styles)}.")
    return styles[style.lower()]()


def _planned(fqn: str, plan: Any) -> Optional[str]:
    """The plan key that ``parallelize_module`` applies to the module at ``fqn`` itself (its
    parameters become DTensors), or ``None``: one ``fnmatch`` pattern per name atom, as torch matches."""
    atoms = fqn.split(".") if fqn else []
    for key in plan:
        parts = key.split(".") if key else []
        if len(parts) == len(atoms) and all(fnmatch(a, p) for a, p in zip(atoms, parts)):
            return key
    return None


def check_plan_keeps_ties(module: nn.Module, plan: Any, ties: list[list[str]]) -> None:
    """Refuse, before any module changes, a plan that parallelizes some owners of a tied parameter
    and not the others: the tie (an embedding and its head) would split into two tensors that
    train apart. ``ValueError`` naming the tie and what to do."""
    for names in ties:
        owners = {name: name.rpartition(".")[0] for name in names}
        keys = {name: _planned(owner, plan) for name, owner in owners.items()}
        if len({key is None for key in keys.values()}) > 1:
            planned = [f"{n} (by {k!r})" for n, k in keys.items() if k is not None]
            left = [n for n, k in keys.items() if k is None]
            raise ValueError(
                f"FSDP2Strategy: the tensor-parallel plan shards {', '.join(planned)} but not {', '.join(left)}, "
                f"which are one tied parameter ({' is '.join(names)}); they would train apart. Give every owner a "
                "style that shards the weight alike (e.g. the embedding RowwiseParallel() and the head "
                "ColwiseParallel(): both shard the vocabulary rows), or leave them all out of the plan."
            )


def retie_parallelized(module: nn.Module, ties: list[list[str]]) -> None:
    """After ``parallelize_module``: make each tie one parameter again. Every owner was planned
    (``check_plan_keeps_ties``), so each name now holds its own DTensor copy of the same values;
    they must share mesh and placements to be one tensor, else ``ValueError``."""
    for names in ties:
        params = [module.get_parameter(n) for n in names]
        layouts = {(p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else None for p in params}
        if len(layouts) > 1:
            shown = ", ".join(
                f"{n}: {tuple(p.placements) if isinstance(p, DTensor) else 'not sharded'}"
                for n, p in zip(names, params)
            )
            raise ValueError(
                f"FSDP2Strategy: the tensor-parallel plan gives the tied parameter {' is '.join(names)} different "
                f"layouts ({shown}); one tensor has one layout. Shard the weight alike in every owner "
                "(embedding RowwiseParallel() with head ColwiseParallel(): Shard(0) both)."
            )
        retie(module, [names])


def default_parallelize(
    module: nn.Module,
    device_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    *,
    tp_plan: Any = None,
    device: Optional[torch.device] = None,
    **kwargs: Any,
) -> nn.Module:
    """Tensor parallel on the mesh's last dimension (when > 1; ``tp_plan`` or the module's ``tp_plan``),
    then ``fsdp()`` on its first (``auto_wrap=True``, ``shard_strat="FULL_SHARD"`` unless given).

    What the user parallelized already (in Lightning's ``configure_model``) is kept: FSDP units
    mean nothing is added; tensor-parallel parameters mean no second TP, and no FSDP over a
    data-parallel dimension of size 1 (their mesh stays the TP mesh).
    """
    dp_name, tp_name = device_mesh.mesh_dim_names
    tp_mesh, already = device_mesh[tp_name], user_parallelized(module)
    if is_fsdp_wrapped(module) or (already and device_mesh[dp_name].size() == 1):
        return module
    if tp_mesh.size() > 1 and not already:
        _tensor_parallel(module, tp_mesh, tp_plan)
    options = _fsdp_options(device_mesh[dp_name], tp_mesh, kwargs)
    if device is None:  # the mesh's device: Lightning's accelerator (or the strategy) chose it
        device = choose_device(device=device_mesh.device_type)  # "cuda" -> cuda:LOCAL_RANK, checked visible
    return fsdp(module, mp=mp_policy, device=device, **options)


def _tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, tp_plan: Any) -> None:
    """``parallelize_module`` with ``tp_plan`` (or the module's ``tp_plan`` attribute; a callable gets the
    mesh), tied parameters kept tied."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = tp_plan if tp_plan is not None else getattr(module, "tp_plan", None)
    if callable(plan):
        plan = plan(tp_mesh)
    if not plan:
        raise ValueError(
            f"FSDP2Strategy: tensor_parallel_size={tp_mesh.size()} needs a tensor-parallel plan: pass "
            "tp_plan={'layers.*.up': ColwiseParallel(), ...}, give the module a tp_plan attribute, "
            "or parallelize it yourself (Lightning: in configure_model, with self.device_mesh)."
        )
    ties = tied_parameter_groups(module)
    check_plan_keeps_ties(module, plan, ties)
    parallelize_module(module, tp_mesh, {k: tp_style(v) for k, v in plan.items()})
    retie_parallelized(module, ties)


def _fsdp_options(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``fsdp()``'s options: ``auto_wrap=True``, ``shard_strat="FULL_SHARD"`` unless given, and a 1-D
    strategy's mesh (the data-parallel dimension) unless one was given."""
    options = {"auto_wrap": True, "shard_strat": "FULL_SHARD", **kwargs}
    spec = resolve_sharding(options["shard_strat"])
    if "mesh" not in options:
        if spec.mesh_ndim == 1:
            options["mesh"] = dp_mesh
        elif tp_mesh.size() > 1:
            raise ValueError(
                f"FSDP2Strategy: shard_strat={spec.name!r} needs a 2-D data-parallel mesh, which is not "
                "combined with tensor parallel here. Use FULL_SHARD or SHARD_GRAD with tensor_parallel_size > 1."
            )
        # tp == 1: fsdp() builds its 2-D (replicate, shard) mesh over the same ranks as the dp dimension.
    return options


def shard_module(
    module: nn.Module,
    parallelize_fn: Optional[Callable[..., Optional[nn.Module]]],
    device_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    device: torch.device,
    **kwargs: Any,
) -> nn.Module:
    """Run ``parallelize_fn`` (``default_parallelize`` when ``None``), refuse an unsharded result (never a
    silently unsharded model), materialize a meta model with its ties; returns the sharded module."""
    fn = parallelize_fn or default_parallelize
    tied = tied_parameter_groups(module)
    result = fn(module, device_mesh=device_mesh, mp_policy=mp_policy, **kwargs)
    if result is not None:
        module = result
    if not user_parallelized(module):
        raise RuntimeError(
            "FSDP2Strategy.parallelize(): the module is not sharded after parallelize_fn "
            f"({getattr(fn, '__name__', fn)}); it must apply fully_shard/fsdp(). Pass parallelize_fn=None "
            "for the default (tensor parallel when configured, then fsdp())."
        )
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        # The ties recorded before parallelize_fn (sharding may replace the shared parameter) whose names
        # still exist, plus ties the module still shows under names a wrapper may have changed.
        names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        ties = [group for group in tied if all(n in names for n in group)]
        covered = {n for group in ties for n in group}
        ties += [group for group in tied_parameter_groups(module) if not covered.intersection(group)]
        materialize_meta_model(module, device, ties)
    return module
