"""``clip_grad_norm_``: the global gradient norm of a sharded (or replicated) model, and clipping."""

from __future__ import annotations

import math
import numbers
import operator
import weakref
from typing import Iterable, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..distributed import comm_device, get_world_size
from ..torch_compat import local_tensor

__all__ = ["clip_grad_norm_"]


def _layout(param: torch.Tensor) -> tuple:
    """The group a parameter's gradient norm is reduced in: its DTensor mesh and placements, or "plain".

    Keyed by the *parameter*, not its gradient: every rank then forms the same groups in the same
    order (a rank whose gradient is ``None`` still joins its group's collective: no hang)."""
    if isinstance(param, DTensor):
        return (param.device_mesh, param.placements)  # already a tuple
    return ("plain", param.device)


# A model's grouping by layout (positions of its parameters), reused while its parameters carry the very same
# DTensor specs, position by position: a spec fixes the layout, and a parameter swapped in place
# (``torch.utils.swap_tensors``) brings its own. Specs and positions only, never a parameter: a cached parameter
# referring back to its model (a hook's closure) would keep the model alive through this weak-keyed table.
# Hashing a mesh and its placements costs ~2 us a parameter, a tenth of a small model's whole clip.
_GROUPS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, list]] = weakref.WeakKeyDictionary()
_SPEC = operator.attrgetter("_spec")
_LOCAL_TENSOR = operator.attrgetter("_local_tensor")
_GRAD = operator.attrgetter("grad")


def _layout_groups(params: list[torch.Tensor]) -> list[tuple[tuple, list[int]]]:
    """Positions of ``params`` grouped by ``_layout``, the groups in an order every rank agrees on whatever the
    order of its parameters (their collectives must pair up): DTensor layouts by their text, plain last."""
    groups: dict[tuple, list[int]] = {}
    for position, param in enumerate(params):
        groups.setdefault(_layout(param), []).append(position)
    return sorted(groups.items(), key=lambda group: (group[0][0] == "plain", repr(group[0])))


def _same_specs(params: list[torch.Tensor], specs: tuple) -> bool:
    if len(params) != len(specs):
        return False
    try:
        return all(map(operator.is_, map(_SPEC, params), specs))
    except AttributeError:  # a plain parameter now
        return False


def _param_groups(model_or_params: Union[nn.Module, Iterable[torch.Tensor]]) -> tuple[list, list]:
    """The parameters to clip and their grouping by layout (cached per model, see ``_GROUPS``)."""
    if not isinstance(model_or_params, nn.Module):
        params = [model_or_params] if isinstance(model_or_params, torch.Tensor) else list(model_or_params)
        return params, _layout_groups(params)
    params = list(model_or_params.parameters())
    cached = _GROUPS.get(model_or_params)
    if cached is not None and _same_specs(params, cached[0]):
        return params, cached[1]
    groups = _layout_groups(params)
    if params and all(isinstance(p, DTensor) for p in params):  # a plain tensor may move device, same object
        _GROUPS[model_or_params] = (tuple(map(_SPEC, params)), groups)
    return params, groups


def _as_param_layout(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad``'s local elements laid out like ``param``'s. A DTensor gradient of another layout (Replicate on a
    Shard parameter) is redistributed first: its copies would otherwise be summed as if they were shards."""
    if not isinstance(param, DTensor):
        return local_tensor(grad)
    if not isinstance(grad, DTensor):  # torch's own clip fails on it too ("mixed torch.Tensor and DTensor")
        raise ValueError(
            f"clip_grad_norm_: a parameter of shape {tuple(param.shape)} (a DTensor) has a plain-tensor gradient of "
            f"shape {tuple(grad.shape)}: whether it holds the whole gradient or this rank's shard is unknown. "
            "Accepted: a DTensor gradient (as FSDP2 makes them), or a plain gradient on a plain parameter."
        )
    if grad._spec is param._spec or (grad.device_mesh == param.device_mesh and grad.placements == param.placements):
        return grad._local_tensor
    return grad.redistribute(param.device_mesh, param.placements)._local_tensor


def _local_grads(params: list, groups: list[tuple[tuple, list[int]]]) -> list[tuple[tuple, list, list]]:
    """Per group: the local tensors its norm is taken over (laid out like their parameters) and those clipping
    scales (each gradient's own local tensor, sharing its storage: the norm and the scaling are elementwise on
    each rank's own elements, so they run there, without DTensor dispatch per op). ``None`` gradients skipped."""
    out = []
    for key, positions in groups:
        mine = [params[i] for i in positions]
        grads = list(map(_GRAD, mine))
        try:  # the common case, at C speed: every gradient a DTensor on its parameter's spec (FSDP2 reuses it)
            if key[0] != "plain" and all(map(operator.is_, map(_SPEC, grads), map(_SPEC, mine))):
                local = list(map(_LOCAL_TENSOR, grads))
                out.append((key, local, local))
                continue
        except AttributeError:  # a missing (None) or plain gradient
            pass
        pairs = [(g, p) for g, p in zip(grads, mine) if g is not None]
        out.append((key, [_as_param_layout(g, p) for g, p in pairs], [local_tensor(g) for g, _ in pairs]))
    return out


def _local_power(local: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """This rank's share of the norm: the max (inf) or the sum of ``|g|^p`` over its local elements,
    fp32, on ``device``. Empty shards (a ``Linear(d, 1)`` split over more ranks than rows) add nothing."""
    local = [t for t in local if t.numel() > 0]
    if not local:
        return torch.zeros((), dtype=torch.float32, device=device)
    norm = torch.nn.utils.get_total_norm(local, norm_type).to(device=device, dtype=torch.float32)
    return norm if math.isinf(norm_type) else norm**norm_type


def _all_reduce_max(value: torch.Tensor, group: object = None) -> torch.Tensor:
    """The largest ``value`` over the ranks, NaN if any rank's is NaN (gloo's MAX keeps whichever operand its
    comparison favours, so a NaN coming second was lost: a NaN gradient then passed an inf-norm check). One
    all-reduce of the value (NaN as 0: norms are >= 0) and a NaN flag, both by MAX."""
    nan = torch.isnan(value)
    packed = torch.stack([torch.where(nan, torch.zeros_like(value), value), nan.to(value.dtype)])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    return torch.where(packed[1] > 0, torch.full_like(packed[0], math.nan), packed[0])


def _reduce_group(value: torch.Tensor, key: tuple, norm_type: float) -> torch.Tensor:
    """Combine one group's local shares over the ranks its elements are spread across.

    A DTensor group: summed (max for inf) over each mesh dimension it is ``Shard``-ed on; a
    ``Replicate`` dimension holds copies, counted once. Plain gradients (DDP's engine, ignored or
    0-dim parameters) are replicas on every rank in principle, but ignored parameters' gradients are
    nobody's to synchronize: the world's largest share counts, so every rank gets one norm and
    clips by one factor.
    """
    if key[0] == "plain":
        if get_world_size() > 1:
            value = _all_reduce_max(value.to(comm_device())).to(value.device)
        return value
    mesh, placements = key
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            raise ValueError(
                f"clip_grad_norm_: gradients placed as {placement} are not supported (Shard or Replicate)."
            )
        if placement.is_replicate() or mesh.size(dim) == 1:
            continue
        if math.isinf(norm_type):  # Shard, and _StridedShard (FSDP over TP)
            value = _all_reduce_max(value, mesh.get_group(dim))
        else:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
    return value


def _total_norm(groups: list[tuple[tuple, list, list]], norm_type: float, device: torch.device) -> torch.Tensor:
    """Norm of all gradients together, as a plain fp32 tensor identical on every rank.

    One all-reduce per (mesh, placements) group over the ranks that shard it, plus one over the
    world for plain gradients; the groups' shares combine locally (``torch.nn.utils.get_total_norm``
    on each rank's elements, like torch's DTensor norm: partial ``|g|^p`` sums, then the root).
    """
    shares = [_reduce_group(_local_power(norm, norm_type, device), key, norm_type) for key, norm, _ in groups]
    stacked = torch.stack(shares) if len(shares) > 1 else shares[0]  # one layout (the common case): no stack
    if math.isinf(norm_type):
        return stacked.max()
    return stacked.sum() ** (1.0 / norm_type)


def _norm_order(norm_type: Union[float, str]) -> float:
    """``norm_type`` as a float: a positive number, ``float("inf")`` or ``"inf"``; else ``ValueError``."""
    if isinstance(norm_type, str) and norm_type.strip().lower() == "inf":
        return float("inf")
    if isinstance(norm_type, numbers.Real) and not isinstance(norm_type, bool) and norm_type > 0:
        return float(norm_type)  # nan fails "> 0"
    raise ValueError(
        f"clip_grad_norm_: norm_type={norm_type!r} is not accepted. Accepted: a positive float "
        "(e.g. 2.0 for the Euclidean norm, 1.0), float('inf') or 'inf' (largest magnitude)."
    )


def clip_grad_norm_(
    model_or_params: Union[nn.Module, torch.Tensor, Iterable[torch.Tensor]],
    max_norm: float,
    norm_type: Union[float, str] = 2.0,
    *,
    error_if_nonfinite: bool = False,
) -> float:
    """Clip gradients in place so their global norm is at most ``max_norm``; return that norm.

    Works on sharded models: DTensor gradients on one or several meshes (FSDP, FSDP+TP, HSDP),
    plain gradients, and parameters without a gradient (skipped). A DTensor gradient laid out unlike
    its parameter (say ``Replicate`` on a ``Shard`` parameter) is counted once, as torch counts it.
    Every rank passes the same parameters, in any order. The returned norm is a plain
    ``float``, identical on every rank and equal to ``torch.nn.utils.clip_grad_norm_`` on the
    unsharded model up to rounding: the ranks' shares are summed in another order than torch's
    DTensor norm sums them (both are within an ulp or two of a float64 norm). ``norm_type`` is a positive float, or ``float("inf")`` / ``"inf"`` (largest
    magnitude); anything else is a ``ValueError`` naming it.

    Example:
        loss.backward()
        norm = clip_grad_norm_(model, max_norm=1.0)
        optimizer.step()
    """
    norm_type = _norm_order(norm_type)
    params, groups = _param_groups(model_or_params)  # one collective per mesh and layout
    if not params:
        return 0.0
    by_layout = _local_grads(params, groups)
    if not any(scale for _, _, scale in by_layout) and get_world_size() == 1:
        return 0.0
    device = local_tensor(params[0]).device
    total = _total_norm(by_layout, norm_type, device)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite ({total.item()})."
        )
    # Same coefficient as torch.nn.utils.clip_grads_with_norm_ (1e-6 guard, clamped at 1, and
    # applied even when it is 1, as torch does: a given norm scales each gradient bit for bit as torch
    # would), one foreach per layout.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for local in filter(None, (scale for _, _, scale in by_layout)):
            torch._foreach_mul_(local, coef.to(local[0].device))
    return float(total.item())
