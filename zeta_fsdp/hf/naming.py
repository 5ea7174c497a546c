"""Which tensor of a model is which key of a Hugging Face checkpoint: ties and transformers' conversions.

Pure: no file and no process group. Tied weights are stored once, under the name Hugging Face keeps;
transformers 5 fuses some weights in memory (Mixtral's per-expert ``w1``/``w3`` into one
``gate_up_proj``): we use transformers' own conversion mapping, the one ``from_pretrained`` applies,
so every architecture it can load converts the same way here. transformers is imported only for its models.
"""

from __future__ import annotations

import re
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from ..ties import tied_aliases

__all__ = [
    "KeyPlan",
    "is_hf_model",
    "map_checkpoint_keys",
    "saved_layout",
    "saved_tensors",
    "saved_aliases",
]


def is_hf_model(model: Optional[nn.Module]) -> bool:
    """``True`` for a transformers ``PreTrainedModel`` (sharded or not), without importing transformers otherwise."""
    if not any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def saved_aliases(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """``{alias: kept name}`` for every tensor of ``tensors`` (``model.state_dict(keep_vars=True)``: every
    name) reachable under several names: the name Hugging Face keeps (``all_tied_weights_keys``), else the first."""
    keep = dict(getattr(model, "all_tied_weights_keys", None) or {}) if is_hf_model(model) else {}
    return tied_aliases(tensors, keep)


@dataclass
class KeyPlan:
    """Where each model tensor comes from in a checkpoint.

    ``direct``: model key -> checkpoint key. ``converted``: model key -> ``build(read)``, the full tensor
    from ``read(ckpt_key)``. ``shapes``: the full shape each model key gets.
    """

    direct: dict[str, str] = field(default_factory=dict)
    converted: dict[str, Callable[[Callable[[str], torch.Tensor]], torch.Tensor]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


def map_checkpoint_keys(
    model: nn.Module,
    checkpoint: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    wanted: dict[str, tuple[int, ...]],
    aliases: dict[str, str],
) -> KeyPlan:
    """Match checkpoint keys to the model's kept keys (``wanted``: key -> shape), as ``from_pretrained`` would.

    ``checkpoint``: key -> (dtype, shape). A checkpoint key naming a tied alias serves the kept
    name. Keys Hugging Face itself ignores on load (``_keys_to_ignore_on_load_unexpected``/
    ``_missing``, old ``position_ids``/``rotary_emb.inv_freq`` buffers) are not reported.
    """
    plan = KeyPlan()
    known = {k: True for k in list(wanted) + list(aliases)}
    conversion = _conversion(model, checkpoint, known)
    groups = _match_keys(plan, checkpoint, wanted, aliases, conversion)
    for target, (conv, sources) in groups.items():
        build = plan.converted[target] = _converted_tensor(model, target, conv, sources)
        meta = build(lambda k: torch.empty(checkpoint[k][1], dtype=checkpoint[k][0], device="meta"))
        plan.shapes[target] = tuple(meta.shape)
    _drop_ignored(plan, model, wanted)
    return plan


@dataclass
class _Conversion:
    """transformers' key conversion for one model: ``rename(key) -> (target, pattern)`` (``pattern``:
    a ``WeightConverter``'s source pattern, else ``None``), the key order, each pattern's converter."""

    rename: Callable[[str], tuple[str, Optional[str]]]
    order: Callable[[str], Any]
    converters: dict[str, Any]


def _conversion(model: nn.Module, checkpoint: dict, known: dict[str, bool]) -> Optional[_Conversion]:
    """transformers' renamings and converters for ``model``; ``None`` where there are none, or where
    every checkpoint key names a model tensor (its mapping's first build compiles ~900 regexes, most
    of a small model's load time: built only for checkpoints that need it)."""
    if not is_hf_model(model) or all(k in known for k in checkpoint):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not (renamings or converters):
        return None
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> tuple[str, Optional[str]]:
        target, pattern = rename_source_key(key, renamings, converters, prefix, known)
        return (key, None) if target not in known and key in known else (target, pattern)

    return _Conversion(rename, dot_natural_key, {p: c for c in converters for p in c.source_patterns})


def _match_keys(
    plan: KeyPlan,
    checkpoint: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    wanted: dict[str, tuple[int, ...]],
    aliases: dict[str, str],
    conversion: Optional[_Conversion],
) -> dict[str, tuple[Any, list[tuple[str, str]]]]:
    """Fill ``plan``'s direct matches and unexpected keys; returns the converted targets: target ->
    (converter, its ``(checkpoint key, pattern)`` sources)."""
    groups: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    keys = list(checkpoint)
    if conversion is not None:
        keys.sort(key=conversion.order)  # experts 0, 1, ..., 10 in numeric order: the fused tensor's order
    for key in keys:
        target, pattern = conversion.rename(key) if conversion is not None else (key, None)
        target = aliases.get(target, target)
        if target not in wanted:
            plan.unexpected.append(key)
        elif pattern is not None:
            _, sources = groups.setdefault(target, (deepcopy(conversion.converters[pattern]), []))
            sources.append((key, pattern))
        elif target not in plan.direct:
            plan.direct[target] = key
            plan.shapes[target] = tuple(checkpoint[key][1])
    return groups


def _converted_tensor(
    model: nn.Module, target: str, conv: Any, sources: list[tuple[str, str]]
) -> Callable[[Callable[[str], torch.Tensor]], torch.Tensor]:
    """``build(read)``: the model tensor ``target``, converted from its checkpoint ``sources`` (each read by ``read``)."""

    def build(read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        fresh = deepcopy(conv)  # convert() consumes what was collected
        for key, pattern in sources:
            fresh.add_tensor(target, key, pattern, (lambda k=key: read(k)))
        out = fresh.convert(target, model=model, config=getattr(model, "config", None))
        if target not in out:
            raise ValueError(f"converting {[k for k, _ in sources]} gave {list(out)}, not {target!r}")
        value = out[target]
        return value[0] if isinstance(value, list) else value

    return build


def _drop_ignored(plan: KeyPlan, model: nn.Module, wanted: dict[str, tuple[int, ...]]) -> None:
    """Fill ``plan.missing`` and drop from ``plan.unexpected`` the keys Hugging Face ignores on load."""
    ignore_unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    ignore_missing = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    if is_hf_model(model):
        ignore_unexpected += [r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"]
    plan.unexpected = [k for k in plan.unexpected if not any(re.search(p, k) for p in ignore_unexpected)]
    plan.missing = [
        k
        for k in wanted
        if k not in plan.direct and k not in plan.converted and not any(re.search(p, k) for p in ignore_missing)
    ]


def saved_tensors(model: nn.Module, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint entries one model tensor is saved as: ``{key: tensor}``, or a fused MoE tensor's per-expert
    tensors under the names transformers' own ``save_pretrained`` writes. ``meta`` tensors plan files ahead."""
    if not is_hf_model(model):
        return {key: tensor}
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {key: tensor})


def saved_layout(
    model: Optional[nn.Module], tensors: dict[str, torch.Tensor]
) -> dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]]:
    """For each model key, the ``{saved key: (dtype, shape)}`` it is saved as (``saved_tensors``'s names).

    ``tensors``: model key -> tensor (``meta`` is enough). transformers' reverse mapping is run once
    over all of them, and per key only when it changes something (a fused MoE tensor): each call
    rebuilds transformers' reverse transforms, too slow to repeat for every key of most models.
    """
    same = {k: {k: (t.dtype, tuple(t.shape))} for k, t in tensors.items()}
    if not is_hf_model(model):
        return same
    from transformers.core_model_loading import revert_weight_conversion

    whole = revert_weight_conversion(model, dict(tensors))
    if set(whole) == set(tensors) and all(whole[k] is t for k, t in tensors.items()):
        return same
    return {
        k: {name: (v.dtype, tuple(v.shape)) for name, v in saved_tensors(model, k, t).items()}
        for k, t in tensors.items()
    }
