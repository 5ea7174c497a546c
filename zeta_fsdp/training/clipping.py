"""``clip_grad_norm_``: the global gradient norm of a sharded (or replicated) model, and clipping."""

from __future__ import annotations

import numbers
from typing import Iterable, Union

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


def _total_norm(groups: list[list[torch.Tensor]], norm_type: float) -> torch.Tensor:
    """Norm of all gradients together, as a plain tensor, whatever meshes they live on.

    ``torch.nn.utils.get_total_norm`` stacks per-gradient norms, which DTensor only allows on
    one mesh with one layout. So each (mesh, placements) group's norm is one collective
    (``full_tensor()`` of a partial norm), and the group norms combine locally. Plain tensors
    (e.g. ignored parameters) are taken as they are on this rank: no collective.
    """
    norms = [torch.nn.utils.get_total_norm(group, norm_type) for group in groups]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    device = norms[0].device
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    return torch.linalg.vector_norm(stacked, norm_type)


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
    plain gradients, and parameters without a gradient (skipped). The returned norm is a plain
    ``float``, identical on every rank and equal to ``torch.nn.utils.clip_grad_norm_`` on the
    unsharded model. ``norm_type`` is a positive float, or ``float("inf")`` / ``"inf"`` (largest
    magnitude); anything else is a ``ValueError`` naming it.

    Example:
        loss.backward()
        norm = clip_grad_norm_(model, max_norm=1.0)
        optimizer.step()
    """
    norm_type = _norm_order(norm_type)
    if isinstance(model_or_params, nn.Module):
        model_or_params = model_or_params.parameters()
    params = [model_or_params] if isinstance(model_or_params, torch.Tensor) else model_or_params
    by_layout: dict[object, list[torch.Tensor]] = {}  # DTensor ops may not mix meshes or layouts
    for grad in (p.grad for p in params if p.grad is not None):
        key = (grad.device_mesh, tuple(grad.placements)) if isinstance(grad, DTensor) else ("local", grad.device)
        by_layout.setdefault(key, []).append(grad)
    if not by_layout:
        return 0.0
    total = _total_norm(list(by_layout.values()), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is non-finite ({total.item()})."
        )
    # Same coefficient as torch.nn.utils.clip_grads_with_norm_ (1e-6 guard, clamped at 1, and
    # applied even when it is 1 so the result matches torch bit for bit), one foreach per layout.
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for group in by_layout.values():
            torch._foreach_mul_(group, coef.to(group[0].device))
    return float(total.item())
