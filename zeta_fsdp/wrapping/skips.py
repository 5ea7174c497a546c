"""Which modules a forward may not run on every rank in a step: members a forward runs under a
condition (the experts of an MoE layer), blocks no forward provably runs (``always_run``). Such
modules never become units: a unit one rank skips would miss its collectives there."""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from typing import Optional

import torch.nn as nn

from ..always_run import always_run, modality_towers
from .tree import declared_blocks, is_hugging_face, is_under, members_of

__all__ = ["proven_blocks", "runnable_blocks", "skippable_modules", "skippable_note", "unproven_ids", "unproven_note"]

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


def unproven_ids(model: nn.Module) -> set[int]:
    """Ids of the modules no forward provably runs on every call (``always_run``); none in a Hugging
    Face model, whose repeated layers only LayerDrop skips."""
    if is_hugging_face(model):  # ... but a multimodal language model's towers (modality_towers)
        towers = [model.get_submodule(n) for n in modality_towers(model)]
        return {id(m) for tower in towers for m in tower.modules()}
    proven, _ = always_run(model)
    return {id(m) for m in model.modules() if id(m) not in proven}


def runnable_blocks(
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
    skipped = members_of(model, skippable)
    if declared:
        return blocks
    bad = [name for name, module in blocks if id(module) in skipped]
    if bad and given:
        holder = next(c for c in skippable if is_under(bad[0], [c]))
        raise ValueError(
            f"{caller}(): TransformerBlock makes {bad[0]} an FSDP unit, but a forward may skip it on some ranks "
            f"({holder}: {skippable[holder]}). A rank whose tokens skip it would not join its unit's collectives: "
            "wrong gradients or a hang. Name the class of the layer that holds it (the MoE layer or block) instead."
        )
    return [(name, module) for name, module in blocks if id(module) not in skipped]


def proven_blocks(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], *, given: bool, caller: str
) -> tuple[list[tuple[str, nn.Module]], dict[str, str]]:
    """(the blocks whose forward provably runs on every forward of ``model``; the others by name, with
    why). A unit one rank skips misses collectives the others join (a hang, or gradients paired with
    the wrong tensors), and no check at run time can come before FSDP2's own all-gather: so a block
    becomes a unit only when ``always_run`` proves it runs, or when the model declares its class in
    ``_no_split_modules`` (Hugging Face models; the user's opt-in). A ``TransformerBlock`` the user
    named that is not proven is refused."""
    if is_hugging_face(model):  # its layers are skipped only by LayerDrop (docs/pitfalls.md) ...
        towers = {} if given else modality_towers(model)  # ... and its towers, by batches without their input
        unproven = {n: f"{t}: {towers[t]}" for n, _ in blocks for t in towers if is_under(n, [t])}
        return [(n, m) for n, m in blocks if n not in unproven], unproven
    trusted = tuple(declared_blocks(model))
    proven, why = always_run(model)
    kept, unproven = [], {}
    for name, module in blocks:
        if id(module) in proven or isinstance(module, trusted):
            kept.append((name, module))
        else:
            top = next((p for p in why if is_under(name, [p])), name)
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


def unproven_note(unproven: dict[str, str]) -> str:
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


def skippable_note(skippable: dict[str, str], declared: bool) -> str:
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
