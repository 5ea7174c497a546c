"""The plan itself: ``WrapUnit`` (one future ``fully_shard`` call) and ``WrapPlan`` (the units, bottom-up),
and how parameters are given to units."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn as nn

from ..report import render_table
from .tree import is_under

__all__ = ["WrapPlan", "WrapUnit", "claiming_unit", "fill_params"]

# Longest group name shown whole in a plan table; longer groups show their first two modules.
_MAX_NAME = 60


@dataclass
class WrapUnit:
    """One future ``fully_shard`` call: the modules it covers and the parameters it will own.

    ``kind``: ``"block"``, ``"embedding"``, ``"head"``, ``"embedding+head"`` (tied) or ``"root"``;
    ``module_names`` (``""`` is the root) and ``modules`` go to ``fully_shard``; ``param_names``: what
    it owns (a tied parameter under its first name); ``nbytes`` at the parameters' current dtypes.

    Example:
        >>> from zeta_fsdp.models.gpt import small
        >>> from zeta_fsdp.wrapping import build_wrap_plan
        >>> unit = build_wrap_plan(small(), auto_wrap=True).units[0]
        >>> unit.name, unit.kind, unit.numel
        ('blocks.0', 'block', 11100)
    """

    kind: str
    module_names: list[str]
    modules: list[nn.Module] = field(repr=False)
    param_names: list[str] = field(default_factory=list)
    numel: int = 0
    nbytes: int = 0
    dtypes: set[torch.dtype] = field(default_factory=set)

    @property
    def name(self) -> str:
        """Readable unit name: the module FQN, ``[a, b]`` for a group, ``<root>`` for the root."""
        names = [n or "<root>" for n in self.module_names]
        if len(names) == 1:
            return names[0]
        joined = ", ".join(names)
        if len(joined) > _MAX_NAME and len(names) > 3:
            # A group of many modules (a big head) stays readable in a table: first two + a count.
            joined = f"{names[0]}, {names[1]}, +{len(names) - 2} more"
        return "[" + joined + "]"

    @property
    def target(self) -> Union[nn.Module, list[nn.Module]]:
        """What to pass to ``fully_shard``: a module, or a list of modules sharing one group."""
        return self.modules[0] if len(self.modules) == 1 else list(self.modules)


@dataclass
class WrapPlan:
    """The FSDP units of a model, bottom-up (root last), plus what the planner found.

    ``scalar_param_names``: 0-dim parameters (CLIP's ``logit_scale``). ``fully_shard`` cannot
    shard a scalar, so ``fsdp()`` keeps them whole on every rank and averages their gradient
    across ranks itself; they are listed in ``ignored_param_names`` too and owned by no unit.
    ``skippable``: modules a forward may skip on some ranks (MoE experts, an optional tower), by
    name with why (``skip_evidence``); neither they nor their members are units.

    Example:
        >>> from zeta_fsdp.models.gpt import small
        >>> from zeta_fsdp.wrapping import build_wrap_plan
        >>> print(build_wrap_plan(small(), auto_wrap=True).table())
        unit                            kind            params   numel   MiB   share
        ------------------------------  --------------  ------  ------  ----  ------
        blocks.0                        block               11  11,100  0.04   31.8%
        blocks.1                        block               11  11,100  0.04   31.8%
        blocks.2                        block               11  11,100  0.04   31.8%
        [tok_emb, pos_emb, norm, head]  embedding+head       4   1,650  0.01    4.7%
        <root>                          root                 0       0  0.00    0.0%
        ------------------------------  --------------  ------  ------  ----  ------
        total                                               37  34,950  0.13  100.0%
        note: largest unit: blocks.0 (block), 31.8% of the parameters
    """

    units: list[WrapUnit]
    block_classes: tuple[type, ...]
    tied_params: list[list[str]]
    ignored_param_names: list[str] = field(default_factory=list)
    scalar_param_names: list[str] = field(default_factory=list)
    # Modules a forward may skip on some ranks (experts of an MoE layer, an optional tower): name -> why.
    skippable: dict[str, str] = field(default_factory=dict)
    # What the planner decided and why, in words (``table()`` prints them).
    notes: list[str] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Total elements the units own (tied parameters counted once).

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> from zeta_fsdp.wrapping import build_wrap_plan
            >>> plan = build_wrap_plan(small(n_layers=2), auto_wrap=True)
            >>> plan.numel == sum(u.numel for u in plan.units)
            True
        """
        return sum(u.numel for u in self.units)

    @property
    def nbytes(self) -> int:
        """Total bytes the units own (tied parameters counted once).

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> from zeta_fsdp.wrapping import build_wrap_plan
            >>> plan = build_wrap_plan(small(n_layers=2), auto_wrap=True)
            >>> plan.nbytes == 4 * plan.numel  # fp32
            True
        """
        return sum(u.nbytes for u in self.units)

    @property
    def blocks(self) -> list[WrapUnit]:
        """The transformer-block units.

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> from zeta_fsdp.wrapping import build_wrap_plan
            >>> plan = build_wrap_plan(small(n_layers=2), auto_wrap=True)
            >>> [u.name for u in plan.blocks]
            ['blocks.0', 'blocks.1']
        """
        return [u for u in self.units if u.kind == "block"]

    @property
    def forward_order(self) -> list[WrapUnit]:
        """The non-root units in the order forward first uses them: embeddings (a tied ``embedding+head``
        unit too: its embedding runs first), the blocks in registration order (as a ``ModuleList`` or
        ``nn.Sequential`` of blocks runs them; encoder blocks before decoder blocks), the head.

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> from zeta_fsdp.wrapping import build_wrap_plan
            >>> [u.name for u in build_wrap_plan(small(n_layers=2), auto_wrap=True).forward_order]
            ['[tok_emb, pos_emb, norm, head]', 'blocks.0', 'blocks.1']
        """
        first = [u for u in self.units if u.kind in ("embedding", "embedding+head")]
        return first + self.blocks + [u for u in self.units if u.kind == "head"]

    @property
    def backward_order(self) -> list[WrapUnit]:
        """The non-root units in the order backward first uses them: the head (a tied
        ``embedding+head`` unit too: its head's gradient comes first), the blocks reversed, the embeddings.

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> from zeta_fsdp.wrapping import build_wrap_plan
            >>> [u.name for u in build_wrap_plan(small(n_layers=2), auto_wrap=True).backward_order]
            ['[tok_emb, pos_emb, norm, head]', 'blocks.1', 'blocks.0']
        """
        first = [u for u in self.units if u.kind in ("head", "embedding+head")]
        return first + self.blocks[::-1] + [u for u in self.units if u.kind == "embedding"]

    def recount(self, model: nn.Module) -> None:
        """Refresh each unit's ``nbytes`` and ``dtypes`` from ``model``'s parameters as they are now.

        ``fsdp()`` calls it after casting the parameters to the master dtype, so the plan it keeps
        (``get_wrap_plan``) shows what was sharded.

        Example:
            plan = build_wrap_plan(model.bfloat16())
            plan.recount(model.float())
        """
        params = dict(model.named_parameters())
        for unit in self.units:
            unit.nbytes = sum(params[n].numel() * params[n].element_size() for n in unit.param_names)
            unit.dtypes = {params[n].dtype for n in unit.param_names}

    @property
    def largest(self) -> Optional[WrapUnit]:
        """The unit owning the most elements (``None`` for a model without parameters).

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> from zeta_fsdp.wrapping import build_wrap_plan
            >>> plan = build_wrap_plan(small(n_layers=2), auto_wrap=True)
            >>> plan.largest.numel == max(u.numel for u in plan.units)
            True
        """
        return max(self.units, key=lambda u: u.numel) if self.numel else None

    def share(self, unit: WrapUnit) -> float:
        """The fraction of all (unit-owned) parameter elements ``unit`` owns.

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> from zeta_fsdp.wrapping import build_wrap_plan
            >>> plan = build_wrap_plan(small(n_layers=2), auto_wrap=True)
            >>> round(sum(plan.share(u) for u in plan.units), 6)
            1.0
        """
        return unit.numel / self.numel if self.numel else 0.0

    def table(self) -> str:
        """A fixed-width table: one row per unit with its kind, parameter count, bytes and share of
        the parameters, then the largest unit; when a unit holds more than a quarter of the
        parameters, what to pass as ``TransformerBlock`` to split it (when there is something).

        Example:
            >>> from zeta_fsdp.models.gpt import small
            >>> from zeta_fsdp.wrapping import build_wrap_plan
            >>> plan = build_wrap_plan(small(n_layers=2), auto_wrap=True)
            >>> plan.table().splitlines()[0].split()
            ['unit', 'kind', 'params', 'numel', 'MiB', 'share']
        """
        share = [f"{100 * self.share(u):.1f}%" for u in self.units] + ["100.0%" if self.numel else "-"]
        counts = [(u.name, u.kind, len(u.param_names), u.numel, u.nbytes) for u in self.units]
        counts.append(("total", "", sum(len(u.param_names) for u in self.units), self.numel, self.nbytes))
        rows = [("unit", "kind", "params", "numel", "MiB", "share")]
        for (name, kind, params, numel, nbytes), pct in zip(counts, share):
            rows.append((name, kind, str(params), f"{numel:,}", f"{nbytes / 2**20:.2f}", pct))
        lines = render_table(rows, align="llrrrr", rules=(0, -2), max_width=60).splitlines()
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def claiming_unit(module_name: str, units: list[WrapUnit]) -> int:
    """Index of the first (innermost) unit whose subtree holds ``module_name`` (the root, last, holds all)."""
    return next(i for i, unit in enumerate(units) if is_under(module_name, unit.module_names))


def fill_params(units: list[WrapUnit], model: nn.Module, ignored: set[int]) -> tuple[list[str], list[str]]:
    """Give each parameter to its unit (bytes: ``WrapPlan.recount``); returns (ignored names, 0-dim ones among them)."""
    ignored_names, scalar_names = [], []
    for name, param in model.named_parameters():  # a tied parameter once, under its first name
        if id(param) in ignored or param.dim() == 0:
            ignored_names.append(name)
            if param.dim() == 0 and id(param) not in ignored:
                scalar_names.append(name)
            continue
        unit = units[claiming_unit(name.rpartition(".")[0], units)]
        unit.param_names.append(name)
        unit.numel += param.numel()
    return ignored_names, scalar_names
