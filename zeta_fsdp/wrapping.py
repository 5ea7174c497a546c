"""Which modules become FSDP units: a pure, inspectable plan (no process group, no allocation).

The plan is formed bottom-up, the order ``fully_shard`` must be called in: every transformer
block, then the input embeddings, then ``[final norm, output head]``, then the root. Parameters
shared between modules (an embedding tied to the output head) always land in one unit, because
FSDP2 only keeps a tie when every module holding the parameter is sharded by the same call.

Works on ``meta`` models, so it can describe a model too large to build for real.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.nn as nn

from .always_run import always_run, modality_towers
from .report import render_table
from .ties import tied_parameter_groups

__all__ = ["BlockSpec", "WrapPlan", "WrapUnit", "block_specs", "build_wrap_plan", "detect_block_classes"]
__all__ += ["skippable_modules"]

BlockSpec = Union[type, str, Sequence[Union[type, str]], None]

# Longest group name shown whole in a plan table; longer groups show their first two modules.
_MAX_NAME = 60
# A unit holding more than this share of the parameters is worth naming a block class to split.
_LARGE_SHARE = 0.25


@dataclass
class WrapUnit:
    """One future ``fully_shard`` call: the modules it covers and the parameters it will own.

    ``kind``: ``"block"``, ``"embedding"``, ``"head"``, ``"embedding+head"`` (tied) or ``"root"``;
    ``module_names`` (``""`` is the root) and ``modules`` go to ``fully_shard``; ``param_names``: what
    it owns (a tied parameter under its first name); ``nbytes`` at the parameters' current dtypes.

    Example:
        >>> from zeta_fsdp.models.gpt import small
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
    ``skippable``: containers whose members a forward may skip on some ranks (MoE experts), by
    name with why (``skippable_modules``); their members are never units. ``unproven``: blocks
    that are not units because no forward provably runs them on every call (``always_run``:
    a helper function dispatching experts, an optional tower, a source that cannot be read).

    Example:
        >>> from zeta_fsdp.models.gpt import small
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
    # Containers a forward may skip on some ranks (experts of an MoE layer): name -> why.
    skippable: dict[str, str] = field(default_factory=dict)
    # Block instances left out of the units as no forward provably runs them every step: name -> why.
    unproven: dict[str, str] = field(default_factory=dict)
    # What the planner decided and why, in words (``table()`` prints them).
    notes: list[str] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Total elements the units own (tied parameters counted once).

        Example:
            >>> from zeta_fsdp.models.gpt import small
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
            >>> plan = build_wrap_plan(small(n_layers=2), auto_wrap=True)
            >>> plan.largest.numel == max(u.numel for u in plan.units)
            True
        """
        return max(self.units, key=lambda u: u.numel) if self.numel else None

    def share(self, unit: WrapUnit) -> float:
        """The fraction of all (unit-owned) parameter elements ``unit`` owns.

        Example:
            >>> from zeta_fsdp.models.gpt import small
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


def block_specs(transformer_block: BlockSpec, caller: str) -> list[Union[type, str]]:
    """``TransformerBlock`` as a list of classes / class names; ``ValueError`` (naming ``caller``) when malformed."""
    specs = (
        list(transformer_block) if isinstance(transformer_block, (tuple, list, set, frozenset)) else [transformer_block]
    )
    for spec in specs:
        if not (isinstance(spec, str) or (isinstance(spec, type) and issubclass(spec, nn.Module))):
            raise ValueError(
                f"{caller}(): TransformerBlock={transformer_block!r} is not accepted. Accepted: an "
                "nn.Module subclass, a class name string, or a tuple of those."
            )
    return specs


def _resolve_block_classes(model: nn.Module, specs: list[Union[type, str]], caller: str) -> tuple[type, ...]:
    """Map each spec to the module classes present in ``model``; a spec matching nothing is an error."""
    present = {type(m) for _, m in model.named_modules() if m is not model}
    classes: list[type] = []
    for spec in specs:
        if isinstance(spec, str):
            found = [c for c in present if spec in (c.__name__, c.__qualname__, f"{c.__module__}.{c.__qualname__}")]
        else:
            found = [c for c in present if issubclass(c, spec)]
        if not found:
            shown = sorted({c.__name__ for c in present})
            name = spec if isinstance(spec, str) else spec.__name__
            raise ValueError(
                f"{caller}(): TransformerBlock={name!r} matches no submodule of {type(model).__name__}. "
                f"Module classes present: {', '.join(shown[:40])}{' ...' if len(shown) > 40 else ''}."
            )
        classes.extend(c for c in found if c not in classes)
    return tuple(classes)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# Modules whose weight is a matrix or kernel: the layers a block is made of.
_WEIGHT_LAYERS = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding, nn.MultiheadAttention)
# "b1", "layer_2", "s10": a name followed by an index, as hand-unrolled stacks name their blocks.
_INDEXED = re.compile(r"^(.*?)_?(\d+)$")


def _is_layer_like(module: nn.Module) -> bool:
    """At most one weight layer inside: a layer (``ConvNormAct``, a per-head projection, PEFT's
    ``lora.Linear`` wrapping one frozen layer), not a block made of layers."""
    if any(c.__name__ == "BaseTunerLayer" for c in type(module).__mro__):
        return True  # PEFT's adapter wrapper around one layer (lazily: peft is never imported here)
    return sum(1 for m in module.modules() if isinstance(m, _WEIGHT_LAYERS)) <= 1


def _chain(container: nn.Module, flattened: set[int]) -> list[nn.Module]:
    """The children of a container, with nested ``nn.Sequential``s (stages of blocks) flattened
    (their ids are added to ``flattened``)."""
    items: list[nn.Module] = []
    for child in container.children():
        if isinstance(child, nn.Sequential):
            flattened.add(id(child))
            items.extend(_chain(child, flattened))
        else:
            items.append(child)
    return items


def _repeated_blocks(items: list[nn.Module]) -> Counter:
    """The block classes (more than one weight layer) among ``items`` that occur twice or more."""
    kinds = Counter(type(m) for m in items if not isinstance(m, _CONTAINERS))
    return Counter(
        {c: n for c, n in kinds.items() if n > 1 and not _is_layer_like(next(m for m in items if type(m) is c))}
    )


def _repeated_children(model: nn.Module) -> Counter:
    """Classes repeated in a row, with their instance counts (the layouts: ``detect_block_classes``).

    In a mixed chain (a ``Sequential`` of stages, EfficientNet's blocks) and among named attributes
    (RegNet's ``b1 .. bN``) only blocks count (more than one weight layer): a heterogeneous chain of
    layers is an MLP (``Linear, GELU, Linear``). A one-child ``nn.Sequential`` is a wrapper.
    """
    counts: Counter = Counter()
    flattened: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Sequential) and id(module) in flattened:
            continue  # already counted as part of the chain that holds it
        if isinstance(module, _CONTAINERS):
            items = _chain(module, flattened) if isinstance(module, nn.Sequential) else list(module.children())
            items = [m for m in items if not isinstance(m, _CONTAINERS)]
            if isinstance(module, nn.Sequential) and len(items) < 2:
                continue
            kinds = Counter(type(m) for m in items)
            counts += kinds if len(kinds) == 1 else _repeated_blocks(items)
            continue
        groups: dict[tuple[str, type], list[nn.Module]] = {}
        for name, child in module.named_children():
            indexed = _INDEXED.match(name)
            if indexed and any(True for _ in child.parameters()):
                groups.setdefault((indexed.group(1), type(child)), []).append(child)
        for (_, cls), members in groups.items():
            if issubclass(cls, nn.Sequential) and len(members) > 1:
                # ResNet's layer1 .. layer4: stages as named Sequentials, one chain of blocks together
                counts += _repeated_blocks([m for seq in members for m in _chain(seq, set())])
            elif len(members) > 1 and not issubclass(cls, _CONTAINERS) and not _is_layer_like(members[0]):
                counts[cls] += len(members)
    return counts


def _innermost(model: nn.Module, candidates: list[type]) -> tuple[list[type], list[type]]:
    """(blocks, stages): the candidates minus what blocks are made of and the stages holding them.

    A layer-like class (per-head projections, ``ConvNormAct``) whose every instance sits inside another
    candidate is a sub-layer; a class whose every instance holds a block is a stage (Swin/ConvNeXt
    stages, RegNet's ``s1 .. s4``): what it holds besides blocks goes to the enclosing unit.
    """
    modules = list(model.modules())
    first: dict[type, nn.Module] = {}
    for module in modules:
        first.setdefault(type(module), module)
    layer_like = {c for c in candidates if _is_layer_like(first[c])}

    def inside_another_candidate(cls: type) -> bool:
        inner: set[int] = set()
        for outer in modules:
            if isinstance(outer, tuple(candidates)) and type(outer) is not cls:
                inner.update(id(m) for m in outer.modules() if m is not outer)
        return all(id(m) in inner for m in modules if type(m) is cls)

    kept = [c for c in candidates if not (c in layer_like and inside_another_candidate(c))]
    # only a block (more than one weight layer) makes its holder a stage: a repeated plain layer
    # elsewhere in the model (a ModuleList of Linears) says nothing about the blocks holding Linears
    blocks = [c for c in kept if c not in layer_like]
    stages = []
    for cls in kept:
        others = tuple(c for c in blocks if c is not cls)
        instances = [m for m in modules if type(m) is cls]
        if others and all(any(isinstance(m, others) for m in inst.modules() if m is not inst) for inst in instances):
            stages.append(cls)
    return [c for c in kept if c not in stages], stages


# A container of this name holds the experts of a mixture-of-experts layer: a router picks a few per token.
_EXPERTS = re.compile(r"expert", re.IGNORECASE)


@functools.cache
def _forward_tree(cls: type) -> Optional[ast.AST]:
    """The parsed source of ``cls.forward`` (``None`` when there is none to read: a builtin, a REPL class)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError, AttributeError):
        return None


def _reads_self(node: ast.AST, attr: str) -> bool:
    """``node`` reads ``self.<attr>`` somewhere inside."""
    return any(
        isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name) and n.value.id == "self"
        for n in ast.walk(node)
    )


def _member_uses(loop: ast.For, attr: str) -> list[ast.AST]:
    """Where ``loop``'s body runs a member of ``self.<attr>``: a call of (or passing) the loop's element
    when the loop walks the container, and ``self.<attr>[i]`` (not a slice) in any loop."""
    body = [n for stmt in loop.body for n in ast.walk(stmt)]
    called = {n.func.id for n in body if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)} if _reads_self(loop.iter, attr) else set()
    elements = names & called
    uses: list[ast.AST] = []
    for n in body:
        if isinstance(n, ast.Subscript) and _reads_self(n.value, attr) and not isinstance(n.slice, ast.Slice):
            uses.append(n)
        elif isinstance(n, ast.Call) and any(
            isinstance(a, ast.Name) and a.id in elements for arg in [n.func, *n.args] for a in ast.walk(arg)
        ):
            uses.append(n)
    return uses


def _per_member_names(loop: ast.For) -> set[str]:
    """The loop's target names and the names its body computes from them (``mask = route == i``)."""
    names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    assigns = [n for stmt in loop.body for n in ast.walk(stmt) if isinstance(n, (ast.Assign, ast.AugAssign))]
    for _ in range(3):  # a short chain of assignments is enough for the dispatch loops seen
        for a in assigns:
            if any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(a.value)):
                targets = a.targets if isinstance(a, ast.Assign) else [a.target]
                names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _guarded(loop: ast.For, use: ast.AST, uses: list[ast.AST]) -> bool:
    """``use`` runs only under a per-member condition inside ``loop`` (one that reads the member's
    index or what the body computes from it, as a router's mask; not LayerDrop's coin): in one branch
    of an ``if`` whose other branch runs no member (of ``uses``), or after an ``if ...: continue``."""
    per_member = _per_member_names(loop)
    for node in ast.walk(loop):
        if not isinstance(node, (ast.If, ast.IfExp)) or node is loop:
            continue
        if not any(isinstance(n, ast.Name) and n.id in per_member for n in ast.walk(node.test)):
            continue
        branches = (node.body, node.orelse) if isinstance(node, ast.If) else ([node.body], [node.orelse])
        runs = [{id(n) for s in b for n in ast.walk(s)} for b in branches]
        if any(id(use) in r for r in runs) and not all(any(id(u) in r for u in uses) for r in runs):
            return True
        skips = isinstance(node, ast.If) and any(isinstance(n, ast.Continue) for s in node.body for n in ast.walk(s))
        if skips and node.lineno < use.lineno:
            return True
    return False


def _runs_conditionally(cls: type, attr: str) -> bool:
    """Whether ``cls.forward`` may skip members of ``self.<attr>``: every call of one sits under a
    condition in its loop, or picks it by index in a loop over something other than ``range(...)``
    or the container itself (the experts a router hit)."""
    tree = _forward_tree(cls)
    for loop in (n for n in ast.walk(tree) if isinstance(n, ast.For)) if tree is not None else ():
        uses = _member_uses(loop, attr)
        if not uses:
            continue
        by_range = isinstance(loop.iter, ast.Call) and getattr(loop.iter.func, "id", None) == "range"
        picked = not by_range and not _reads_self(loop.iter, attr) and any(isinstance(u, ast.Subscript) for u in uses)
        if picked or all(_guarded(loop, u, uses) for u in uses):
            return True
    return False


def skippable_modules(model: nn.Module) -> dict[str, str]:
    """The ``nn.ModuleList`` / ``nn.ModuleDict`` containers whose members a forward may skip on some
    ranks (the experts of a mixture-of-experts layer), by name, with why in words.

    A member skipped on one rank would not join its own unit's collectives there, so such members
    never become units: the module holding them (the MoE layer) is the unit.

    Example:
        >>> class MoE(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ffns = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
        ...     def forward(self, x, route):
        ...         for i, ffn in enumerate(self.ffns):
        ...             if (route == i).any():
        ...                 x = x + ffn(x)
        ...         return x
        >>> skippable_modules(MoE())
        {'ffns': 'MoE.forward runs its members under a condition'}
    """
    found: dict[str, str] = {}
    for owner_name, owner in model.named_modules():
        for name, child in owner.named_children():
            if not isinstance(child, (nn.ModuleList, nn.ModuleDict)) or len(child) < 2:
                continue
            path = f"{owner_name}.{name}" if owner_name else name
            if _runs_conditionally(type(owner), name):
                found[path] = f"{type(owner).__name__}.forward runs its members under a condition"
            elif _EXPERTS.search(name):
                found[path] = f"named {name!r}: the experts a router picks per token"
    return found


def _declared_blocks(model: nn.Module) -> list[type]:
    """The classes a Hugging Face model names in ``_no_split_modules`` that it holds."""
    no_split = getattr(model, "_no_split_modules", None) or ()
    return sorted({type(m) for m in model.modules() if type(m).__name__ in no_split}, key=lambda c: c.__name__)


def _members_of(model: nn.Module, containers: Iterable[str]) -> set[int]:
    """Ids of every module inside the named containers (the containers themselves excluded)."""
    return {
        id(m) for name in containers for m in model.get_submodule(name).modules() if m is not model.get_submodule(name)
    }


def _detect(model: nn.Module) -> tuple[tuple[type, ...], list[type]]:
    """(block classes, stage classes passed over for the blocks they hold). A class found only among
    members a forward may skip (experts), or that no forward provably runs, is no block: the layer
    holding them is."""
    named = _declared_blocks(model)
    if named:
        return tuple(named), []
    counts = _repeated_children(model)
    skipped = _members_of(model, skippable_modules(model)) | _unproven_ids(model) if counts else set()
    candidates = [
        cls for cls, _ in counts.most_common() if not all(id(m) in skipped for m in model.modules() if type(m) is cls)
    ]
    if not candidates:
        return (), []
    blocks, stages = _innermost(model, candidates)
    return tuple(blocks), stages


def detect_block_classes(model: nn.Module) -> tuple[type, ...]:
    """Guess the transformer-block classes of ``model``.

    A Hugging Face model's ``_no_split_modules`` wins. Otherwise the classes repeated in a row:
    the children of an ``nn.ModuleList``, ``nn.ModuleDict`` (torchtitan's Llama) or
    ``nn.Sequential`` (timm's ``self.blocks``), repeated named attributes (timm RegNet's
    ``b1 .. bN``), ``nn.Transformer``'s encoder AND decoder layers. In a nested model the
    innermost repeated block wins over the stage holding it (Swin, ConvNeXt, EfficientNet), and a
    repeated layer inside a block (per-head projections) is a sub-layer, not a block.
    ``nn.Sequential`` / ``nn.ModuleList`` / ``nn.ModuleDict`` are never block classes. Returns
    ``()`` when nothing looks like a block, and a class no forward provably runs on every call
    (``always_run``; a class without ``forward`` above it) is none.

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.layers = nn.ModuleDict({str(i): nn.Linear(2, 2) for i in range(3)})
        ...     def forward(self, x):
        ...         for layer in self.layers.values():
        ...             x = layer(x)
        ...         return x
        >>> detect_block_classes(Net())
        (<class 'torch.nn.modules.linear.Linear'>,)
    """
    return _detect(model)[0]


def _split_suggestion(model: nn.Module, unit: WrapUnit, skipped: set[int]) -> list[type]:
    """Block-like classes repeated among the modules whose parameters ``unit`` owns, biggest first:
    what ``TransformerBlock`` could name to split it (never members a forward may skip)."""
    owned = set(unit.param_names)
    numel: Counter = Counter()
    count: Counter = Counter()
    for name, m in model.named_modules():
        if m is model or isinstance(m, _CONTAINERS) or _is_layer_like(m) or id(m) in skipped:
            continue
        names = [f"{name}.{n}" for n, _ in m.named_parameters()]
        if names and all(n in owned for n in names):
            count[type(m)] += 1
            numel[type(m)] += sum(p.numel() for p in m.parameters())
    return [c for c, _ in numel.most_common() if count[c] > 1]


def _find_blocks(model: nn.Module, classes: tuple[type, ...], prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every instance of ``classes`` below ``model``, children before parents."""
    found = []
    for name, child in model.named_children():
        path = f"{prefix}.{name}" if prefix else name
        found += _find_blocks(child, classes, path)
        if classes and isinstance(child, classes):
            found.append((path, child))
    return found


def _is_under(name: str, prefixes: Iterable[str]) -> bool:
    """``name`` is one of ``prefixes`` or inside one (``""``, the root, holds every name)."""
    return any(p == "" or name == p or name.startswith(p + ".") for p in prefixes)


def _embedding_and_head_modules(
    model: nn.Module, blocks: list[tuple[str, nn.Module]]
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """Input embeddings (``nn.Embedding`` outside blocks) and the "head": every module holding parameters itself
    registered after the last block (the final norm, the output projection), when one of them is an
    ``nn.Linear`` or the model's declared output embedding."""
    block_names = [n for n, _ in blocks]
    ordered = [(n, m) for n, m in model.named_modules() if m is not model]
    position = {n: i for i, (n, _) in enumerate(ordered)}
    last_block = max(position[n] for n in block_names)
    embeddings = [(n, m) for n, m in ordered if isinstance(m, nn.Embedding) and not _is_under(n, block_names)]
    output_embedding = getattr(model, "get_output_embeddings", lambda: None)()
    tail = [
        (n, m)
        for n, m in ordered
        if position[n] > last_block
        and not _is_under(n, block_names)
        and any(True for _ in m.parameters(recurse=False))
        and not isinstance(m, nn.Embedding)
    ]
    if not any(isinstance(m, nn.Linear) or m is output_embedding for _, m in tail):
        tail = []
    return embeddings, tail


def _claiming_unit(module_name: str, units: list[WrapUnit]) -> int:
    """Index of the first (innermost) unit whose subtree holds ``module_name`` (the root, last, holds all)."""
    return next(i for i, unit in enumerate(units) if _is_under(module_name, unit.module_names))


def _resolve_ties(
    units: list[WrapUnit], tied: list[list[str]], singletons: set[str], caller: str = "fsdp"
) -> list[WrapUnit]:
    """Merge or drop units so that every tied parameter's holders fall in a single unit.

    ``singletons``: block units of a class occurring once, like the ``*Embeddings`` Hugging Face lists in
    ``_no_split_modules`` (BERT): tied to the head, they merge into one ``embedding+head`` unit rather
    than both falling back into the root (the largest tensor unsharded through the step).
    """
    while True:
        claims = (sorted({_claiming_unit(n.rpartition(".")[0], units) for n in names}) for names in tied)
        conflict = next((c for c in claims if len(c) > 1), None)
        if conflict is None:
            return units
        mergeable = all(  # (never the root)
            units[i].kind in ("embedding", "head", "embedding+head")
            or (units[i].kind == "block" and units[i].module_names[0] in singletons)
            for i in conflict
        )
        if mergeable and len(conflict) == 2:
            a, b = (units[i] for i in conflict)
            merged = WrapUnit("embedding+head", a.module_names + b.module_names, a.modules + b.modules)
            keep = [u for i, u in enumerate(units) if i not in conflict]
            units = keep[:-1] + [merged] + keep[-1:]
            continue
        dropped = [units[i] for i in conflict if units[i].kind != "root"]
        warnings.warn(
            f"{caller}(): parameters tied across "
            + ", ".join(u.name for u in dropped)
            + " cannot be split into separate FSDP units; those modules are sharded with their parent instead.",
            stacklevel=3,
        )
        units = [u for u in units if u not in dropped]


def _fill_params(units: list[WrapUnit], model: nn.Module, ignored: set[int]) -> tuple[list[str], list[str]]:
    """Give each parameter to its unit (bytes: ``WrapPlan.recount``); returns (ignored names, 0-dim ones among them)."""
    ignored_names, scalar_names = [], []
    for name, param in model.named_parameters():  # a tied parameter once, under its first name
        if id(param) in ignored or param.dim() == 0:
            ignored_names.append(name)
            if param.dim() == 0 and id(param) not in ignored:
                scalar_names.append(name)
            continue
        unit = units[_claiming_unit(name.rpartition(".")[0], units)]
        unit.param_names.append(name)
        unit.numel += param.numel()
    return ignored_names, scalar_names


def _runnable_blocks(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    skippable: dict[str, str],
    *,
    given: bool,
    declared: bool,
    caller: str,
) -> list[tuple[str, nn.Module]]:
    """``blocks`` without the members a forward may skip: a unit one rank skips would not join its
    all-gather and reduce-scatter there (the ranks' collectives no longer line up: wrong gradients or
    a hang). A ``TransformerBlock`` the user named is refused; blocks a Hugging Face model declares
    (``_no_split_modules``) stay, as LayerDrop skips them only when ``config.layerdrop > 0``."""
    skipped = _members_of(model, skippable)
    if declared:
        return blocks
    bad = [name for name, module in blocks if id(module) in skipped]
    if bad and given:
        holder = next(c for c in skippable if _is_under(bad[0], [c]))
        raise ValueError(
            f"{caller}(): TransformerBlock makes {bad[0]} an FSDP unit, but a forward may skip it on some ranks "
            f"({holder}: {skippable[holder]}). A rank whose tokens skip it would not join its unit's collectives: "
            "wrong gradients or a hang. Name the class of the layer that holds it (the MoE layer or block) instead."
        )
    return [(name, module) for name, module in blocks if id(module) not in skipped]


def _is_hugging_face(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (by name: transformers is never imported here)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)


def _unproven_ids(model: nn.Module) -> set[int]:
    """Ids of the modules no forward provably runs on every call (``always_run``); none in a Hugging
    Face model, whose repeated layers only LayerDrop skips."""
    if _is_hugging_face(model):
        towers = [model.get_submodule(n) for n in modality_towers(model)]
        return {id(m) for tower in towers for m in tower.modules()}
    proven, _ = always_run(model)
    return {id(m) for m in model.modules() if id(m) not in proven}


def _proven_blocks(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], *, given: bool, caller: str
) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    """(the blocks whose forward provably runs on every forward of ``model``; the others by name, with
    why). A unit one rank skips misses collectives the others join (a hang, or gradients paired with
    the wrong tensors), and no check at run time can come before FSDP2's own all-gather: so a block
    becomes a unit only when ``always_run`` proves it runs, or when the model declares its class in
    ``_no_split_modules`` (Hugging Face models; the user's opt-in). A ``TransformerBlock`` the user
    named that is not proven is refused."""
    if _is_hugging_face(model):  # its layers are skipped only by LayerDrop (docs/pitfalls.md) ...
        towers = {} if given else modality_towers(model)  # ... and its towers, by batches without their input
        unproven = {n: f"{t}: {towers[t]}" for n, _ in blocks for t in towers if _is_under(n, [t])}
        return [(n, m) for n, m in blocks if n not in unproven], unproven
    trusted = tuple(_declared_blocks(model))
    proven, why = always_run(model)
    kept, unproven = [], {}
    for name, module in blocks:
        if id(module) in proven or isinstance(module, trusted):
            kept.append((name, module))
        else:
            top = next((p for p in why if _is_under(name, [p])), name)
            unproven[name] = f"{top}: {why.get(top, 'not called')}"
    if unproven and given:
        name, reason = next(iter(unproven.items()))
        cls = type(model.get_submodule(name)).__name__
        raise ValueError(
            f"{caller}(): TransformerBlock makes {name} an FSDP unit, but its forward may not run on every rank "
            f"in every step ({reason}). A unit one rank skips would not join its collectives there: a hang or "
            "wrong gradients. Name the class of a module that always runs (the layer holding it), or, if every "
            f"rank runs every {cls} in every step (its forward is generated, or a helper calls each one), declare "
            f"it as Hugging Face models do: model._no_split_modules = [{cls!r}]."
        )
    return kept, unproven


def _unproven_note(unproven: dict[str, str]) -> str:
    """The plan table's line on blocks left out as no forward provably runs them (grouped by why)."""
    by_why: dict[str, list[str]] = {}
    for name, why in unproven.items():
        by_why.setdefault(why, []).append(name)
    parts = [
        f"{', '.join(names[:2])}{f' (+{len(names) - 2} more)' if len(names) > 2 else ''} ({why})"
        for why, names in by_why.items()
    ]
    return (
        "not units, as no forward provably runs them on every rank: " + "; ".join(parts) + ". They stay in the "
        "unit of the module holding them; if every rank always runs them, declare their class in "
        "model._no_split_modules"
    )


def _skippable_note(skippable: dict[str, str], declared: bool) -> str:
    """The plan table's line on containers a forward may skip (grouped by why)."""
    by_why: dict[str, list[str]] = {}
    for name, why in skippable.items():
        by_why.setdefault(why, []).append(name)
    parts = [
        f"{', '.join(names[:2])}{f' (+{len(names) - 2} more)' if len(names) > 2 else ''} ({why})"
        for why, names in by_why.items()
    ]
    if declared:
        return (
            "a forward may skip these members: " + "; ".join(parts) + ". Units as the model declares them "
            "(_no_split_modules); a unit one rank skips (LayerDrop with config.layerdrop > 0) would miss its "
            "collectives there: keep layerdrop at 0 under fsdp()"
        )
    return (
        "not units, as ranks may skip them in a step: "
        + "; ".join(parts)
        + ". They stay in the unit of the module holding them (an MoE layer is one unit, not its experts); "
        "their unused parameters reduce zero gradients"
    )


def build_wrap_plan(
    model: nn.Module,
    *,
    auto_wrap: bool = False,
    transformer_block: BlockSpec = None,
    ignored_params: Optional[set[nn.Parameter]] = None,
    caller: str = "fsdp",
) -> WrapPlan:
    """Plan the FSDP units of ``model`` without changing it.

    With ``auto_wrap=False`` the whole model is one unit (Zeta's FSDP1 behaviour without an
    auto-wrap policy). With ``auto_wrap=True`` every block (``transformer_block`` classes, or
    detected ones when it is ``None``) is a unit, then the input embeddings, then the modules after
    the last block (final norm + head), then the root.

    Raises ``ValueError`` when ``transformer_block`` is malformed or matches no submodule; its
    message starts with ``caller`` (the public function the user called: ``fsdp``, ``plan``, ...).

    Example:
        >>> from zeta_fsdp.models.gpt import small
        >>> plan = build_wrap_plan(small(), auto_wrap=True, transformer_block="Block")
        >>> [unit.kind for unit in plan.units]
        ['block', 'block', 'block', 'embedding+head', 'root']
    """
    classes: tuple[type, ...] = ()
    notes: list[str] = []
    if transformer_block is not None:
        specs = block_specs(transformer_block, caller)
        if auto_wrap:
            classes = _resolve_block_classes(model, specs, caller)
        else:
            warnings.warn(
                f"{caller}(): TransformerBlock is only used with auto_wrap=True (as in Zeta's fsdp); "
                "the whole model is one FSDP unit. Pass auto_wrap=True to shard per block.",
                stacklevel=3,
            )
    elif auto_wrap:
        classes, stages = _detect(model)
        if stages:
            held, holders = ", ".join(c.__name__ for c in classes), ", ".join(c.__name__ for c in stages)
            notes.append(
                f"blocks: {held}; the stages holding them ({holders}) are not units: what a stage holds besides "
                "its blocks (a downsampling layer) is sharded with the unit around it"
            )
        if not classes:
            warnings.warn(
                f"fsdp(): auto_wrap=True found no repeated block in {type(model).__name__} (no _no_split_modules, "
                "no nn.ModuleList/nn.ModuleDict/nn.Sequential of one class, no b1 .. bN attributes), so the whole "
                "model is ONE FSDP unit: every parameter is gathered at once. Name the block class: fsdp(model, "
                "auto_wrap=True, TransformerBlock=MyBlock) (a class, a tuple of classes, or a class name such as "
                "TransformerBlock='MyBlock').",
                stacklevel=3,
            )

    skippable = skippable_modules(model)
    blocks = _find_blocks(model, classes)
    if auto_wrap and skippable:
        given = transformer_block is not None
        blocks = _runnable_blocks(
            model, blocks, skippable, given=given, declared=not given and bool(_declared_blocks(model)), caller=caller
        )
        notes.append(_skippable_note(skippable, declared=not given and bool(_declared_blocks(model))))
    unproven: dict[str, str] = {}
    if auto_wrap and blocks:
        blocks, unproven = _proven_blocks(model, blocks, given=transformer_block is not None, caller=caller)
        if unproven:
            notes.append(_unproven_note(unproven))
    units = [WrapUnit("block", [name], [module]) for name, module in blocks]
    block_counts = Counter(type(m) for _, m in blocks)
    singletons = {n for n, m in blocks if block_counts[type(m)] == 1}
    skipped_ids = _unproven_ids(model) if blocks else set()
    for kind, group in zip(("embedding", "head"), _embedding_and_head_modules(model, blocks) if blocks else ()):
        group = [(n, m) for n, m in group if id(m) not in skipped_ids]  # an optional tower stays in the root
        if group:
            units.append(WrapUnit(kind, [n for n, _ in group], [m for _, m in group]))
    units.append(WrapUnit("root", [""], [model]))

    tied = tied_parameter_groups(model)
    units = _resolve_ties(units, tied, singletons, caller)
    ignored = {id(p) for p in (ignored_params or ())}
    ignored_names, scalar_names = _fill_params(units, model, ignored)
    # A unit with no parameters would only add hooks and an empty all-gather.
    units = [u for u in units if u.numel > 0 or u.kind == "root"]
    plan = WrapPlan(
        units, classes, tied, ignored_param_names=ignored_names, scalar_param_names=scalar_names, notes=notes
    )
    plan.unproven = unproven
    # Blocks a Hugging Face model declares are skipped only by LayerDrop (off unless configured).
    declared = tuple(_declared_blocks(model))
    plan.skippable = {
        n: why for n, why in skippable.items() if not any(isinstance(m, declared) for m in model.get_submodule(n))
    }
    plan.recount(model)
    largest = plan.largest
    if largest is not None and len(units) > 1:
        share = plan.share(largest)
        notes.append(f"largest unit: {largest.name} ({largest.kind}), {100 * share:.1f}% of the parameters")
        names = (
            [
                c.__name__
                for c in _split_suggestion(model, largest, _members_of(model, skippable) | _unproven_ids(model))[:2]
            ]
            if share > _LARGE_SHARE
            else []
        )
        if names:
            notes.append(
                f"{largest.name} holds more than a quarter of the parameters (all-gathered at once); to "
                f"split it pass TransformerBlock={names[0]!r}" + (f" (or {tuple(names)!r})" if len(names) > 1 else "")
            )
    return plan


def add_fp32_units(plan: WrapPlan, model: nn.Module, fp32_param_names: Sequence[str], caller: str = "fsdp") -> None:
    """Give the fp32 parameters units of their own (kind ``"fp32"``), for torch releases without
    ``MixedPrecisionPolicy.param_dtype_override_fn``: a policy is per unit there.

    Each unit is an outermost module all of whose parameters are fp32, placed just before the unit
    that held it (bottom-up: a unit inside a block is sharded before the block); a module already
    in a group (the final norm of ``[norm, head]``) leaves it. ``ValueError`` when an fp32
    parameter shares its module with parameters that follow ``mp`` (torch >= 2.15 keeps such a
    parameter alone), or is tied across units.
    """
    wanted = set(fp32_param_names)
    if not wanted:
        return
    names = {id(p): n for n, p in model.named_parameters()}
    marked = {n for n, p in model.named_parameters() if n in wanted}
    full = {}  # module name -> every parameter under it is fp32
    for mname, module in model.named_modules():
        held = [names[id(p)] for p in module.parameters()]
        full[mname] = bool(held) and all(n in marked for n in held) and not isinstance(module, _CONTAINERS[:2])
    chosen = [m for m in full if full[m] and m and not any(full[o] for o in _parents(m))]
    stray = [n for n in marked if not any(_is_under(n.rpartition(".")[0], [m]) for m in chosen)]
    if stray:
        owner = stray[0].rpartition(".")[0] or "<root>"
        raise ValueError(
            f"{caller}(): {stray[0]} must stay fp32 but its module {owner} also holds parameters that follow mp. "
            "This torch has no MixedPrecisionPolicy.param_dtype_override_fn (torch >= 2.15 keeps one parameter "
            f"fp32 inside a unit): upgrade torch, or keep the whole module fp32 (keep_fp32=[{owner!r}])."
        )
    for group in _tied_module_groups(model, chosen):  # tied modules (embedding and head) share one unit
        for unit in plan.units:  # a module named in a group (the final norm of [norm, head]) leaves it
            if unit.kind != "root" and any(m in unit.module_names for m in group):
                keep = [i for i, n in enumerate(unit.module_names) if n not in group]
                unit.module_names = [unit.module_names[i] for i in keep]
                unit.modules = [unit.modules[i] for i in keep]
        units = [u for u in plan.units if u.module_names]
        at = min(_claiming_unit(m, units) for m in group)
        units.insert(at, WrapUnit("fp32", list(group), [model.get_submodule(m) for m in group]))
        plan.units = units
    for unit in plan.units:
        unit.param_names, unit.numel = [], 0
    _fill_params(plan.units, model, {id(model.get_parameter(n)) for n in plan.ignored_param_names})
    plan.units = [u for u in plan.units if u.numel > 0 or u.kind == "root"]
    for names_tied in plan.tied_params:
        if len({_claiming_unit(n.rpartition(".")[0], plan.units) for n in names_tied}) > 1:
            raise ValueError(
                f"{caller}(): the fp32 module holding {names_tied[0]} shares it with {names_tied[1:]} (tied) in "
                "another unit; keep every module holding it fp32 (keep_fp32=[...] naming each), or upgrade to "
                "torch >= 2.15."
            )
    plan.recount(model)
    plan.notes.append(f"fp32 units (own fp32 MixedPrecisionPolicy): {', '.join(chosen)}")


def _tied_module_groups(model: nn.Module, module_names: Sequence[str]) -> list[list[str]]:
    """``module_names`` grouped so that modules sharing a parameter (a tied embedding and head) are together."""
    groups: list[tuple[list[str], set[int]]] = []
    for name in module_names:
        ids = {id(p) for p in model.get_submodule(name).parameters()}
        joined = [g for g in groups if g[1] & ids]
        merged = ([n for g in joined for n in g[0]] + [name], set().union(ids, *(g[1] for g in joined)))
        groups = [g for g in groups if not g[1] & ids] + [merged]
    return [names for names, _ in groups]


def _parents(name: str) -> list[str]:
    """``a.b.c`` -> ``["", "a", "a.b"]``."""
    parts = name.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))]
