"""Which parameters compute and reduce in fp32 whatever ``mp`` says, and the casts around their modules.

Two sources, merged: ``fsdp(keep_fp32=...)`` (module classes and/or module-name patterns), and a
Hugging Face model's own declaration, honoured exactly as ``from_pretrained(dtype=...)`` does
(transformers 5.x ``PreTrainedModel._get_dtype_plan``): ``_keep_in_fp32_modules_strict`` under a
bf16 or fp16 compute dtype, ``_keep_in_fp32_modules`` under fp16 only; each entry is a regular
expression (``*`` meaning ``.*``) searched anywhere in a parameter's state-dict name.

Selecting is pure (``select_fp32``); ``add_cast_hooks`` puts the input/output casts on the modules a
user named, so the module computes in fp32 and the next module gets the dtype it was given.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["Fp32Selection", "KeepFp32Spec", "add_cast_hooks", "hf_fp32_patterns", "select_fp32"]

KeepFp32Spec = Union[type, str, Sequence[Union[type, str]], None]

_LOW = (torch.bfloat16, torch.float16)
_ACCEPTED = (
    "None, an nn.Module subclass, a module-name pattern (a dotted part of a module's name, '*' within "
    "a part: 'norm', 'attn.proj', 'norm*'), or a list/tuple of those"
)


@dataclass(frozen=True)
class Fp32Selection:
    """What ``fsdp()`` keeps in fp32: parameter names (each parameter once), the modules a user named
    (their inputs are cast to fp32 and outputs back), and why (for the plan's notes).

    Example:
        >>> from zeta_fsdp.models.gpt import small
        >>> sel = select_fp32(small(n_layers=1), [nn.LayerNorm], MixedPrecisionPolicy(torch.bfloat16))
        >>> sel.param_names[:2], sel.cast_modules
        (('blocks.0.norm1.weight', 'blocks.0.norm1.bias'), ('blocks.0.norm1', 'blocks.0.norm2', 'norm'))
    """

    param_names: tuple[str, ...] = ()
    cast_modules: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def __bool__(self) -> bool:
        return bool(self.param_names)


def _specs(keep_fp32: KeepFp32Spec, caller: str) -> list[Union[type, str]]:
    specs = list(keep_fp32) if isinstance(keep_fp32, (list, tuple, set, frozenset)) else [keep_fp32]
    for spec in specs:
        ok = (isinstance(spec, str) and spec.strip(". ")) or (isinstance(spec, type) and issubclass(spec, nn.Module))
        if not ok:
            raise ValueError(f"{caller}(): keep_fp32={keep_fp32!r} is not accepted ({spec!r}). Accepted: {_ACCEPTED}.")
    return specs


def _name_pattern(spec: str) -> re.Pattern:
    """``spec`` as whole dotted parts of a module name: ``norm`` matches ``blocks.0.norm``, not ``norm1``."""
    body = r"\.".join(re.escape(part).replace(r"\*", r"[^.]*") for part in spec.strip(".").split("."))
    return re.compile(rf"(^|\.){body}($|\.)")


def _user_modules(model: nn.Module, specs: list[Union[type, str]], caller: str) -> list[str]:
    """Module names matched by ``specs`` (each spec must match one), outermost only, in model order."""
    named = [(n, m) for n, m in model.named_modules() if n]
    matched: set[str] = set()
    for spec in specs:
        if isinstance(spec, str):
            pattern = _name_pattern(spec)
            found = [n for n, _ in named if pattern.search(n)]
        else:
            found = [n for n, m in named if isinstance(m, spec)]
        if not found:
            label = spec if isinstance(spec, str) else spec.__name__
            shown = [n for n, _ in named][:12]
            raise ValueError(
                f"{caller}(): keep_fp32 entry {label!r} matches no submodule of {type(model).__name__}. A string "
                f"matches whole dotted parts of a module's name ('norm' matches 'blocks.0.norm', not 'norm1': write "
                f"'norm*'); a class matches its instances. Some module names: {', '.join(shown)}."
            )
        matched.update(found)
    for name in sorted(matched):
        module = model.get_submodule(name)
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and type(module).forward is nn.Module.forward:
            raise ValueError(
                f"{caller}(): keep_fp32 matched {name!r}, a {type(module).__name__} (no forward() to cast around). "
                "Name the modules it holds, or their class."
            )
    outer = [n for n, _ in named if n in matched and not any(n.startswith(o + ".") for o in matched)]
    return outer


def hf_fp32_patterns(model: nn.Module, compute: Optional[torch.dtype]) -> list[str]:
    """The fp32 entries a Hugging Face model declares for ``compute``, as ``from_pretrained(dtype=compute)``
    reads them: ``_keep_in_fp32_modules_strict`` under bf16/fp16, ``_keep_in_fp32_modules`` under fp16.

    Example:
        >>> class T(nn.Linear):
        ...     _keep_in_fp32_modules = ["wo"]
        >>> hf_fp32_patterns(T(1, 1), torch.float16), hf_fp32_patterns(T(1, 1), torch.bfloat16)
        (['wo'], [])
    """
    patterns: list[str] = []
    if compute == torch.float16:
        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if compute in _LOW:
        patterns += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return [p for p in patterns if isinstance(p, str) and p]


def select_fp32(
    model: nn.Module, keep_fp32: KeepFp32Spec, policy: MixedPrecisionPolicy, *, caller: str = "fsdp"
) -> Fp32Selection:
    """The parameters of ``model`` that stay fp32 under ``policy`` (see the module docstring).

    ``keep_fp32`` is validated whatever the policy (an entry matching nothing raises ``ValueError``);
    under a policy that computes in fp32 the selection is empty: there is nothing to keep.
    """
    specs = _specs(keep_fp32, caller) if keep_fp32 is not None else []
    cast_modules = _user_modules(model, specs, caller) if specs else []
    compute = policy.param_dtype
    if compute not in _LOW:
        return Fp32Selection()
    chosen: dict[int, str] = {}
    canonical = {id(p): n for n, p in model.named_parameters()}  # a tied parameter under its first name
    for name in cast_modules:
        for _, param in model.get_submodule(name).named_parameters(prefix=name):
            chosen.setdefault(id(param), canonical[id(param)])
    notes = [f"keep_fp32: {', '.join(cast_modules)} compute in fp32 (inputs cast up, outputs back)"] if specs else []
    hf = hf_fp32_patterns(model, compute)
    if hf:
        search = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in hf))
        hits = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if search.search(n)]
        for _, param in hits:
            chosen.setdefault(id(param), canonical[id(param)])
        if hits:
            notes.append(
                f"{type(model).__name__} declares {hf} fp32 (as from_pretrained keeps them): {len(hits)} params"
            )
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    names = sorted((n for n in chosen.values()), key=lambda n: order.get(n, len(order)))
    return Fp32Selection(tuple(names), tuple(cast_modules) if chosen else (), tuple(notes))


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _first_float(values: Any) -> Optional[torch.dtype]:
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return None


def add_cast_hooks(model: nn.Module, module_names: Sequence[str]) -> None:
    """Around each named module: floating inputs cast to fp32, floating outputs cast back to the dtype
    of its first floating input (what the module after it expects, as if it had run in ``mp``)."""
    for name in module_names:
        module = model.get_submodule(name)
        stack: list[Optional[torch.dtype]] = []

        def before(mod: nn.Module, args: tuple, kwargs: dict, stack: list = stack) -> tuple:
            stack.append(_first_float([*args, *kwargs.values()]))
            return _cast(args, torch.float32), _cast(kwargs, torch.float32)

        def after(mod: nn.Module, args: tuple, kwargs: dict, output: Any, stack: list = stack) -> Any:
            dtype = stack.pop() if stack else None
            return _cast(output, dtype) if dtype is not None and dtype != torch.float32 else output

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True, always_call=True)
