"""``build_wrap_plan``: the units of a model, bottom-up (blocks, embeddings, ``[final norm, head]``,
root), ties resolved into one unit; ``add_fp32_units`` for torch releases without per-parameter dtypes."""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Optional, Sequence

import torch.nn as nn

from ..ties import tied_parameter_groups
from .detect import BlockSpec, block_specs, detect_blocks, resolve_block_classes, split_suggestion
from .plan import WrapPlan, WrapUnit, claiming_unit, fill_params
from .skips import check_layerdrop, runnable_blocks, skip_evidence, skippable_note
from .tree import CONTAINERS, find_blocks, is_under, members_of

__all__ = ["add_fp32_units", "build_wrap_plan"]

# A unit holding more than this share of the parameters is worth naming a block class to split.
_LARGE_SHARE = 0.25


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
    embeddings = [(n, m) for n, m in ordered if isinstance(m, nn.Embedding) and not is_under(n, block_names)]
    output_embedding = getattr(model, "get_output_embeddings", lambda: None)()
    tail = [
        (n, m)
        for n, m in ordered
        if position[n] > last_block
        and not is_under(n, block_names)
        and any(True for _ in m.parameters(recurse=False))
        and not isinstance(m, nn.Embedding)
    ]
    if not any(isinstance(m, nn.Linear) or m is output_embedding for _, m in tail):
        tail = []
    return embeddings, tail


def _resolve_ties(
    units: list[WrapUnit], tied: list[list[str]], singletons: set[str], caller: str = "fsdp"
) -> list[WrapUnit]:
    """Merge or drop units so that every tied parameter's holders fall in a single unit.

    ``singletons``: block units of a class occurring once, like the ``*Embeddings`` Hugging Face lists in
    ``_no_split_modules`` (BERT): tied to the head, they merge into one ``embedding+head`` unit rather
    than both falling back into the root (the largest tensor unsharded through the step).
    """
    while True:
        claims = (sorted({claiming_unit(n.rpartition(".")[0], units) for n in names}) for names in tied)
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
    notes: list[str] = []
    classes = _block_classes(model, auto_wrap, transformer_block, caller, notes)
    skippable = skip_evidence(model, given=transformer_block is not None)
    blocks = find_blocks(model, classes)
    if auto_wrap and skippable:
        blocks = runnable_blocks(model, blocks, skippable, given=transformer_block is not None, caller=caller)
        notes.append(skippable_note(skippable))
    if blocks:
        check_layerdrop(model, caller)
    tied = tied_parameter_groups(model)
    block_counts = Counter(type(m) for _, m in blocks)
    singletons = {n for n, m in blocks if block_counts[type(m)] == 1}
    units = _resolve_ties(_units_of(model, blocks, skippable), tied, singletons, caller)
    ignored_names, scalar_names = fill_params(units, model, {id(p) for p in (ignored_params or ())})
    # A unit with no parameters would only add hooks and an empty all-gather.
    units = [u for u in units if u.numel > 0 or u.kind == "root"]
    plan = WrapPlan(
        units, classes, tied, ignored_param_names=ignored_names, scalar_param_names=scalar_names, notes=notes
    )
    plan.skippable = skippable
    plan.recount(model)
    _note_largest(plan, model, skippable)
    return plan


def _block_classes(
    model: nn.Module, auto_wrap: bool, transformer_block: BlockSpec, caller: str, notes: list[str]
) -> tuple[type, ...]:
    """The block classes: ``transformer_block`` resolved in ``model`` (under ``auto_wrap`` only), else
    detected; a stage passed over for its blocks is noted, finding none warns."""
    if transformer_block is not None:
        specs = block_specs(transformer_block, caller)
        if auto_wrap:
            return resolve_block_classes(model, specs, caller)
        warnings.warn(
            f"{caller}(): TransformerBlock is only used with auto_wrap=True (as in Zeta's fsdp); "
            "the whole model is one FSDP unit. Pass auto_wrap=True to shard per block.",
            stacklevel=4,
        )
        return ()
    if not auto_wrap:
        return ()
    classes, stages = detect_blocks(model)
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
            stacklevel=4,
        )
    return classes


def _units_of(model: nn.Module, blocks: list[tuple[str, nn.Module]], skippable: dict[str, str]) -> list[WrapUnit]:
    """One unit per block, then the embeddings, then ``[final norm, head]`` (with blocks only; a module
    a forward may skip, an optional tower, stays in the root), then the root."""
    units = [WrapUnit("block", [name], [module]) for name, module in blocks]
    skipped_ids = members_of(model, skippable) if blocks else set()
    for kind, group in zip(("embedding", "head"), _embedding_and_head_modules(model, blocks) if blocks else ()):
        group = [(n, m) for n, m in group if id(m) not in skipped_ids]
        if group:
            units.append(WrapUnit(kind, [n for n, _ in group], [m for _, m in group]))
    units.append(WrapUnit("root", [""], [model]))
    return units


def _note_largest(plan: WrapPlan, model: nn.Module, skippable: dict[str, str]) -> None:
    """Note the largest unit; past ``_LARGE_SHARE`` of the parameters, which ``TransformerBlock`` would split it."""
    largest = plan.largest
    if largest is None or len(plan.units) < 2:
        return
    share = plan.share(largest)
    plan.notes.append(f"largest unit: {largest.name} ({largest.kind}), {100 * share:.1f}% of the parameters")
    if share <= _LARGE_SHARE:
        return
    skipped = members_of(model, skippable)
    names = [c.__name__ for c in split_suggestion(model, largest, skipped)[:2]]
    if names:
        plan.notes.append(
            f"{largest.name} holds more than a quarter of the parameters (all-gathered at once); to "
            f"split it pass TransformerBlock={names[0]!r}" + (f" (or {tuple(names)!r})" if len(names) > 1 else "")
        )


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
    chosen = _fp32_modules(model, wanted, caller)
    for group in _tied_module_groups(model, chosen):  # tied modules (embedding and head) share one unit
        _insert_fp32_unit(plan, model, group)
    for unit in plan.units:
        unit.param_names, unit.numel = [], 0
    fill_params(plan.units, model, {id(model.get_parameter(n)) for n in plan.ignored_param_names})
    plan.units = [u for u in plan.units if u.numel > 0 or u.kind == "root"]
    for names_tied in plan.tied_params:
        if len({claiming_unit(n.rpartition(".")[0], plan.units) for n in names_tied}) > 1:
            raise ValueError(
                f"{caller}(): the fp32 module holding {names_tied[0]} shares it with {names_tied[1:]} (tied) in "
                "another unit; keep every module holding it fp32 (keep_fp32=[...] naming each), or upgrade to "
                "torch >= 2.15."
            )
    plan.recount(model)
    plan.notes.append(f"fp32 units (own fp32 MixedPrecisionPolicy): {', '.join(chosen)}")


def _fp32_modules(model: nn.Module, wanted: set[str], caller: str) -> list[str]:
    """The outermost modules all of whose parameters are in ``wanted`` (containers excepted: their children
    are the units); ``ValueError`` for a wanted parameter whose module also holds parameters that follow mp."""
    names = {id(p): n for n, p in model.named_parameters()}
    marked = {n for n, p in model.named_parameters() if n in wanted}
    full = {}  # module name -> every parameter under it is fp32
    for mname, module in model.named_modules():
        held = [names[id(p)] for p in module.parameters()]
        full[mname] = bool(held) and all(n in marked for n in held) and not isinstance(module, CONTAINERS[:2])
    chosen = [m for m in full if full[m] and m and not any(full[o] for o in _parents(m))]
    stray = [n for n in marked if not any(is_under(n.rpartition(".")[0], [m]) for m in chosen)]
    if stray:
        owner = stray[0].rpartition(".")[0] or "<root>"
        raise ValueError(
            f"{caller}(): {stray[0]} must stay fp32 but its module {owner} also holds parameters that follow mp. "
            "This torch has no MixedPrecisionPolicy.param_dtype_override_fn (torch >= 2.15 keeps one parameter "
            f"fp32 inside a unit): upgrade torch, or keep the whole module fp32 (keep_fp32=[{owner!r}])."
        )
    return chosen


def _insert_fp32_unit(plan: WrapPlan, model: nn.Module, group: list[str]) -> None:
    """One fp32 unit for the modules in ``group``, just before the first unit that held one of them (the
    modules leave the units that named them; a unit left empty is dropped)."""
    for unit in plan.units:  # a module named in a group (the final norm of [norm, head]) leaves it
        if unit.kind != "root" and any(m in unit.module_names for m in group):
            keep = [i for i, n in enumerate(unit.module_names) if n not in group]
            unit.module_names = [unit.module_names[i] for i in keep]
            unit.modules = [unit.modules[i] for i in keep]
    units = [u for u in plan.units if u.module_names]
    at = min(claiming_unit(m, units) for m in group)
    units.insert(at, WrapUnit("fp32", list(group), [model.get_submodule(m) for m in group]))
    plan.units = units


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
