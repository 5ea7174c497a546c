"""The local step without torch's per-parameter loop: its functional implementations called with lists.

Each elementwise class's ``step`` is, per param group, ``_init_group`` (a Python loop collecting each
parameter with a gradient, its gradient and its state, creating missing state) and one call of the
class's functional implementation (``torch.optim.adam.adam`` ...) with those lists and the group's
options. Once every parameter has a gradient and its whole state, the lists of the local view hold
still between steps but for the gradients: ``try_step`` makes that same call itself, with the cached
lists of the shards' local tensors, and skips the loop (with it ~1-3 us a parameter: the gradient
hand-over, torch's reads of each ``p.grad`` and ``self.state[p]``). Same function, same tensors, same
options: the same kernels on the same elements, bit for bit (tests compare with torch's path).

Anything else (a first step, a parameter without a gradient or state, a tensor ``lr``, complex
parameters, a torch release whose ``step`` bodies were not compared with these calls) returns
``False`` and the caller runs torch's own ``step`` on the local view.

Example:
    >>> sorted(cls.__name__ for cls in RECIPES)
    ['Adagrad', 'Adam', 'AdamW', 'Adamax', 'NAdam', 'RAdam', 'RMSprop', 'SGD']
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Callable, NamedTuple

import torch

# The modules, not their functions: the call goes to whatever the module holds at the time, as torch's step's does.
import torch.optim.adagrad as _adagrad_module  # (torch.optim deletes these names from its own namespace)
import torch.optim.adam as _adam_module
import torch.optim.adamax as _adamax_module
import torch.optim.nadam as _nadam_module
import torch.optim.radam as _radam_module
import torch.optim.rmsprop as _rmsprop_module
import torch.optim.sgd as _sgd_module
from torch.optim import SGD, Adagrad, Adam, Adamax, AdamW, NAdam, Optimizer, RAdam, RMSprop

from ..torch_compat import MIN_TORCH, torch_release
from .local_view import LocalView

__all__ = ["RECIPES", "VERIFIED_RELEASES", "try_step"]

# The releases whose ``step`` and ``_init_group`` of these classes were read against the calls below (the step
# bodies are the same from 2.10 to 2.15 but for the graph-capture check's name). A newer release takes torch's
# own step on the local view until it is compared too: slower, never different.
VERIFIED_RELEASES = (MIN_TORCH, (2, 15))


class Recipe(NamedTuple):
    """How one class's ``step`` calls its functional implementation: the state keys ``_init_group`` collects
    for a group (in order), and the call with ``(optimizer, group, params, grads, lists)``."""

    keys: Callable[[dict], tuple]
    call: Callable[..., None]
    capture_check: bool  # the step first runs the optimizer's graph-capture health check


def _scaler_options(optimizer: Optimizer) -> dict:
    return {"grad_scale": getattr(optimizer, "grad_scale", None), "found_inf": getattr(optimizer, "found_inf", None)}


def _sgd(optimizer: Optimizer, group: dict, params: list, grads: list, lists: dict) -> None:
    _sgd_module.sgd(
        params, grads, lists.get("momentum_buffer", []),
        weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
        dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
        has_sparse_grad=False, foreach=group["foreach"], fused=group["fused"], **_scaler_options(optimizer),
    )  # fmt: skip


def _adam(optimizer: Optimizer, group: dict, params: list, grads: list, lists: dict) -> None:
    beta1, beta2 = group["betas"]
    _adam_module.adam(
        params, grads, lists["exp_avg"], lists["exp_avg_sq"], lists.get("max_exp_avg_sq", []), lists["step"],
        amsgrad=group["amsgrad"], has_complex=False, beta1=beta1, beta2=beta2, lr=group["lr"],
        weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"], foreach=group["foreach"],
        capturable=group["capturable"], differentiable=group["differentiable"], fused=group["fused"],
        decoupled_weight_decay=group["decoupled_weight_decay"], **_scaler_options(optimizer),
    )  # fmt: skip


def _adagrad(optimizer: Optimizer, group: dict, params: list, grads: list, lists: dict) -> None:
    _adagrad_module.adagrad(
        params, grads, lists["sum"], lists["step"],
        lr=group["lr"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"], eps=group["eps"],
        has_sparse_grad=False, foreach=group["foreach"], maximize=group["maximize"],
        differentiable=group["differentiable"], has_complex=False, fused=group["fused"], **_scaler_options(optimizer),
    )  # fmt: skip


def _rmsprop(optimizer: Optimizer, group: dict, params: list, grads: list, lists: dict) -> None:
    _rmsprop_module.rmsprop(
        params, grads, lists["square_avg"], lists.get("grad_avg", []), lists.get("momentum_buffer", []),
        lists["step"],
        lr=group["lr"], alpha=group["alpha"], eps=group["eps"], weight_decay=group["weight_decay"],
        momentum=group["momentum"], centered=group["centered"], foreach=group["foreach"],
        maximize=group["maximize"], differentiable=group["differentiable"], capturable=group["capturable"],
        has_complex=False,
    )  # fmt: skip


def _adamax(optimizer: Optimizer, group: dict, params: list, grads: list, lists: dict) -> None:
    beta1, beta2 = group["betas"]
    _adamax_module.adamax(
        params, grads, lists["exp_avg"], lists["exp_inf"], lists["step"],
        eps=group["eps"], beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        foreach=group["foreach"], maximize=group["maximize"], differentiable=group["differentiable"],
        capturable=group["capturable"], has_complex=False,
    )  # fmt: skip


def _nadam(optimizer: Optimizer, group: dict, params: list, grads: list, lists: dict) -> None:
    beta1, beta2 = group["betas"]
    _nadam_module.nadam(
        params, grads, lists["exp_avg"], lists["exp_avg_sq"], lists["mu_product"], lists["step"],
        beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
        momentum_decay=group["momentum_decay"], eps=group["eps"], maximize=group["maximize"],
        decoupled_weight_decay=group["decoupled_weight_decay"], foreach=group["foreach"],
        capturable=group["capturable"], differentiable=group["differentiable"], has_complex=False,
    )  # fmt: skip


def _radam(optimizer: Optimizer, group: dict, params: list, grads: list, lists: dict) -> None:
    beta1, beta2 = group["betas"]
    _radam_module.radam(
        params, grads, lists["exp_avg"], lists["exp_avg_sq"], lists["step"],
        beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
        maximize=group["maximize"], foreach=group["foreach"], capturable=group["capturable"],
        differentiable=group["differentiable"], decoupled_weight_decay=group["decoupled_weight_decay"],
        has_complex=False,
    )  # fmt: skip


def _sgd_keys(group: dict) -> tuple:
    return ("momentum_buffer",) if group["momentum"] != 0 else ()


def _adam_keys(group: dict) -> tuple:
    return (
        ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step") if group["amsgrad"] else ("exp_avg", "exp_avg_sq", "step")
    )


def _rmsprop_keys(group: dict) -> tuple:
    momentum = ("momentum_buffer",) if group["momentum"] > 0 else ()
    return ("square_avg", *(("grad_avg",) if group["centered"] else ()), *momentum, "step")


def _fixed(*keys: str) -> Callable[[dict], tuple]:
    return lambda group: keys


RECIPES: dict[type, Recipe] = {
    SGD: Recipe(_sgd_keys, _sgd, capture_check=False),
    Adam: Recipe(_adam_keys, _adam, capture_check=True),
    AdamW: Recipe(_adam_keys, _adam, capture_check=True),  # Adam's step, decoupled_weight_decay=True in its groups
    Adagrad: Recipe(_fixed("sum", "step"), _adagrad, capture_check=False),
    RMSprop: Recipe(_rmsprop_keys, _rmsprop, capture_check=True),
    Adamax: Recipe(_fixed("exp_avg", "exp_inf", "step"), _adamax, capture_check=True),
    NAdam: Recipe(_fixed("exp_avg", "exp_avg_sq", "mu_product", "step"), _nadam, capture_check=True),
    RAdam: Recipe(_fixed("exp_avg", "exp_avg_sq", "step"), _radam, capture_check=True),
}
_VERIFIED = VERIFIED_RELEASES[0] <= torch_release() <= VERIFIED_RELEASES[1]


def _capture_check(optimizer: Optimizer) -> None:
    check = getattr(optimizer, "_accelerator_graph_capture_health_check", None)  # its name from torch 2.11
    (check or optimizer._cuda_graph_capture_health_check)()


def _any_missing(grads: list) -> bool:
    """Whether a parameter has no gradient (identity, in C: ``None in grads`` would call each tensor's ``==``)."""
    return not all(map(operator.is_not, grads, repeat(None)))


def try_step(optimizer: Optimizer, view: LocalView, grads: list) -> bool:
    """Step ``optimizer`` (whose param groups and state ``view`` holds; ``grads`` from ``view.local_grads()``)
    with its class's functional implementation; ``False``, with nothing done, where that is not torch's step.

    Example:
        >>> try_step(torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(1))]), None, [])  # no recipe
        False
    """
    recipe = RECIPES.get(type(optimizer))
    if recipe is None or not _VERIFIED or not view.torch_stepped or view.has_complex or _any_missing(grads):
        return False
    calls, start, shards = [], 0, view.shard_locals()
    for index, (group, aliases) in enumerate(zip(optimizer.param_groups, view.groups)):
        lists = view.state_lists(index, recipe.keys(group))
        if lists is None or isinstance(group["lr"], torch.Tensor):  # torch's own checks of a tensor lr apply
            return False
        end = start + len(aliases)
        calls.append((group, shards[start:end], grads[start:end], lists))
        start = end
    with torch.no_grad():  # what the step's ``_use_grad_for_differentiable`` sets (differentiable is off here)
        if recipe.capture_check:
            _capture_check(optimizer)
        for group, params, group_grads, lists in calls:
            recipe.call(optimizer, group, params, group_grads, lists)
    return True
