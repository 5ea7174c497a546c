"""Which values in a forward are the same on every rank, and what they are.

Known: constants, a method's arguments a caller passes as constants or leaves at their default
(timm's ``pre_logits=False``), and the model's structure: whether an attribute holds a module or
``None`` (``if self.norm is not None:``, ``getattr(self, "aa", None)``). Everything else is unknown:
the data, the caller's arguments, and plain settings (``self.grad_checkpointing``, ``self.training``,
a flag the training loop may set per rank), whose branches are all counted.
"""

from __future__ import annotations

import ast
import inspect
from typing import Any, Optional

import torch.nn as nn

from .source import call_name, is_self, mutated_attrs

UNKNOWN = object()  # a value the proof cannot know: both branches of a test on it are counted

_COMPARE = {
    ast.Is: lambda a, b: a is b,
    ast.IsNot: lambda a, b: a is not b,
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
}
_CONSTANTS = (bool, int, float, str, type(None))


class Member:
    """A loop variable bound to one member of the container at ``path`` per iteration (``None``: one
    child of the module itself)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path


class Alias:
    """A local name for the submodule at ``path`` (``first = self.layers[0]``): reading it is fine,
    running it or handing it on is uncounted."""

    def __init__(self, path: str) -> None:
        self.path = path


class Index:
    """A loop variable counting ``0 .. bound - 1``."""

    def __init__(self, bound: int) -> None:
        self.bound = bound


def structure(module: nn.Module, name: str) -> Any:
    """``module.name`` when it is a submodule or ``None`` that no method reassigns (the model's
    structure, the same on every rank); ``UNKNOWN`` otherwise. Never runs a property."""
    mutated = mutated_attrs(type(module))
    if name in mutated or "*" in mutated:
        return UNKNOWN
    if name in module._modules:
        return module._modules[name]
    held = module.__dict__.get(name, UNKNOWN)
    if held is None:
        return None
    if held is UNKNOWN and name not in module._parameters and name not in module._buffers:
        static = inspect.getattr_static(type(module), name, UNKNOWN)
        return None if static is None else UNKNOWN
    return UNKNOWN


class Known:
    """Evaluates the expressions of ``module``'s forward whose value is the same on every rank."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def value(self, node: ast.AST, env: dict[str, Any]) -> Any:
        """The value of ``node`` when known, else ``UNKNOWN``."""
        if isinstance(node, ast.Constant):
            return node.value if isinstance(node.value, _CONSTANTS) else UNKNOWN
        if isinstance(node, ast.Name):
            got = env.get(node.id, UNKNOWN)
            return UNKNOWN if isinstance(got, (Member, Index, Alias)) else got
        if isinstance(node, ast.Attribute) and is_self(node.value):
            return structure(self.module, node.attr)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            got = self.value(node.operand, env)
            return UNKNOWN if got is UNKNOWN else not got
        if isinstance(node, ast.BoolOp):
            return self._bool_op(node, env)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
            return self._compare(node, env)
        if isinstance(node, ast.Call):
            return self._call(node, env)
        return UNKNOWN

    def _bool_op(self, node: ast.BoolOp, env: dict[str, Any]) -> Any:
        values = [self.value(v, env) for v in node.values]
        decisive = (lambda v: not v) if isinstance(node.op, ast.And) else bool
        if any(v is not UNKNOWN and decisive(v) for v in values):
            return isinstance(node.op, ast.Or)  # one operand decides it, whatever the unknown ones are
        return UNKNOWN if UNKNOWN in values else isinstance(node.op, ast.And)

    def _compare(self, node: ast.Compare, env: dict[str, Any]) -> Any:
        left, right = self.value(node.left, env), self.value(node.comparators[0], env)
        if left is UNKNOWN or right is UNKNOWN:
            return UNKNOWN
        if isinstance(node.ops[0], (ast.Eq, ast.NotEq)) and not (
            isinstance(left, _CONSTANTS) and isinstance(right, _CONSTANTS)
        ):
            return UNKNOWN  # == on modules may be user code
        return bool(_COMPARE[type(node.ops[0])](left, right))

    def _call(self, node: ast.Call, env: dict[str, Any]) -> Any:
        name = call_name(node)
        if name in ("is_scripting", "is_tracing") and not node.args:
            return False  # torch.jit: never under FSDP2
        if name == "getattr" and node.args and is_self(node.args[0]) and len(node.args) in (2, 3):
            attr = self.value(node.args[1], env)
            if not isinstance(attr, str):
                return UNKNOWN
            got = structure(self.module, attr)
            if got is UNKNOWN and len(node.args) == 3 and attr not in self.module.__dict__:
                static = inspect.getattr_static(type(self.module), attr, UNKNOWN)
                if static is UNKNOWN and attr not in self.module._parameters and attr not in self.module._buffers:
                    return self.value(node.args[2], env)  # absent: the default
            return got
        return UNKNOWN

    def loop_or_value(self, node: ast.AST, env: dict[str, Any]) -> Any:
        """Like ``value``, but a loop variable's binding (``Member``/``Index``) passes through."""
        return env.get(node.id, UNKNOWN) if isinstance(node, ast.Name) else self.value(node, env)


def same(a: Any, b: Any) -> bool:
    """The same known argument (at two calls of one child)."""
    if a is b:
        return True
    try:
        return type(a) is type(b) and isinstance(a, _CONSTANTS) and bool(a == b)
    except Exception:  # noqa: BLE001 - anything not comparable is simply not the same
        return False
