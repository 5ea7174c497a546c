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
swapped to the local tensors for the call (``_LocalParam`` aliases of them, which carry the
gradient as a plain attribute). Anything else takes torch's path untouched.
Off: ``ZETA_FSDP_LOCAL_STEP=0`` (the whole process) or ``use_local_step(optimizer, False)``.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import weakref
from collections import defaultdict, deque
from itertools import chain, compress, islice, repeat
from typing import Any, Callable, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim import SGD, Adagrad, Adam, Adamax, AdamW, NAdam, Optimizer, RAdam, RMSprop

from ..torch_compat import foreach_as_plain, local_tensor
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
        self.view: Optional[_LocalView] = None


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
        ok = ok and all(type(p._local_tensor) is torch.Tensor for p in params)  # see _LocalView.steppable
        record.eligible = ok and not any(pl.is_partial() for p in params for pl in p.placements)
        record.layout, record.view = param_layout(optimizer), None
    return record if record.eligible else None


# The per-step bookkeeping runs for every parameter and state value of every step, so it is written as
# C-level loops (map / attrgetter / itertools) over lists cached per optimizer: a Python loop body costs
# ~0.1-0.5 us per item, which is 10-20 % of a cheap step (SGD, fused Adam) over a hundred parameters.
_LOCAL_TENSOR = operator.attrgetter("_local_tensor")
_GRAD = operator.attrgetter("grad")
_SPEC = operator.attrgetter("_spec")
# A DTensor's ``.grad`` getter first looks for a ``__torch_function__`` override (DTensor has none): with torch
# functions off for the hand-over (no torch op runs in it) the read costs half, ~7 us a step per 50 parameters.
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction


# Inside the step torch functions stay on (a user's TorchFunctionMode, ``torch.device(...)``, still sees every op);
# only the check for a subclass override, which ``_LocalParam`` would make every op pay per tensor, is skipped.
_NO_SUBCLASS_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass


class _LocalParam(torch.Tensor):
    """An alias of a parameter's local tensor (same storage, offset, sizes, strides and version counter: the
    step's in-place updates land in the DTensor's shard) that the optimizer steps instead of it.

    Why not the local tensor itself: its gradient would have to go through autograd's checked ``.grad`` setter,
    twice a step per parameter (on, then off so no second reference outlives the step), ~0.3 us each: for the
    cheapest steps (SGD, fused kernels) over small shards that alone is 10-20 % of the step. Here ``grad`` is a
    plain slot of the Python object, so handing it over, taking it back and torch's own ``p.grad`` reads cost a
    slot store or read (~30 ns). Only torch's optimizer code, which reads ``p.grad`` in Python and passes the
    gradients to its kernels explicitly, ever sees one. Torch-function overrides are off
    (``_disabled_torch_function_impl``): results of ops on it are plain tensors.
    """

    __slots__ = ("grad",)  # a data descriptor of this class: it takes the place of the tensor's ``grad``
    __torch_function__ = torch._C._disabled_torch_function_impl
    __hash__ = object.__hash__  # torch's ``self.state[p]`` lookups: identity hashing in C, not Tensor's Python __hash__


def _alias(tensor: torch.Tensor) -> _LocalParam:
    alias = torch.Tensor._make_subclass(_LocalParam, tensor)
    alias.grad = None
    return alias


def _same(first: Iterable, second: Iterable) -> bool:
    """Pairwise identity (the callers compare sequences of equal length)."""
    return all(map(operator.is_, first, second))


def _values(entries: Iterable[dict]) -> Iterable:
    """Every value of every state entry, in order."""
    return chain.from_iterable(map(dict.values, entries))


def _set_grads(tensors: list, grads: Iterable) -> None:
    deque(map(setattr, tensors, repeat("grad"), grads), maxlen=0)


def _grad_layout_differs(grads: list, specs: list) -> bool:
    """Whether a gradient is laid out unlike its parameter (then only torch's DTensor path is right);
    a missing gradient is fine."""
    for grad, spec in zip(grads, specs):
        if grad is None or (type(grad) is DTensor and grad._spec is spec):
            continue
        if type(grad) is not DTensor or grad.device_mesh != spec.mesh or grad.placements != spec.placements:
            return True
    return False


class _LocalView:
    """An optimizer's param groups and state as local tensors, built once and reused while valid.

    Valid while the optimizer keeps its state dict object (``load_state_dict`` replaces it), its
    entries and the objects each holds (in-place updates keep them), its param groups and each
    parameter's local tensor (FSDP2 may re-create it, e.g. after ``model.to()``). The checks are
    identity comparisons in C loops: a few microseconds per step for a hundred parameters.
    """

    def __init__(self, optimizer: Optimizer, on_stale: Callable[[Any], None]) -> None:
        self.state = optimizer.state
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        locals_ = [local_tensor(p) for p in self.params]
        # A shard that is itself a tensor subclass (torchao's float8 weights) has its own dispatch, which an alias
        # would skip: such a model keeps torch's path.
        self.steppable = all(type(t) is torch.Tensor for t in locals_)
        self.aliases = list(map(_alias, locals_)) if self.steppable else []
        # The parameters' local tensors are known by id and watched, not held: when FSDP2 replaces one
        # (``model.to()``, ``to_empty``, an offload), ``on_stale`` drops this view and its aliases at once, so the
        # old shards are freed then, not at the next step. (A watched tensor is never a parameter: weak references
        # to parameters would break ``torch.utils.swap_tensors``.)
        self.local_ids = list(map(id, locals_))
        self._watchers = [weakref.ref(t, on_stale) for t in locals_]
        aliases = iter(self.aliases)
        self.groups = [list(islice(aliases, len(g["params"]))) for g in optimizer.param_groups]
        self.specs = [p._spec for p in self.params]
        # torch's own state is a defaultdict; a plain dict (state restored by hand) raises KeyError for a parameter
        # without state as it does on torch's path, before anything is updated
        self.local_state: dict = defaultdict(dict) if isinstance(optimizer.state, defaultdict) else {}
        for p, alias in zip(self.params, self.aliases):
            entry = optimizer.state.get(p)
            if entry:
                self.local_state[alias] = {k: local_tensor(v) for k, v in entry.items()}
                self.steppable = self.steppable and _laid_out_like(entry, p)
        self._snapshot()

    def _snapshot(self) -> None:
        self.keys = list(self.state)
        self.entries = list(self.state.values())
        self.values = list(_values(self.entries))
        self.dtensor_mask = [type(v) is DTensor for v in self.values]
        self.dtensor_locals = [v._local_tensor for v in compress(self.values, self.dtensor_mask)]
        self.local_entries = list(self.local_state.values())
        self.local_values = list(_values(self.local_entries))

    def valid(self, optimizer: Optimizer) -> bool:
        """(The param-group layout is the record's: a change drops the view.)"""
        state = optimizer.state
        return (
            state is self.state
            and len(state) == len(self.entries)
            and all(map(operator.eq, map(id, map(_LOCAL_TENSOR, self.params)), self.local_ids))
            and _same(state.values(), self.entries)
            and _same(state, self.keys)  # an entry moved to another parameter (``state[b] = state.pop(a)``)
            and sum(map(len, self.entries)) == len(self.values)
            and _same(_values(self.entries), self.values)
            # a state DTensor given another local tensor in place (``torch.utils.swap_tensors``)
            and _same(map(_LOCAL_TENSOR, compress(self.values, self.dtensor_mask)), self.dtensor_locals)
        )

    def attach_grads(self) -> bool:
        """Each alias gets its parameter's local gradient; ``False`` (nothing attached) if a
        gradient's layout differs from its parameter's."""
        grads = list(map(_GRAD, self.params))
        try:  # the common case, at C speed: every gradient a DTensor on its parameter's spec (FSDP2 reuses it)
            if _same(map(_SPEC, grads), self.specs):
                _set_grads(self.aliases, map(_LOCAL_TENSOR, grads))
                return True
        except AttributeError:  # a missing (None) or plain-tensor gradient
            pass
        if _grad_layout_differs(grads, self.specs):
            return False
        _set_grads(self.aliases, [None if g is None else g._local_tensor for g in grads])
        return True

    def detach_grads(self) -> None:
        _set_grads(self.aliases, repeat(None))  # the DTensor keeps the gradient; no second reference outlives the step

    def _local_state_unchanged(self) -> bool:
        """No entry, key or value of the local state was added or replaced (torch may replace a value without a
        new key: SGD's ``momentum_buffer`` reset to ``None`` by the user is re-created at the next step)."""
        entries = self.local_entries
        return (
            len(self.local_state) == len(entries)
            and sum(map(len, entries)) == len(self.local_values)
            and _same(_values(entries), self.local_values)
        )

    def sync_state(self) -> None:
        """Fold state torch created or replaced during the step back into the DTensor state: a new entry
        (first step, ``add_param_group``) and a replaced value (a momentum buffer the user reset to ``None``)
        get the parameter's DTensor layout; values updated in place (every later step) need nothing, and are
        told apart by identity in a C loop."""
        if self._local_state_unchanged():
            return
        with torch.no_grad():
            for p, alias in zip(self.params, self.aliases):
                local = self.local_state.get(alias)
                if local:
                    entry = self.state.get(p)
                    if entry is None:  # a new entry (the user's state may be a plain dict, not torch's defaultdict)
                        entry = self.state[p] = {}
                    _fold_entry(local, entry, p)
        self._snapshot()


def _laid_out_like(entry: dict, param: DTensor) -> bool:
    """Whether every tensor state value of ``param`` (but a scalar like Adam's ``step``) is a DTensor laid out like
    it, over a plain local tensor. State put in by hand may not be (a plain tensor, another placement): its local tensor is not this shard,
    so only torch's DTensor path is right (it raises the same error on every rank, or redistributes)."""
    for value in entry.values():
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            continue
        if type(value) is not DTensor or type(value._local_tensor) is not torch.Tensor:
            return False
        if value._spec is not param._spec and (
            value.device_mesh != param.device_mesh or value.placements != param.placements or value.shape != param.shape
        ):
            return False
    return True


def _fold_entry(local: dict, entry: dict, param: DTensor) -> None:
    """Fold one parameter's local state entry into its DTensor entry (see ``_LocalView.sync_state``)."""
    for key, value in local.items():
        old = entry.get(key)
        if isinstance(old, DTensor):
            if value is not old._local_tensor:
                old._local_tensor.copy_(value)
                local[key] = old._local_tensor
        elif isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape == param._local_tensor.shape:
            entry[key] = _wrap_like(value, param)
            local[key] = entry[key]._local_tensor  # from_local may wrap a view: step that very tensor
        else:
            entry[key] = value


def _wrap_like(value: torch.Tensor, param: DTensor) -> DTensor:
    """``value`` (shaped like ``param``'s shard) as a DTensor laid out like ``param``. Of the same dtype it wraps
    the very tensor, on the parameter's spec (FSDP2's own no-grad construction, as for gradients): the state
    then is no view (``from_local`` wraps ``value.view_as(value)``), which costs every later step ~20 % on a
    fused kernel."""
    if value.dtype == param.dtype:
        return DTensor(value, param._spec, requires_grad=False)
    return DTensor.from_local(
        value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _view(optimizer: Optimizer, record: _Record) -> _LocalView:
    view = record.view
    if view is None or not view.valid(optimizer):
        view = record.view = _LocalView(optimizer, functools.partial(_forget_view, weakref.ref(record)))
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
    """``step`` with the param groups and state swapped to the cached local view. No autograd op runs here
    (attribute reads and ``.grad`` assignments), so no ``no_grad`` context: each costs ~3 us a step."""
    view = _view(optimizer, record)
    if not view.steppable:
        return step(optimizer, *args, **kwargs)
    with _NO_TORCH_FUNCTION():
        attached = view.attach_grads()
    if not attached:
        return step(optimizer, *args, **kwargs)
    users = [group["params"] for group in optimizer.param_groups]  # the very lists (a user may hold one)
    for group, local in zip(optimizer.param_groups, view.groups):
        group["params"] = local
    optimizer.state = view.local_state
    try:
        with _NO_SUBCLASS_TORCH_FUNCTION():
            result = step(optimizer, *args, **kwargs)
    except BaseException as error:
        _hand_back(optimizer, view, users)
        with contextlib.suppress(Exception):  # fold what torch created before it raised; never mask its error
            view.sync_state()
        record.view = None  # the state may be half folded: build the view afresh
        if type(error) is KeyError and error.args and type(error.args[0]) is _LocalParam:  # name the user's parameter
            index = next((i for i, alias in enumerate(view.aliases) if alias is error.args[0]), None)
            if index is not None:
                raise KeyError(view.params[index]) from None
        raise
    _hand_back(optimizer, view, users)
    view.sync_state()
    return result


def _hand_back(optimizer: Optimizer, view: _LocalView, users: list) -> None:
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
    foreach_as_plain(_LocalParam)
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
