"""Which modules a forward provably runs the same number of times on every call, read from source.

FSDP2 all-gathers a unit's parameters when the unit's forward starts. A unit that one rank skips
in a step (an expert no token reached, a tower for a batch without images) misses collectives the
other ranks join: a hang, an abort, or tensors paired with the wrong ones (wrong gradients). So a
block may be its own unit only when we can PROVE that its forward runs on every rank, every step,
and as many times on each.

Starting from the model, the proof reads each ``forward`` (``proof.py``) and counts, along every
path through it, how many times each child runs; a child is proven when every path runs it the
same number of times. Paths split wherever a condition is not known to be the same on every rank
(``values.py``: the data, the caller's arguments, plain settings such as ``self.grad_checkpointing``
or ``self.training``); the model's structure (``self.norm is not None``) and a method's default
arguments (timm's ``pre_logits=False``) are known. Methods of the module are read in place.

Anything it cannot count makes the child unproven: a source that cannot be read (``exec``, a
decorated forward, one replaced on the instance, a class overriding ``__call__``), a child handed to
a helper function, a local name or a list, a method of a child (``self.stack.run_some``), ``self``
handed on, a comprehension, lambda, ``while``, ``try`` or unknown ``with`` that runs it, a loop over
data or with ``break`` / ``continue`` / ``return``, a module registered under two names.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch.nn as nn

from .proof import Proof
from .source import parsed

__all__ = ["always_run", "modality_towers"]

# Forwards trusted to run every child on every rank: PEFT's wrappers call the model they hold, and
# Hugging Face's modeling code conditions on the call's arguments (`inputs_embeds is None`), the same
# on every rank (its LayerDrop and multimodal towers are the exceptions: `modality_towers`).
_PASS_THROUGH = ("peft.", "transformers.")
_TOWER = re.compile(r"(vision|visual|image|audio|video|speech|multi_modal|mm_)", re.IGNORECASE)


def _passes_through(forward: Callable) -> bool:
    return any((getattr(forward, "__module__", None) or "").startswith(p) for p in _PASS_THROUGH)


def _entry(module: nn.Module) -> tuple[Optional[Callable], Optional[str]]:
    """(the function whose runs count for ``module``'s children, why none can be read)."""
    cls = type(module)
    if cls.__call__ is not nn.Module.__call__:
        return None, f"{cls.__name__} overrides __call__"
    if "forward" in module.__dict__:
        return None, f"{cls.__name__}.forward is replaced on the instance"
    if any(c.__name__ == "LightningModule" for c in cls.__mro__):
        step = getattr(cls, "training_step", None)  # what Lightning calls; it calls forward, or not
        if step is None or (getattr(step, "__module__", "") or "").startswith(("lightning.", "pytorch_lightning.")):
            return None, f"{cls.__name__} has no training_step of its own to read"
        return step, None
    return cls.forward, None


def _proven_children(module: nn.Module, args: dict[str, Any]) -> tuple[set[str], Optional[str], Callable]:
    """(the keys of the submodules ``module``'s forward runs equally often on every path: ``"x"``,
    ``"x[*]"`` for every member of ``x``, ``"x.y"`` for a member reached through the container ``x``;
    why the others are not proven; the known arguments of each child's forward)."""
    children = {n for n, _ in module.named_children()}
    no_args: Callable = lambda _: {}  # noqa: E731
    forward = type(module).forward
    if forward is nn.Sequential.forward and type(module).__call__ is nn.Module.__call__:
        return children, None, no_args
    if forward is nn.Module.forward:  # nn.ModuleList / nn.ModuleDict: their holder calls the members
        return set(), f"{type(module).__name__} has no forward", no_args
    entry, why = _entry(module)
    if entry is not None and _passes_through(entry):
        return children, None, no_args
    if entry is None or parsed(entry) is None:
        return set(), why or f"the source of {type(module).__name__}.forward cannot be read", no_args
    proof = Proof(module)
    return (
        proof.proven(entry, args),
        f"{type(module).__name__}.forward does not provably call it on every run",
        proof.known_args,
    )


def _shared(model: nn.Module) -> set[int]:
    """Ids of the modules registered under two names (and what they hold): run from two places."""
    seen: dict[int, str] = {}
    shared: set[int] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in seen and seen[id(module)] != name:
            shared |= {id(m) for m in module.modules()}
        seen.setdefault(id(module), name)
    return shared


def always_run(model: nn.Module) -> tuple[set[int], dict[str, str]]:
    """(ids of the modules whose forward provably runs on every forward of ``model``, as many times
    on every rank; for each outermost module not proven, its name and why).

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
        ...         self.tower = nn.Linear(2, 2)
        ...     def forward(self, x, image=None):
        ...         for block in self.blocks:
        ...             x = block(x)
        ...         if image is not None:
        ...             x = x + self.tower(image)
        ...         return x
        >>> ids, why = always_run(Net())
        >>> sorted(why)
        ['tower']
    """
    shared = _shared(model)
    proven, why = {id(model)}, {}
    # (name, module, the keys its holder proved for its members or None to read its forward, its known arguments)
    todo: list[tuple[str, nn.Module, Optional[set[str]], dict[str, Any]]] = [("", model, None, {})]
    while todo:
        name, module, given, args = todo.pop()
        if given is None:
            called, reason, args_of = _proven_children(module, args)
        else:
            called, reason, args_of = given, "not called", lambda _: {}
        for child_name, child in module.named_children():
            path = f"{name}.{child_name}" if name else child_name
            if child_name in called and id(child) not in shared and type(child).__call__ is nn.Module.__call__:
                proven.add(id(child))
                todo.append((path, child, _given(child, child_name, called), args_of(child_name)))
            elif any(True for _ in child.parameters()):
                why[path] = _why_not(child, child_name in called, shared) or reason or "not called"
    return proven, why


def _why_not(child: nn.Module, called: bool, shared: set[int]) -> Optional[str]:
    if id(child) in shared:
        return "registered under two names"
    if called:
        return f"{type(child).__name__} overrides __call__ (it may skip its forward)"
    return None


def _given(child: nn.Module, name: str, called: set[str]) -> Optional[set[str]]:
    """What the holder's proof says of ``child``'s members: all of them (``name[*]``), those it named
    through the container (``name.x``), or ``None`` (read the child's own forward)."""
    if f"{name}[*]" in called:
        return {n for n, _ in child.named_children()}
    inner = {key[len(name) + 1 :] for key in called if key.startswith(name + ".")}
    return inner if inner or type(child).forward is nn.Module.forward else None


def modality_towers(model: nn.Module) -> dict[str, str]:
    """The towers of a Hugging Face multimodal language model (``vision_tower``, ``visual``,
    ``audio_tower``, ``multi_modal_projector``, ... beside a ``language_model`` or ``lm_head``) by name,
    with why: its forward runs each only for batches that carry that input, so a rank with a text-only
    batch skips it. Empty for other models (CLIP's towers run on every batch).

    Example:
        >>> modality_towers(nn.Linear(2, 2))
        {}
    """
    config = getattr(model, "config", None)
    if config is None or not any(c.__name__ == "PreTrainedModel" for c in type(model).__mro__):
        return {}
    if getattr(config, "text_config", None) is None:
        return {}  # one modality: its encoder runs on every batch
    names = [n.rsplit(".", 1)[-1] for n, _ in model.named_modules()]
    if "language_model" not in names and "lm_head" not in names:
        return {}  # contrastive (CLIP): every batch carries both inputs
    towers: dict[str, str] = {}
    for name, _ in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if name and _TOWER.match(last) and not any(name.startswith(t + ".") for t in towers):
            towers[name] = f"{type(model).__name__} runs its {last} only for batches that carry that input"
    return towers
