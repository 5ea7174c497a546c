"""Names and relations in a module tree, shared by the planning steps (pure)."""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn

__all__ = ["CONTAINERS", "declared_blocks", "find_blocks", "is_hugging_face", "is_under", "members_of"]

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def is_under(name: str, prefixes: Iterable[str]) -> bool:
    """``name`` is one of ``prefixes`` or inside one (``""``, the root, holds every name)."""
    return any(p == "" or name == p or name.startswith(p + ".") for p in prefixes)


def members_of(model: nn.Module, containers: Iterable[str]) -> set[int]:
    """Ids of the named modules and of every module inside them."""
    return {id(m) for name in containers for m in model.get_submodule(name).modules()}


def find_blocks(model: nn.Module, classes: tuple[type, ...], prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every instance of ``classes`` below ``model``, children before parents."""
    found = []
    for name, child in model.named_children():
        path = f"{prefix}.{name}" if prefix else name
        found += find_blocks(child, classes, path)
        if classes and isinstance(child, classes):
            found.append((path, child))
    return found


def declared_blocks(model: nn.Module) -> list[type]:
    """The classes a Hugging Face model names in ``_no_split_modules`` that it holds."""
    no_split = getattr(model, "_no_split_modules", None) or ()
    return sorted({type(m) for m in model.modules() if type(m).__name__ in no_split}, key=lambda c: c.__name__)


def is_hugging_face(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (by name: transformers is never imported here)."""
    return any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__)
