"""Tied weights: one tensor reachable under several names. The one home of every tie helper.

Pure: no process group. Sharding must keep a tie inside one unit (``wrapping``), ``to_empty``
unties (``retie`` puts it back), and a state dict or a Hugging Face file stores a tie once
(``tied_aliases`` names what to drop and what it is an alias of).
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn as nn

__all__ = ["retie", "tied_aliases", "tied_groups", "tied_parameter_groups"]


def tied_groups(tensors: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """Names that hold one tensor object, one list per tie (more than one name), in ``tensors``' order."""
    by_id: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        by_id.setdefault(id(tensor), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one object (tied weights), one list per tie, in module order."""
    return tied_groups(dict(model.named_parameters(remove_duplicate=False)))


def tied_aliases(tensors: Mapping[str, torch.Tensor], keep: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """``{alias: kept name}`` for every tensor reachable under several names; the kept name is the one ``keep``
    maps an alias of the group to (Hugging Face's ``all_tied_weights_keys``), else the group's first name."""
    keep = keep or {}
    aliases: dict[str, str] = {}
    for group in tied_groups(tensors):
        kept = next((keep[n] for n in group if n in keep and keep[n] in group), group[0])
        aliases.update({n: kept for n in group if n != kept})
    return aliases


def retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Make every name of each group hold the group's first parameter again (``to_empty`` unties them)."""
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            if getattr(owner, attr) is not first:
                owner.register_parameter(attr, first)
