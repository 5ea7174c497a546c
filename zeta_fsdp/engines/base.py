"""The engine seam, typed: what ``engines.fully_shard`` and ``engines.replicate`` each define, with
one signature (``Engine``), and the two objects they take (``WrapOptions``, ``PlanTerms``).

An engine is a module; ``Engine`` is the protocol both modules satisfy (a type checker accepts a
module for a protocol; ``tests/test_options.py`` checks every signature against it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence, Union

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..costs import AccumulationCost
from ..wrapping import WrapPlan

__all__ = ["Engine", "PlanTerms", "WrapOptions"]


@dataclasses.dataclass(frozen=True)
class WrapOptions:
    """What ``fsdp()`` resolved for the engine, validated and computed once per call.

    ``mesh`` is the caller's (or, after ``Engine.mesh_for``, the one built); ``shape`` the mesh
    shape (``options.resolve_mesh_shape``); ``reshard`` the blocks' ``reshard_after_forward``.

    Example:
        >>> WrapOptions(torch.device("cpu"), MixedPrecisionPolicy(), shape=(2,)).reshard
        True
    """

    device: torch.device
    mp_policy: MixedPrecisionPolicy
    shape: tuple[int, ...] = (1,)
    mesh: Optional[DeviceMesh] = None
    reshard: Union[bool, int] = True
    cpu_offload: bool = False
    ignored: frozenset = frozenset()
    keep_tail: int = 0
    prefetch: Optional[int] = None
    fp32_params: Sequence[str] = ()


@dataclasses.dataclass(frozen=True)
class PlanTerms:
    """What the planner knows when it asks an engine for its terms (``Engine.plan_costs``): the
    model, its planned units (``planner.estimate.UnitEstimate``), the policy, the blocks' reshard,
    the shard group's size, the trainable gradients as ``(dtype, bytes)`` and why this engine runs."""

    model: nn.Module
    units: list
    policy: MixedPrecisionPolicy
    reshard: bool
    shard_size: int
    grads: list[tuple[torch.dtype, int]]
    why: str


class Engine(Protocol):
    """What differs between the engines; every consumer asks ``engines.engine_of`` /
    ``engines.engine_named`` for the module and calls these (no one branches on the engine)."""

    # The engine's name, as ``options.choose_engine`` returns it and ``engines.engine_named`` takes it.
    NAME: str
    # Whether every rank's copy of a parameter is every rank's (DDP) or a shard of its own (FSDP2).
    REPLICAS_EQUAL: bool
    # Whether mp="bf16" runs as torch.autocast on this engine (DDP), not as a MixedPrecisionPolicy.
    AUTOCAST_MP: bool

    def managed(self, model: nn.Module) -> list[nn.Module]:
        """The modules in ``model`` this engine runs (its units)."""

    def check(self, plan: WrapPlan, model: nn.Module, master: Optional[torch.dtype]) -> None:
        """Raise what the engine would refuse, before anything is wrapped."""

    def add_fp32_units(self, plan: WrapPlan, model: nn.Module, names: Sequence[str], caller: str = "fsdp") -> None:
        """Give fp32 parameters the units this engine needs for them (none where nothing is needed)."""

    def mesh_for(self, options: WrapOptions) -> Optional[DeviceMesh]:
        """The mesh the engine runs on (``None``: the default group)."""

    def wrap(self, model: nn.Module, plan: WrapPlan, options: WrapOptions) -> int:
        """Put ``model`` on the engine; returns this rank's index in its shard group."""

    def unfreeze_check(self, model: nn.Module, master: Optional[torch.dtype]) -> Callable[[], Optional[str]]:
        """A check run before each forward: what a later unfreeze broke, or ``None``."""

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module, reduce: bool) -> Iterator[None]:
        """``training.no_sync`` on this engine (a context manager)."""

    def accumulation_bytes(self, model: nn.Module, micro_batches: int) -> dict[str, AccumulationCost]:
        """What each ``no_sync`` choice costs a live model."""

    def peak_memory(
        self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], step: Callable[[], Any], inputs: tuple
    ) -> dict[str, int]:
        """``measure.peak_memory_by_category`` with this engine's memory tracker."""

    def plan_costs(self, terms: PlanTerms) -> tuple[int, int, list[str]]:
        """The planner's engine terms: ``(all-gather peak, all-reduces per synced backward, notes)``."""

    def plan_accumulation(self, plan: Any, micro_batches: int) -> dict[str, AccumulationCost]:
        """``MemoryPlan.accumulation`` on this engine."""
