"""What a plan says: ``UnitEstimate`` (one unit's bytes on one rank) and ``MemoryPlan`` (the whole model's,
per rank, with the engine's terms, notes and tables). ``estimate.plan()`` computes them."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ..costs import AccumulationCost, accumulation_table
from ..engines import DEFAULT_ENGINE, engine_named
from ..report import format_bytes, render_table
from .dry_run import DryRunResult

__all__ = ["MemoryPlan", "UnitEstimate"]


@dataclass(frozen=True)
class UnitEstimate:
    """One FSDP unit's parameters and its per-rank bytes (for the plan's ``rank``).

    Attributes:
        name, kind: as in ``wrapping.WrapUnit`` (``"block"``, ``"embedding+head"``, ``"root"``, ...).
        num_params: parameter tensors the unit owns; numel: their elements (unsharded).
        unsharded_bytes: the unit's all-gather output (``shard_size * padded rows``, compute dtype).
        param_bytes: sharded parameter storage on the rank (padded rows: the same on every rank).
        local_param_bytes: the logical local shard (what ``DTensor.to_local()`` holds on the rank).
        grad_bytes: sharded gradient storage (padded rows, parameter dtype).
        optimizer_bytes: optimizer state on the rank (unpadded local shard).
        unsharded_grad_bytes: the unsharded gradients ``no_sync(defer="all")`` keeps (reduce dtype).
        partial_grad_bytes: the reduce-scattered sum ``no_sync(defer="all_reduce")`` keeps
            (padded rows, reduce dtype).

    Example:
        >>> from zeta_fsdp.models.gpt import small
        >>> import torch
        >>> from zeta_fsdp.planner import plan
        >>> with torch.device("meta"): model = small()  # the demo GPT, nothing allocated
        >>> plan(model, world_size=8).units[0].param_bytes
        5796
    """

    name: str
    kind: str
    num_params: int
    numel: int
    unsharded_bytes: int = 0
    param_bytes: int = 0
    local_param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    unsharded_grad_bytes: int = 0
    partial_grad_bytes: int = 0


def _units_total(attribute: str, doc: str, example: int, plus: str = "") -> property:
    """A ``MemoryPlan`` property: ``attribute`` summed over the units, plus the plan's ``plus`` if named
    (ignored parameters, kept whole); ``example``: its value for the demo GPT at 2 ranks."""

    def total(self: MemoryPlan) -> int:
        return sum(getattr(u, attribute) for u in self.units) + (getattr(self, plus) if plus else 0)

    doc += f"""

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> import torch
            >>> from zeta_fsdp.planner import plan
            >>> with torch.device("meta"): model = small()  # the demo GPT, nothing allocated
            >>> plan(model, world_size=2).{attribute}
            {example}
        """
    return property(total, doc=doc)


@dataclass
class MemoryPlan:
    """Per-rank memory estimate of ``fsdp(model, ...)`` at ``world_size`` ranks; see ``plan()``.

    The totals exclude activations (they depend on batch size and sequence length).

    Example:
        >>> from zeta_fsdp.models.gpt import small
        >>> import torch
        >>> from zeta_fsdp.planner import plan
        >>> with torch.device("meta"): model = small()  # the demo GPT, nothing allocated
        >>> p = plan(model, world_size=64, shard_strat="HYBRID_SHARD")
        >>> p.param_bytes, p.grad_bytes, p.optimizer_bytes, p.allgather_peak_bytes
        (18260, 18260, 36668, 99712)
    """

    model_name: str
    model_bytes: int
    world_size: int
    rank: int
    strategy: str
    mesh_shape: tuple[int, ...]
    mp: str
    optimizer: str
    reshard_after_forward: bool
    units: list[UnitEstimate]
    ignored_param_names: list[str]
    ignored_bytes: int
    ignored_optimizer_bytes: int
    allgather_peak_bytes: int
    dry_run: Optional[DryRunResult] = None
    notes: list[str] = field(default_factory=list)
    # What the sharded floating-point parameters are stored in (``fsdp(master_dtype=)``) and so
    # what AdamW's state is kept in; "mixed: ..." when the model keeps several dtypes.
    master_dtype: str = "float32"
    optimizer_state_dtype: str = "float32"
    # ``options.choose_engine``'s name for the engine (``engines.engine_named`` turns it into the module).
    engine: str = DEFAULT_ENGINE
    # plan(micro_batches=K): the report compares the ways of accumulating K micro-batches.
    micro_batches: Optional[int] = None
    # DDP's engine: all-reduces per synced backward (``engines.replicate.all_reduces``).
    ddp_all_reduce_count: int = 0

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over (the last mesh dimension).

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> import torch
            >>> from zeta_fsdp.planner import plan
            >>> with torch.device("meta"): model = small()  # the demo GPT, nothing allocated
            >>> plan(model, world_size=64, shard_strat="HYBRID_SHARD").shard_size  # 8 x 8 mesh
            8
        """
        return self.mesh_shape[-1]

    # Sums over the units; ignored parameters (kept whole on every rank) are added to the byte figures.
    numel = _units_total("numel", "Parameters of the model (tied ones once).", 34950)
    param_bytes = _units_total("param_bytes", "Sharded parameter storage per rank.", 69960, "ignored_bytes")
    local_param_bytes = _units_total("local_param_bytes", "Logical local shards per rank.", 69960, "ignored_bytes")
    grad_bytes = _units_total("grad_bytes", "Sharded gradient storage per rank.", 69960, "ignored_bytes")
    optimizer_bytes = _units_total("optimizer_bytes", "Optimizer state per rank.", 140068, "ignored_optimizer_bytes")

    @property
    def total_bytes(self) -> int:
        """Parameters + gradients + optimizer state + all-gather peak (no activations).

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> import torch
            >>> from zeta_fsdp.planner import plan
            >>> with torch.device("meta"): model = small()  # the demo GPT, nothing allocated
            >>> p = plan(model, world_size=2)
            >>> p.total_bytes == p.param_bytes + p.grad_bytes + p.optimizer_bytes + p.allgather_peak_bytes
            True
        """
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.allgather_peak_bytes

    def accumulation(self, micro_batches: Optional[int] = None) -> dict[str, AccumulationCost]:
        """What each way of accumulating ``micro_batches`` (default: the plan's, else 4) costs the rank.

        Keys ``"sync"`` (reduce every micro-batch), ``"all"`` and ``"all_reduce"``
        (``no_sync(defer=...)``); values ``training.AccumulationCost``: the gradient bytes held
        between micro-batches and the gradient collectives per K micro-batches, all units.

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> import torch
            >>> from zeta_fsdp.planner import plan
            >>> with torch.device("meta"): model = small()  # the demo GPT, nothing allocated
            >>> costs = plan(model, world_size=4, shard_strat="HYBRID_SHARD", replicate_size=2).accumulation(3)
            >>> costs["all"].grad_bytes, costs["all_reduce"].grad_bytes, costs["all_reduce"].reduce_scatters
            (139800, 69960, 12)
        """
        k = micro_batches if micro_batches is not None else (self.micro_batches or 4)
        return engine_named(self.engine).plan_accumulation(self, k)

    @property
    def dry_run_matches(self) -> Optional[bool]:
        """``True``/``False`` once a dry run is attached: do its parameter bytes equal the plan's?

        ``None`` without a dry run (``plan(..., dry_run=False)``, the default).

        Example:
            plan(model, world_size=8, dry_run=True).dry_run_matches
            # -> True
        """
        if self.dry_run is None:
            return None
        return (self.dry_run.param_bytes, self.dry_run.local_param_bytes) == (self.param_bytes, self.local_param_bytes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: every figure in bytes, totals included.

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> import torch
            >>> from zeta_fsdp.planner import plan
            >>> with torch.device("meta"): model = small()  # the demo GPT, nothing allocated
            >>> data = plan(model, world_size=2).to_dict()
            >>> data["param_bytes"], data["total_bytes"], data["dry_run"]
            (69960, 375508, None)
        """
        data = asdict(self)
        totals = ("shard_size", "numel", "param_bytes", "local_param_bytes", "grad_bytes", "optimizer_bytes")
        data.update({name: getattr(self, name) for name in (*totals, "total_bytes", "dry_run_matches")})
        return data

    def report(self) -> str:
        """A printable report: the job, one row per unit (identical blocks folded), per-rank totals.

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> import torch
            >>> from zeta_fsdp.planner import plan
            >>> with torch.device("meta"): model = small()  # the demo GPT, nothing allocated
            >>> print(plan(model, world_size=2).report())  # doctest: +ELLIPSIS
            GPT: 34,950 parameters (136.52 KiB unsharded)
            FULL_SHARD on 2 ranks: mesh 2 (parameters sharded over 2), mp=fp32 (no casting), optimizer=adamw
            ...
        """
        lines = [*self._job_lines(), "", *self._unit_table().splitlines(), "", *self._total_lines()]
        if self.micro_batches:
            lines += ["", *accumulation_table(self.accumulation(), self.micro_batches).splitlines()]
        lines += [f"note: {n}" for n in self.notes]
        if self.dry_run is not None:
            lines += ["", *self._dry_run_lines()]
        return "\n".join(lines)

    def _job_lines(self) -> list[str]:
        """The report's head: the model, the job, the dtypes, whose figures these are."""
        mesh = "x".join(str(s) for s in self.mesh_shape)
        return [
            f"{self.model_name}: {self.numel:,} parameters ({format_bytes(self.model_bytes)} unsharded)",
            f"{self.strategy} on {self.world_size} ranks: mesh {mesh} (parameters sharded over {self.shard_size}), "
            f"mp={self.mp}, optimizer={self.optimizer}",
            f"master weights {self.master_dtype}, optimizer state "
            + (self.optimizer_state_dtype if self.optimizer != "none" else "none"),
            f"per-rank figures for rank {self.rank}"
            + (" (the largest shard: FSDP2 pads dim 0 to ceil(dim0 / shard size) rows)" if self.rank == 0 else ""),
        ]

    def _unit_table(self) -> str:
        """One row per unit; runs of identical consecutive units (the blocks of a transformer): one row each."""
        rows = [("unit", "kind", "params", "numel", "all-gathered", "shard/rank")]
        keys = ("kind", "num_params", "numel", "unsharded_bytes", "param_bytes", "grad_bytes", "optimizer_bytes")
        for _, run in itertools.groupby(self.units, key=lambda u: tuple(getattr(u, k) for k in keys)):
            first, *rest = run
            name = f"{first.name} .. {rest[-1].name} (x{len(rest) + 1})" if rest else first.name
            sizes = (f"{first.numel:,}", format_bytes(first.unsharded_bytes), format_bytes(first.param_bytes))
            rows.append((name, first.kind, str(first.num_params), *sizes))
        return render_table(rows, align="llrrrr")

    def _total_lines(self) -> list[str]:
        """This rank's totals by category."""
        lines = [
            f"  parameters (sharded)        {format_bytes(self.param_bytes):>12}",
            f"  gradients (sharded)         {format_bytes(self.grad_bytes):>12}",
            f"  optimizer state ({self.optimizer:<5})     {format_bytes(self.optimizer_bytes):>12}",
            f"  all-gather peak             {format_bytes(self.allgather_peak_bytes):>12}",
            f"  total, without activations  {format_bytes(self.total_bytes):>12}",
        ]
        if self.ignored_param_names:
            lines.append(f"  ({len(self.ignored_param_names)} ignored parameter(s) kept whole on every rank)")
        return lines

    def _dry_run_lines(self) -> list[str]:
        """What the dry run (the real ``fsdp()`` on a meta copy) found, against the plan."""
        d = self.dry_run
        verdict = "matches the plan" if self.dry_run_matches else "DOES NOT match the plan"
        return [
            f"dry run: real fsdp() on a meta copy, fake process group of {d.world_size} ranks (rank {d.rank}, "
            f"engine={self.engine}, mesh {'x'.join(str(s) for s in d.mesh_shape)}): wrap {d.wrap_seconds:.2f} s, "
            f"{d.num_units} FSDP units",
            f"  sharded parameter bytes on rank {d.rank}: {d.param_bytes:,} (logical {d.local_param_bytes:,}) "
            f"-> {verdict} ({self.param_bytes:,} / {self.local_param_bytes:,})",
        ]
