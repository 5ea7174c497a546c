"""Step torch's elementwise optimizers on the local shards of an ``fsdp()`` model's DTensors.

Why it is correct: in SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam and RAdam each element
of a parameter is updated from the same element of its gradient and state only. A DTensor
parameter, its gradient and its state share one layout (FSDP2 shards them alike; a replicated
dimension holds identical copies), so stepping each rank's local tensors is the DTensor step
without the dispatch: the same torch implementation (the group's foreach / fused / single-tensor
choice is resolved the same way for local tensors of the same device) runs the same kernels on
the same elements, bit for bit. The state stays DTensors (new state is wrapped with the
parameter's layout), so ``get_optimizer_state_dict``, DCP checkpoints and resharding see what
they saw before.

How: ``install()`` (called by ``fsdp()``) wraps the ``step`` of exactly those classes, below
torch's hook wrapper (step hooks still see the DTensors). An optimizer of one of the classes
(not a subclass: its ``step`` may look across elements) whose parameters are all ``fsdp()``
DTensors, with ``differentiable=False``, steps with its param groups and state
swapped to the local tensors for the call (``local_view.LocalView``: ``LocalParam`` aliases of
them, which carry the gradient in a plain slot); from its second step on, once every parameter has a
gradient and its state, ``functional_step`` makes the call of torch's functional implementation that
``step`` would make, with cached lists of the local tensors. Anything else takes torch's path untouched.
Off: ``ZETA_FSDP_LOCAL_STEP=0`` (the whole process) or ``use_local_step(optimizer, False)``.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import weakref
from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim import SGD, Adagrad, Adam, Adamax, AdamW, NAdam, Optimizer, RAdam, RMSprop

from ..torch_compat import foreach_as_plain
from .functional_step import try_step
from .local_view import LocalParam, LocalView, no_override_context
from .registry import fsdp_owner, layout_matches, param_layout, register_fsdp_model, snapshot_params

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ENV_VAR", "install", "is_elementwise", "snapshot_params", "steps_locally"]
__all__ += ["track_fsdp_model", "use_local_step"]

ELEMENTWISE_OPTIMIZERS = (SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam)
ENV_VAR = "ZETA_FSDP_LOCAL_STEP"
_MARK = "_zeta_fsdp_local_step"


class _Record:
    """What the local step knows of one optimizer: turned off or not, its param-group layout when eligibility
    was last decided (``registry.param_layout``), the decision, and the cached local view (``None`` until the
    first local step, and whenever the layout changes, a watched local tensor goes or a state is loaded)."""

    def __init__(self) -> None:
        self.off = False
        self.load_hook = False  # registered with the first view
        self.layout: Optional[tuple] = None
        self.eligible = False
        self.view: Optional[LocalView] = None


_RECORDS: weakref.WeakKeyDictionary[Optimizer, _Record] = weakref.WeakKeyDictionary()


def _record(optimizer: Optimizer) -> _Record:
    record = _RECORDS.get(optimizer)
    if record is None:
        record = _RECORDS[optimizer] = _Record()
    return record


def use_local_step(optimizer: Optimizer, enabled: bool = True) -> Optimizer:
    """Turn the local-shard step on (default) or off for one optimizer; returns it.

    Example:
        >>> opt = use_local_step(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), False)
        >>> steps_locally(opt)
        False
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"use_local_step: enabled={enabled!r} is not accepted. Accepted: True or False.")
    chain, target = [], optimizer  # a wrapper (accelerate's AcceleratedOptimizer, your own) and what it holds
    while target is not None and len(chain) < 8:
        chain.append(target)
        target = getattr(target, "optimizer", None)
    optimizers = [o for o in chain if isinstance(o, Optimizer)]
    if not optimizers:
        raise ValueError(
            f"use_local_step: optimizer={type(optimizer).__name__} is not accepted. Accepted: a torch.optim.Optimizer, "
            "or a wrapper holding one as .optimizer (not the model)."
        )
    for each in optimizers:
        _record(each).off = not enabled
    return optimizer


def is_elementwise(optimizer: Optimizer) -> bool:
    """``True`` for an instance of exactly one of ``ELEMENTWISE_OPTIMIZERS`` with ``differentiable=False``.

    Example:
        >>> is_elementwise(torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))]))
        False
    """
    if type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
        return False
    return not any(group.get("differentiable", False) for group in optimizer.param_groups)


def steps_locally(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step()`` runs on the local shards: an elementwise optimizer over ``fsdp()``
    DTensor parameters only, not turned off. (A step also falls back to torch's path when a gradient or a
    state tensor is laid out unlike its parameter, e.g. put in by hand. A ``closure`` is called first, as torch's
    step calls it, and the gradients it made are stepped locally.)

    Example:
        >>> steps_locally(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))]))  # plain tensors
        False
    """
    return _eligible_record(optimizer) is not None


_DIFFERENTIABLE = operator.methodcaller("get", "differentiable", False)
_OFF_VALUES, _ON_VALUES = frozenset({"0", "false", "off", "no"}), frozenset({"", "1", "true", "on", "yes"})


def _turned_off_by_environment() -> bool:
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value in _ON_VALUES:
        return False
    if value in _OFF_VALUES:
        return True
    raise ValueError(
        f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not accepted. Accepted: 0 / false / off / no (torch's DTensor path) "
        "or 1 / true / on / yes (the local step, the default)."
    )


def _eligible_record(optimizer: Optimizer) -> Optional[_Record]:
    """The optimizer's record if it steps on the local shards (see ``steps_locally``), else ``None``. Eligibility
    is decided again only when the param-group layout changed (``add_param_group``, a group's list edited in
    place): one identity pass over the parameters a step."""
    if _turned_off_by_environment():
        return None
    record = _record(optimizer)
    if record.off:
        return None
    if not layout_matches(optimizer, record.layout):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        ok = bool(params) and is_elementwise(optimizer)
        ok = ok and all(isinstance(p, DTensor) and fsdp_owner(p) is not None for p in params)
        ok = ok and all(type(p._local_tensor) is torch.Tensor for p in params)  # see LocalView.steppable
        record.eligible = ok and not any(pl.is_partial() for p in params for pl in p.placements)
        record.layout, record.view = param_layout(optimizer), None
    if not record.eligible or any(map(_DIFFERENTIABLE, optimizer.param_groups)):  # a flag set after a step
        return None
    return record


def _view(optimizer: Optimizer, record: _Record) -> LocalView:
    view = record.view
    if view is None or not view.valid(optimizer):
        view = record.view = LocalView(optimizer, functools.partial(_forget_view, weakref.ref(record)))
        if not record.load_hook:
            optimizer.register_load_state_dict_pre_hook(_forget_view_before_load)
            record.load_hook = True
    return view


def _forget_view(record_ref: weakref.ref, _gone: Any) -> None:
    """A watched local tensor is gone: drop the record's view (whichever it is now: a rebuilt one is built anew
    at the next step anyway)."""
    record = record_ref()
    if record is not None:
        record.view = None


def _forget_view_before_load(optimizer: Optimizer, state_dict: Any) -> None:
    """``load_state_dict`` replaces the state: drop the view of the old one first, so the old state is freed
    with it instead of living on beside the loaded one until the next step."""
    record = _RECORDS.get(optimizer)
    if record is not None:
        record.view = None


def _step_on_local_shards(optimizer: Optimizer, record: _Record, step: Callable, args: tuple, kwargs: dict) -> Any:
    """One step on the cached local view: torch's functional implementation called with its lists once the view
    allows it (``functional_step.try_step``), else ``step`` with the param groups and state swapped to the view.
    No autograd op runs in the swap (attribute reads and slot stores), so no ``no_grad`` context around it."""
    view = _view(optimizer, record)
    grads = view.local_grads() if view.steppable else None
    if grads is None:
        return step(optimizer, *args, **kwargs)
    with no_override_context():  # torch's functional implementation, called as the class's step calls it
        done = not args and not kwargs and try_step(optimizer, view, grads)
    if done:
        return None
    view.attach_grads(grads)
    users = [group["params"] for group in optimizer.param_groups]  # the very lists (a user may hold one)
    for group, local in zip(optimizer.param_groups, view.groups):
        group["params"] = local
    optimizer.state = view.local_state
    try:
        with no_override_context():
            result = step(optimizer, *args, **kwargs)
    except BaseException as error:
        _hand_back(optimizer, view, users)
        with contextlib.suppress(Exception):  # fold what torch created before it raised; never mask its error
            view.sync_state()
        record.view = None  # the state may be half folded: build the view afresh
        if type(error) is KeyError and error.args and type(error.args[0]) is LocalParam:  # name the user's parameter
            index = next((i for i, alias in enumerate(view.aliases) if alias is error.args[0]), None)
            if index is not None:
                raise KeyError(view.params[index]) from None
        raise
    _hand_back(optimizer, view, users)
    view.sync_state()
    view.torch_stepped = True
    return result


def _hand_back(optimizer: Optimizer, view: LocalView, users: list) -> None:
    """The user's param-group lists and state back in place; no reference to a gradient outlives the step."""
    for group, params in zip(optimizer.param_groups, users):
        group["params"] = params
    optimizer.state = view.state
    view.detach_grads()


def _local_step(step: Callable) -> Callable:
    """``step`` of an elementwise class, run on the local shards when the optimizer qualifies."""

    @functools.wraps(step)
    def wrapper(self: Optimizer, *args: Any, **kwargs: Any) -> Any:
        record = None if torch.compiler.is_compiling() else _eligible_record(self)
        if record is None:
            return step(self, *args, **kwargs)
        closure = kwargs.pop("closure", args[0] if args else None)
        if closure is None:
            return _step_on_local_shards(self, record, step, args, kwargs)
        # Each of these classes' step calls the closure first, under enable_grad, and returns its loss (how
        # Lightning steps): do that here, then step the gradients it made on the local shards.
        with torch.enable_grad():
            loss = closure()
        record = _eligible_record(self)  # the closure may change the param groups (add_param_group in training_step)
        if record is None:
            step(self, **kwargs)
        else:
            _step_on_local_shards(self, record, step, (), kwargs)
        return loss

    setattr(wrapper, _MARK, True)
    return wrapper


def install() -> None:
    """Wrap ``step`` of each elementwise class once (idempotent). A class torch already wrapped with its
    hook runner (an instance exists) is re-wrapped inside it, so step hooks keep running outside.

    Example:
        >>> install(); install()
        >>> getattr(torch.optim.AdamW.step, "hooked", False) or hasattr(torch.optim.AdamW.step, _MARK)
        True
    """
    foreach_as_plain(LocalParam)
    for cls in ELEMENTWISE_OPTIMIZERS:  # Adam before AdamW: AdamW inherits Adam's step until torch hooks it
        current = cls.__dict__.get("step")
        if (
            current is None
            or getattr(current, _MARK, False)
            or getattr(getattr(current, "__wrapped__", None), _MARK, False)
        ):
            continue
        if getattr(current, "hooked", False):
            hooked = Optimizer.profile_hook_step(_local_step(current.__wrapped__))
            hooked.hooked = True
            cls.step = hooked
        else:
            cls.step = _local_step(current)


def track_fsdp_model(model: torch.nn.Module, before: Any) -> None:
    """What ``fsdp()`` calls after wrapping: register ``model`` (``before`` = ``snapshot_params(model)``
    taken before wrapping) for the optimizer checks and the local-shard step, and install the step."""
    register_fsdp_model(model, before)
    install()
