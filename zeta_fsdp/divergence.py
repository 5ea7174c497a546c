"""The run-time divergence check: before each unit's forward, every rank confirms it runs the same unit.

A rank that skips a unit its peers run (LayerDrop, a branch on the data, a forward nobody could read)
does not join that unit's all-gather: its collectives pair with the wrong ones, then the job computes
garbage or hangs. During the first forwards (``fsdp(divergence_check=...)``, default
``DEFAULT_FORWARDS``; the environment variable ``ZETA_FSDP_DIVERGENCE_CHECK`` sets the default: a
number of forwards, ``always`` or ``off``) each unit's forward pre-hook, registered ahead of FSDP2's
own, all-gathers the unit's index and mode (train/eval, grad/no_grad: 8 bytes a rank) over each of the mesh's groups, and one more gather
ends each forward; on a mismatch every rank raises the same error naming the modules and the ranks.
After the checked forwards the hooks are removed: no cost at all.
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .distributed import mesh_groups
from .torch_compat import all_gather_single

__all__ = ["DEFAULT_FORWARDS", "ENV", "UnitDivergenceError", "add_divergence_check", "resolve_forwards"]

DEFAULT_FORWARDS = 2  # the first training step and one more (a first step may take another path: warm-up)
ENV = "ZETA_FSDP_DIVERGENCE_CHECK"


class UnitDivergenceError(RuntimeError):
    """Ranks were about to run different FSDP units: raised on every rank alike."""


def resolve_forwards(value: Union[bool, int, None], caller: str = "fsdp") -> Optional[int]:
    """How many forwards to check: ``None`` for every forward, ``0`` for none.

    ``value`` is ``fsdp(divergence_check=...)``: ``True`` (every forward), ``False`` / ``0`` (off), an int
    ``n`` (the first ``n`` forwards), or ``None`` (``ZETA_FSDP_DIVERGENCE_CHECK``, else ``DEFAULT_FORWARDS``).

    Example:
        >>> resolve_forwards(True), resolve_forwards(False), resolve_forwards(5)
        (None, 0, 5)
    """
    if value is None:
        text = os.environ.get(ENV, "").strip().lower()
        if not text:
            return DEFAULT_FORWARDS
        if text in ("always", "on", "true"):
            return None
        if text in ("off", "false", "never"):
            return 0
        if text.isascii() and text.isdigit():
            return int(text)
        raise ValueError(
            f"{caller}(): {ENV}={text!r} is not accepted. Accepted: a number of forwards (0: off), "
            "'always' (also 'on', 'true') or 'off' (also 'false', 'never')."
        )
    if isinstance(value, bool):
        return None if value else 0
    if isinstance(value, numbers.Integral) and value >= 0:
        return int(value)
    raise ValueError(
        f"{caller}(): divergence_check={value!r} is not accepted. Accepted: True (every forward), False or 0 "
        "(off), a number of forwards n >= 0, or None (the default: $ZETA_FSDP_DIVERGENCE_CHECK, else "
        f"{DEFAULT_FORWARDS})."
    )


class _Check:
    """The hooks' shared state: unit names by index, the groups to agree over, the forwards left.

    A forward starts at the root, or, where the root is never called (a LightningModule's
    ``self.model(x)``), at a unit entered again while no unit runs (the end-of-forward gather then needs
    the root: without it a rank that skips the last units is caught in the next forward). Forwards under
    ``no_grad`` (evaluation, Lightning's sanity check) are checked but spend none of the budget, up to
    ``_NO_GRAD_CAP`` of them: then the hooks go, for inference alike.
    """

    def __init__(self, names: list[str], groups: list, device: torch.device, left: Optional[int]):
        self.names, self.groups, self.device, self.left = names + ["<end of forward>"], groups, device, left
        self.forward = self.no_grad_forwards = 0
        self.outer: Optional[nn.Module] = None  # the outermost unit running now
        self.seen: set[int] = set()  # the units this forward entered
        self.handles: list[Any] = []

    def done(self) -> bool:
        spent = self.left is not None and self.forward - self.no_grad_forwards >= self.left
        return spent or self.no_grad_forwards >= _NO_GRAD_CAP

    def agree(self, index: int, module: nn.Module) -> None:
        """Every rank's ``(unit, mode)`` the same, or ``UnitDivergenceError`` on every rank: the gathers
        over all groups first, then (more than one group) the verdict spread to every rank of the mesh."""
        # the mode too: a forward one rank runs alone (evaluation on rank 0 only, under no_grad) pairs with
        # its peers' training forward unit for unit, and would be missed by the unit alone
        mine = torch.tensor([index * 4 + 2 * torch.is_grad_enabled() + module.training], device=self.device)
        found: dict[int, int] = {}
        for group in self.groups:
            gathered = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=self.device)
            all_gather_single(gathered, mine, group=group)
            seen = gathered.tolist()
            if len(set(seen)) > 1:
                found.update(zip(dist.get_process_group_ranks(group or dist.group.WORLD), seen))
        if len(self.groups) > 1:  # a rank whose groups all agreed must still stop with the others
            flag = torch.tensor([int(bool(found))], device=self.device)
            for group in [*self.groups, *self.groups]:  # two passes reach every rank of a 2-D mesh
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            if flag.item() and not found:
                raise UnitDivergenceError(self._message({dist.get_rank(): int(mine.item())}, elsewhere=True))
        if found:
            raise UnitDivergenceError(self._message(found))

    def _message(self, by_rank: dict[int, int], elsewhere: bool = False) -> str:
        def run(value: int) -> str:
            unit, grad, training = self.names[value // 4], value // 2 % 2, value % 2
            return f"{unit} ({'train' if training else 'eval'} mode{'' if grad else ', no_grad'})"

        runs = ", ".join(f"rank {r}: {run(v)}" for r, v in by_rank.items())
        where = "other ranks of the mesh diverged (their errors name them)" if elsewhere else "they were about to"
        return (
            f"fsdp(): ranks diverged in forward #{self.forward}: {where} run different FSDP units "
            f"({runs}; this is rank {dist.get_rank()}). A rank that skips or reruns a unit does not join its "
            "collectives (its all-gathers would pair with another unit's: wrong values, then a hang). Usual causes: "
            "layers dropped at random per rank (LayerDrop, stochastic depth), a branch on the data around a block "
            "(an optional tower, a router), code that runs on some ranks only (an evaluation on rank 0 alone: "
            "evaluate on every rank). Run every unit on every rank in every step, or keep the module that may be "
            "skipped inside a larger unit (name the enclosing class as TransformerBlock). This check runs in the "
            f"first forwards ({ENV}=always keeps it on)."
        )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


_NO_GRAD_CAP = 16  # no_grad forwards checked at most (the budget counts forwards with gradients)


def add_divergence_check(
    root: nn.Module, units: list[tuple[str, nn.Module]], mesh: Optional[DeviceMesh], forwards: Optional[int]
) -> bool:
    """Register the check on ``units`` (``(name, module)``, every module of every unit); ``True`` if
    registered (not for ``forwards == 0`` or a mesh of one rank).

    Example:
        add_divergence_check(model, [(u.name, u.modules[0]) for u in plan.units], mesh, forwards=2)
    """
    groups = mesh_groups(mesh) if mesh is not None else []
    if forwards == 0 or not groups:
        return False
    check = _Check([n for n, _ in units], groups, torch.device(mesh.device_type), forwards)
    index = {id(m): i for i, (_, m) in enumerate(units)}

    @torch.compiler.disable
    def before_unit(module: nn.Module, args: Any) -> None:
        # a forward starts at the root, or (a root never called: a LightningModule's `self.model(x)`) at a
        # unit entered between units that this forward already ran
        if check.outer is None and (module is root or not check.seen or id(module) in check.seen):
            if check.done():
                check.remove()  # every rank counts the same forwards: all stop together
                return
            check.forward += 1
            check.no_grad_forwards += not torch.is_grad_enabled()
            check.seen.clear()
        if check.outer is None:
            check.outer = module
        check.seen.add(id(module))
        check.agree(index[id(module)], module)

    @torch.compiler.disable
    def after_unit(module: nn.Module, args: Any, output: Any) -> None:
        if module is check.outer:
            check.outer = None
            if module is root:
                check.agree(len(units), module)  # a rank that skipped the last units meets its peers here

    for _, module in units:
        check.handles.append(module.register_forward_pre_hook(before_unit, prepend=True))
        check.handles.append(module.register_forward_hook(after_unit, always_call=True))
    return True
