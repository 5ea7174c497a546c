"""The local view the local step runs on: an optimizer's param groups and state as local tensors.

``LocalView`` is built once per optimizer and reused while the identity checks say nothing changed:
each parameter becomes a ``LocalParam`` alias of its shard, each state DTensor its local tensor.
A step hands each alias its parameter's local gradient, runs, takes the gradients back and folds
state torch created into the DTensor state (``sync_state``). ``local_step`` decides when.

Example:
    >>> LocalParam.__slots__
    ('grad',)
"""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict, deque
from itertools import chain, compress, islice, repeat
from typing import Any, Callable, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from ..torch_compat import local_tensor

__all__ = ["LocalParam", "LocalView", "no_override_context"]

# The per-step bookkeeping runs for every parameter and state value of every step, so it is written as
# C-level loops (map / attrgetter / itertools) over lists cached per optimizer: a Python loop body costs
# ~0.1-0.5 us per item, which is 10-20 % of a cheap step (SGD, fused Adam) over a hundred parameters.
_LOCAL_TENSOR = operator.attrgetter("_local_tensor")
_GRAD = operator.attrgetter("grad")
_SPEC = operator.attrgetter("_spec")
# A DTensor's ``.grad`` getter first looks for a ``__torch_function__`` override (DTensor has none): with torch
# functions off for the hand-over (no torch op runs in it) the read costs half, ~7 us a step per 50 parameters.
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction


_NO_SUBCLASS_TORCH_FUNCTION = torch._C.DisableTorchFunctionSubclass


def no_override_context() -> Any:
    """The context torch's step runs in on the aliases: no torch-function override runs in it but a user's mode.

    Any tensor-subclass override check costs every op per ``LocalParam`` argument, and with only subclass
    overrides off a foreach or fused op still pays ~0.6 us per subclass tensor in its list (measured: 48 aliases,
    ``_foreach_add_`` 76 us vs 45 us for plain tensors). With no TorchFunctionMode active all torch functions are
    switched off, which is then the same semantics (the tensors in the step, aliases, plain local gradients and
    state, have no override) at plain-tensor cost. With a mode active (``torch.device(...)``, a user's
    TorchFunctionMode) only subclass overrides are off, so the mode still sees every op.

    Example:
        >>> type(no_override_context()).__name__
        'DisableTorchFunction'
    """
    if torch._C._is_torch_function_mode_enabled():
        return _NO_SUBCLASS_TORCH_FUNCTION()
    return _NO_TORCH_FUNCTION()


class LocalParam(torch.Tensor):
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


def _alias(tensor: torch.Tensor) -> LocalParam:
    alias = torch.Tensor._make_subclass(LocalParam, tensor)
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


def _laid_out_as(tensor: Any, param: DTensor) -> bool:
    """Whether ``tensor`` is a DTensor over a plain local tensor with ``param``'s mesh, placements and shape:
    then its local tensor holds the elements of ``param``'s shard."""
    if type(tensor) is not DTensor or type(tensor._local_tensor) is not torch.Tensor:
        return False
    return tensor._spec is param._spec or (
        tensor.device_mesh == param.device_mesh
        and tensor.placements == param.placements
        and tensor.shape == param.shape
    )


def _grad_layout_differs(grads: list, params: list) -> bool:
    """Whether a gradient is laid out unlike its parameter (then only torch's DTensor path is right);
    a missing gradient is fine."""
    return not all(grad is None or _laid_out_as(grad, p) for grad, p in zip(grads, params))


class LocalView:
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
        self.has_complex = self.steppable and any(map(torch.is_complex, locals_))
        self.torch_stepped = False  # set by the caller after a step through torch's own ``step`` on this view
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
        self._lists: dict = {}  # (group index, state keys) -> state_lists(): the state changed, build them anew
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

    def shard_locals(self) -> list:
        """The parameters' own local tensors, as ``valid()`` found them: what ``functional_step`` hands torch's
        functional implementations (no alias there: the gradients go in a list). Read each step, never held, so
        the watchers above still free a replaced shard at once."""
        return list(map(_LOCAL_TENSOR, self.params))

    def local_grads(self) -> Optional[list]:
        """Each parameter's local gradient (``None`` where it has none), or ``None`` if a gradient is laid out
        unlike its parameter (then only torch's DTensor path is right)."""
        with _NO_TORCH_FUNCTION():
            grads = list(map(_GRAD, self.params))
        try:  # the common case, at C speed: every gradient a DTensor on its parameter's spec (FSDP2 reuses it)
            if _same(map(_SPEC, grads), self.specs):
                return list(map(_LOCAL_TENSOR, grads))
        except AttributeError:  # a missing (None) or plain-tensor gradient
            pass
        if _grad_layout_differs(grads, self.params):
            return None
        return [None if g is None else g._local_tensor for g in grads]

    def attach_grads(self, grads: list) -> None:
        """Each alias gets its parameter's local gradient (``local_grads()``) for torch's own step."""
        _set_grads(self.aliases, grads)

    def state_lists(self, index: int, keys: tuple) -> Optional[dict]:
        """For param group ``index``: each state key of ``keys`` -> the local state tensors of its parameters
        in order, the lists torch's step would collect; ``None`` if a parameter lacks one (torch's step would
        create it). Cached until the state changes."""
        cached = self._lists.get((index, keys), False)
        if cached is not False:
            return cached
        entries = [self.local_state.get(alias) for alias in self.groups[index]]
        lists: Optional[dict] = {key: [e.get(key) if e else None for e in entries] for key in keys}
        if any(not isinstance(v, torch.Tensor) for values in lists.values() for v in values):
            lists = None
        self._lists[(index, keys)] = lists
        return lists

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
    """Whether every tensor state value of ``param`` (but a scalar like Adam's ``step``) is laid out as it is.
    State put in by hand may not be (a plain tensor, another placement): its local tensor is not this shard,
    so only torch's DTensor path is right (it raises the same error on every rank, or redistributes)."""
    tensors = (v for v in entry.values() if isinstance(v, torch.Tensor) and v.ndim > 0)
    return all(_laid_out_as(value, param) for value in tensors)


def _fold_entry(local: dict, entry: dict, param: DTensor) -> None:
    """Fold one parameter's local state entry into its DTensor entry (see ``LocalView.sync_state``)."""
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
