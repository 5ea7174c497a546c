"""Which modules a forward provably runs on every call, read from the source of each ``forward``.

FSDP2 all-gathers a unit's parameters when the unit's forward starts. A unit that one rank skips
in a step (an expert no token reached, a tower for a batch without images) misses collectives the
other ranks join: a hang, an abort, or tensors paired with the wrong ones (wrong gradients). So a
block may be its own unit only when we can PROVE that its forward runs on every rank, every step.

The proof is conservative, by construction: starting from the root (which the user calls), a child
is proven when its holder's ``forward`` (itself proven) calls it unconditionally: ``self.x(...)`` in
a statement no ``if`` / ``try`` / loop guards (an ``if`` whose every branch calls it counts), every
member of ``self.blocks`` in ``for b in self.blocks: x = b(x)`` (also ``.values()``, ``.items()``,
``enumerate``, ``range(len(self.blocks))`` with ``self.blocks[i]``, ``getattr(self, f"b{i}")`` over
``range(n)`` with ``n`` equal to the count) when the loop body has no ``break`` / ``continue`` /
``return`` and no condition around the call, and every child of an ``nn.Sequential``. Anything else
is unproven: a source that cannot be read (a class made by ``exec``), a helper function handed the
container, a comprehension over the ids a router hit, a ``getattr`` under a condition, a loop whose
count is not fixed by the model (``range(k(x))``) and whatever the forward names more than once
(``self.blocks[0](h)`` after the loop, ``self.stack.run_some(h)``): a unit must run the same number
of times on every rank, not only at least once.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from typing import Optional

import torch.nn as nn

__all__ = ["always_run"]

# Expressions whose parts may not all be evaluated: a call inside one is not proven.
_GUARDED_EXPR = (ast.IfExp, ast.BoolOp, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
_LOOP_EXITS = (ast.Break, ast.Continue, ast.Return, ast.Yield, ast.YieldFrom)


@functools.cache
def _forward_def(cls: type) -> Optional[ast.FunctionDef]:
    """The parsed ``cls.forward`` (``None`` when its source cannot be read: ``exec``, a builtin)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError, AttributeError):
        return None
    fn = tree.body[0] if tree.body else None
    return fn if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _self_attr(node: ast.AST) -> Optional[str]:
    """``attr`` when ``node`` is ``self.attr``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _walk_unguarded(node: ast.AST):
    """Every node of an expression evaluated whenever the expression is (not inside a conditional
    expression, a boolean operator, a comprehension or a lambda)."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, _GUARDED_EXPR):
            yield from _walk_unguarded(child)


class _Loop:
    """What a proven loop binds: element names (members of ``container``) or an index over all of them."""

    def __init__(self, container: Optional[str], elements: set[str], index: Optional[str], bound: Optional[int]):
        self.container, self.elements, self.index, self.bound = container, elements, index, bound


def _calls_in(expr: ast.AST, loop: Optional[_Loop], module: nn.Module, sure: set[int]) -> set[tuple[str, str]]:
    """Keys of the children an expression surely calls: ``("call", attr)``, ``("all", container)``,
    ``("prefix", p)`` (every child named ``p<digits>``)."""
    keys: set[tuple[str, str]] = set()
    for node in _walk_unguarded(expr):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = getattr(func, "id", None) or getattr(func, "attr", None)
        targets = [func] + ([node.args[0]] if name == "checkpoint" and node.args else [])  # checkpoint(fn, ...)
        for target in targets:
            found = _callee(target, loop, module)
            if found:
                sure.add(id(target.value if isinstance(target, ast.Subscript) else target))
            keys |= found
    return keys


def _callee(target: ast.AST, loop: Optional[_Loop], module: nn.Module) -> set[tuple[str, str]]:
    """The key of what calling ``target`` runs (empty when it is not a child we can name)."""
    attr = _self_attr(target)
    if attr is not None:
        return {("call", attr)}
    if loop is None:
        return set()
    if isinstance(target, ast.Name) and target.id in loop.elements and loop.container:
        return {("all", loop.container)}
    if loop.index is None or loop.bound is None:
        return set()
    if isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Name) and target.slice.id == loop.index:
        container = _self_attr(target.value)
        held = getattr(module, container, None) if container else None
        if isinstance(held, (nn.ModuleList, nn.Sequential)) and len(held) == loop.bound:
            return {("all", container)}
    prefix = _getattr_prefix(target)
    if prefix is not None:
        members = [n for n, _ in module.named_children() if re.fullmatch(re.escape(prefix) + r"\d+", n)]
        if len(members) == loop.bound:
            return {("prefix", prefix)}
    return set()


def _getattr_prefix(node: ast.AST) -> Optional[str]:
    """``p`` for ``getattr(self, f"p{...}")``."""
    if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) == 2):
        return None
    if not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
        return None
    text = node.args[1]
    if isinstance(text, ast.JoinedStr) and text.values and isinstance(text.values[0], ast.Constant):
        return str(text.values[0].value)
    return None


def _loop_of(node: ast.For, module: nn.Module) -> Optional[_Loop]:
    """What ``node`` iterates over, when it is every member of a container of ``module`` or a
    ``range`` of a fixed length; ``None`` otherwise (an iteration over data)."""
    it, target = node.iter, node.target
    names = [n.id for n in (target.elts if isinstance(target, ast.Tuple) else [target]) if isinstance(n, ast.Name)]
    if isinstance(it, ast.Call) and getattr(it.func, "id", None) == "enumerate" and len(it.args) == 1:
        it, names = it.args[0], names[1:]
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("values", "items"):
        names = names[-1:] if it.func.attr == "items" else names
        it = it.func.value
    container = _self_attr(it)
    if container is not None and isinstance(getattr(module, container, None), (nn.ModuleList, nn.ModuleDict)):
        return _Loop(container, set(names[-1:]), None, None)
    is_range = isinstance(it, ast.Call) and getattr(it.func, "id", None) == "range" and len(it.args) == 1
    bound = _fixed_int(it.args[0], module) if is_range else None
    if bound is not None and isinstance(target, ast.Name):  # range(k(x)): a count that differs by rank
        return _Loop(None, set(), target.id, bound)
    return None


def _fixed_int(node: ast.AST, module: nn.Module) -> Optional[int]:
    """The value of a loop bound fixed by the model (a constant, ``self.depth``, ``len(self.blocks)``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    attr = _self_attr(node)
    if attr is not None and type(getattr(module, attr, None)) is int:
        return getattr(module, attr)
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "len" and len(node.args) == 1:
        held = getattr(module, _self_attr(node.args[0]) or "", None)
        return len(held) if isinstance(held, nn.Module) else None
    return None


def _holds_module(test: ast.AST, module: nn.Module) -> bool:
    """``test`` is ``self.x is not None`` (or ``self.x``) and ``module.x`` is a module: true on every rank."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.IsNot):
        if isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None:
            test = test.left
    attr = _self_attr(test)
    return attr is not None and isinstance(getattr(module, attr, None), nn.Module)


def _has(stmts: list[ast.stmt], kinds: tuple) -> bool:
    """A node of ``kinds`` in ``stmts``, not counting nested function definitions."""
    todo = list(stmts)
    while todo:
        node = todo.pop()
        if isinstance(node, kinds):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(node))
    return False


def _block_calls(
    stmts: list[ast.stmt], loop: Optional[_Loop], module: nn.Module, sure: set[int]
) -> set[tuple[str, str]]:
    """Keys of the children a run of ``stmts`` surely calls. Stops at a statement that may return
    early (what follows it may not run)."""
    keys: set[tuple[str, str]] = set()
    for stmt in stmts:
        if isinstance(stmt, ast.If) and _holds_module(stmt.test, module):
            keys |= _block_calls(stmt.body, loop, module, sure)  # `if self.norm is not None:` fixed by the model
        elif isinstance(stmt, ast.If):
            keys |= _calls_in(stmt.test, loop, module, sure)
            # one branch runs: a child both call is run (once) on every rank, but neither mention is "sure"
            keys |= _block_calls(stmt.body, loop, module, set()) & _block_calls(stmt.orelse, loop, module, set())
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            keys |= set().union(*(_calls_in(i.context_expr, loop, module, sure) for i in stmt.items))
            keys |= _block_calls(stmt.body, loop, module, sure)
        elif isinstance(stmt, ast.For):
            keys |= _calls_in(stmt.iter, loop, module, sure)
            inner = _loop_of(stmt, module)
            if inner is not None and not stmt.orelse and not _has(stmt.body, _LOOP_EXITS):
                found = {k for k in _block_calls(stmt.body, inner, module, sure) if k[0] != "call"}
                if found:
                    sure |= {id(n) for n in ast.walk(stmt.iter) if _self_attr(n) is not None}
                keys |= found
        elif isinstance(stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Return)):
            if stmt.value is not None:
                keys |= _calls_in(stmt.value, loop, module, sure)
        if isinstance(stmt, ast.Return) or _has([stmt], (ast.Return,)):
            break  # an early return: the statements after it may not run
    return keys


def _running_mentions(fn: ast.AST) -> list[tuple[str, int]]:
    """``(x, node id)`` for each mention of ``self.x`` in ``forward`` that may run it: called (``self.x(h)``,
    ``self.x[i](h)``, a method ``self.x.run(h)``), looped over, or handed to a call (not ``len(self.x)``).
    Reads (``self.layers[0].norm``) and ``self.x is not None`` tests do not run it."""
    parent: dict[int, ast.AST] = {}
    for node in ast.walk(fn):
        for child in ast.iter_child_nodes(node):
            parent[id(child)] = node
    mentions = []
    for node in ast.walk(fn):
        attr = _self_attr(node)
        if attr is None:
            continue
        up = parent.get(id(node))
        if isinstance(up, (ast.Subscript, ast.Attribute)) and up.value is node:
            outer = parent.get(id(up))  # self.x[i](...) or self.x.run(...): the element or method is called
            runs = isinstance(outer, ast.Call) and outer.func is up
        else:
            runs = isinstance(up, (ast.Call, ast.For, ast.comprehension))
            runs = runs and not (isinstance(up, ast.Call) and getattr(up.func, "id", None) == "len")
        if runs:
            mentions.append((attr, id(node)))
    return mentions


# Forwards trusted to run every child on every rank: wrappers that call the model they hold (PEFT's
# PeftModel/LoraModel; a LightningModule, whose training_step, not forward, calls its model), and
# Hugging Face's modeling code, whose conditions are on the call's arguments (`inputs_embeds is None`),
# the same on every rank (its LayerDrop is the documented exception: docs/pitfalls.md).
_PASS_THROUGH = ("peft.", "lightning.", "pytorch_lightning.", "transformers.")


def _passes_through(forward) -> bool:
    return any((getattr(forward, "__module__", None) or "").startswith(p) for p in _PASS_THROUGH)


def _proven_children(module: nn.Module) -> tuple[set[str], Optional[str]]:
    """(names of the children ``module.forward`` surely calls, with containers whose every member it
    calls marked ``"name[*]"``; why the others are not proven)."""
    children = [n for n, _ in module.named_children()]
    forward = type(module).forward
    if forward is nn.Sequential.forward:
        return set(children), None
    if forward is nn.Module.forward:  # nn.ModuleList / nn.ModuleDict: their holder calls the members
        return set(), f"{type(module).__name__} has no forward"
    if _passes_through(forward):
        return set(children), None
    fn = _forward_def(type(module))
    if fn is None:
        return set(), f"the source of {type(module).__name__}.forward cannot be read"
    proven: set[str] = set()
    sure: set[int] = set()
    keys = _block_calls(fn.body, None, module, sure)
    # a child also run from a mention the proof did not count (under a condition, via another method)
    # may run a different number of times on different ranks
    unsure = {name for name, node_id in _running_mentions(fn) if node_id not in sure}
    for kind, value in keys:
        if value in unsure:
            continue
        if kind == "call" and value in children:
            proven.add(value)
        elif kind == "all" and value in children:
            proven |= {value, value + "[*]"}
        elif kind == "prefix":
            proven |= {n for n in children if re.fullmatch(re.escape(value) + r"\d+", n)}
    return proven, f"{type(module).__name__}.forward does not provably call it on every run"


def always_run(model: nn.Module) -> tuple[set[int], dict[str, str]]:
    """(ids of the modules whose forward provably runs on every forward of ``model``; for each
    outermost module not proven, its name and why).

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
    proven, why = {id(model)}, {}
    todo: list[tuple[str, nn.Module, bool]] = [("", model, False)]
    while todo:
        name, module, every_member = todo.pop()
        called, reason = (
            (set(n for n, _ in module.named_children()), None) if every_member else _proven_children(module)
        )
        for child_name, child in module.named_children():
            path = f"{name}.{child_name}" if name else child_name
            if child_name in called:
                proven.add(id(child))
                todo.append((path, child, child_name + "[*]" in called))
            elif any(True for _ in child.parameters()):
                why[path] = reason or "not called"
    return proven, why
