"""Reading a module's source: parsed functions, paths to children, what a statement may do."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Callable, Iterator, Optional

import torch.nn as nn

SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@functools.cache
def parsed(function: Callable) -> Optional[ast.FunctionDef]:
    """The parsed ``function``; ``None`` when its source cannot be read (``exec``, a builtin) or is not
    what runs (a decorated function: ``getsource`` shows the undecorated one, not the wrapper)."""
    if hasattr(function, "__wrapped__"):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.decorator_list:
        return None
    first = fn.args.posonlyargs + fn.args.args
    return fn if first and first[0].arg == "self" else None


@functools.cache
def parents(fn: ast.AST) -> dict[int, ast.AST]:
    """Each node's parent, by node id."""
    return {id(child): node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}


def is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def self_attr(node: ast.AST) -> Optional[str]:
    """``attr`` when ``node`` is ``self.attr``."""
    return node.attr if isinstance(node, ast.Attribute) and is_self(node.value) else None


def is_container(module: nn.Module) -> bool:
    """A module whose members its holder runs one by one (no forward of its own, or ``nn.Sequential``)."""
    return type(module).forward in (nn.Module.forward, nn.Sequential.forward)


def self_path(node: ast.AST, module: nn.Module) -> Optional[str]:
    """``"a.b.0"`` when ``node`` is ``self.a.b[0]`` and names a submodule through containers only
    (``self.transformer.h`` in nanoGPT: ``transformer`` is an ``nn.ModuleDict``); else ``None``."""
    parts: list[str] = []
    while not is_self(node):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            parts.append(str(node.slice.value))
        else:
            return None
        node = node.value
    held = module
    for depth, part in enumerate(reversed(parts)):
        if depth and not is_container(held):
            return None
        held = held._modules.get(part) if isinstance(held, nn.Module) else None
        if held is None:
            return None
    return ".".join(reversed(parts)) if parts else None


def call_name(node: ast.AST) -> Optional[str]:
    """``f`` for ``f(...)`` or ``a.b.f(...)``."""
    if not isinstance(node, ast.Call):
        return None
    return getattr(node.func, "id", None) or getattr(node.func, "attr", None)


def assigned_names(stmts: list[ast.AST]) -> set[str]:
    return {n.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def walk_scope(nodes: list[ast.AST]) -> Iterator[ast.AST]:
    """Every node of ``nodes`` outside nested functions, lambdas and classes."""
    todo = list(nodes)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, SCOPES):
            todo.extend(ast.iter_child_nodes(node))


def returns(nodes: list[ast.AST]) -> bool:
    """A ``return`` / ``yield`` in ``nodes``, outside nested scopes."""
    return any(isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom)) for n in walk_scope(nodes))


def exits(stmts: list[ast.stmt]) -> bool:
    """A ``return`` / ``yield`` in a loop body, or a ``break`` / ``continue`` of this loop."""
    todo = [(s, False) for s in stmts]
    while todo:
        node, nested = todo.pop()
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom)):
            return True
        if isinstance(node, (ast.Break, ast.Continue)) and not nested:
            return True
        if not isinstance(node, SCOPES):
            inner = nested or isinstance(node, (ast.For, ast.While))
            todo.extend((child, inner) for child in ast.iter_child_nodes(node))
    return False


def getattr_prefix(node: ast.AST) -> Optional[str]:
    """``p`` for ``getattr(self, f"p{...}")``."""
    if not (isinstance(node, ast.Call) and call_name(node) == "getattr" and len(node.args) == 2):
        return None
    if not is_self(node.args[0]):
        return None
    text = node.args[1]
    parts = text.values if isinstance(text, ast.JoinedStr) else []
    if len(parts) == 2 and isinstance(parts[0], ast.Constant) and isinstance(parts[1], ast.FormattedValue):
        return str(parts[0].value)
    return None


@functools.cache
def mutated_attrs(cls: type) -> frozenset[str]:
    """Attributes of ``self`` some method of ``cls`` (other than ``__init__``) assigns: state, not a
    setting fixed when the model was built."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch.nn."):
            continue
        for attr, function in vars(klass).items():
            if attr == "__init__" or not inspect.isfunction(function):
                continue
            fn = _parse_any(function)
            if fn is None:
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Attribute) and is_self(node.value) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
                if call_name(node) == "setattr" and node.args and is_self(node.args[0]):
                    return frozenset({"*"})  # setattr(self, name, ...): any attribute may change
    return frozenset(names)


def _parse_any(function: Callable) -> Optional[ast.AST]:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
