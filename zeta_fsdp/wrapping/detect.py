"""Which classes are the blocks: ``TransformerBlock`` as given, or detected (a Hugging Face model's
``_no_split_modules``, else the classes repeated in a row; the innermost, not the stage holding them)."""

from __future__ import annotations

import re
from collections import Counter
from typing import Sequence, Union

import torch.nn as nn

from .plan import WrapUnit
from .skips import skippable_modules
from .tree import CONTAINERS, declared_blocks, members_of

__all__ = ["BlockSpec", "block_specs", "detect_block_classes", "detect_blocks", "is_layer_like"]
__all__ += ["resolve_block_classes", "split_suggestion"]

BlockSpec = Union[type, str, Sequence[Union[type, str]], None]


# Modules whose weight is a matrix or kernel: the layers a block is made of.
_WEIGHT_LAYERS = (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding, nn.MultiheadAttention)


# "b1", "layer_2", "s10": a name followed by an index, as hand-unrolled stacks name their blocks.
_INDEXED = re.compile(r"^(.*?)_?(\d+)$")


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


def resolve_block_classes(model: nn.Module, specs: list[Union[type, str]], caller: str) -> tuple[type, ...]:
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


def is_layer_like(module: nn.Module) -> bool:
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
    kinds = Counter(type(m) for m in items if not isinstance(m, CONTAINERS))
    return Counter(
        {c: n for c, n in kinds.items() if n > 1 and not is_layer_like(next(m for m in items if type(m) is c))}
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
        if isinstance(module, CONTAINERS):
            items = _chain(module, flattened) if isinstance(module, nn.Sequential) else list(module.children())
            items = [m for m in items if not isinstance(m, CONTAINERS)]
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
            elif len(members) > 1 and not issubclass(cls, CONTAINERS) and not is_layer_like(members[0]):
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
    layer_like = {c for c in candidates if is_layer_like(first[c])}

    def inside_another_candidate(cls: type) -> bool:
        inner: set[int] = set()
        for outer in modules:
            if isinstance(outer, tuple(candidates)) and type(outer) is not cls:
                inner.update(id(m) for m in outer.modules() if m is not outer)
        return all(id(m) in inner for m in modules if type(m) is cls)

    # a layer (a ModuleDict of heads, a ModuleList of norms) is no block beside real blocks: its class would
    # make every such layer inside the blocks a unit of its own
    has_blocks = any(c not in layer_like for c in candidates)
    kept = [c for c in candidates if not (c in layer_like and (has_blocks or inside_another_candidate(c)))]
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


def detect_blocks(model: nn.Module) -> tuple[tuple[type, ...], list[type]]:
    """(block classes, stage classes passed over for the blocks they hold). A class found only among
    members a forward may skip (experts), or that no forward provably runs, is no block: the layer
    holding them is."""
    named = declared_blocks(model)
    if named:
        return tuple(named), []
    counts = _repeated_children(model)
    skipped = members_of(model, skippable_modules(model)) if counts else set()
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
    return detect_blocks(model)[0]


def split_suggestion(model: nn.Module, unit: WrapUnit, skipped: set[int]) -> list[type]:
    """Block-like classes repeated among the modules whose parameters ``unit`` owns, biggest first:
    what ``TransformerBlock`` could name to split it (never members a forward may skip)."""
    owned = set(unit.param_names)
    numel: Counter = Counter()
    count: Counter = Counter()
    for name, m in model.named_modules():
        if m is model or isinstance(m, CONTAINERS) or is_layer_like(m) or id(m) in skipped:
            continue
        names = [f"{name}.{n}" for n, _ in m.named_parameters()]
        if names and all(n in owned for n in names):
            count[type(m)] += 1
            numel[type(m)] += sum(p.numel() for p in m.parameters())
    return [c for c, _ in numel.most_common() if count[c] > 1]
