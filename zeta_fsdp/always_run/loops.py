"""Loops the proof can count: over every member of a container (``zip`` of equal lengths,
``enumerate``, ``.values()`` / ``.items()``, ``self.children()``, ``reversed``) or over ``range(n)`` with
``n`` known. A loop over data, or one that may exit early, runs what it mentions an uncounted number
of times. ``LoopReading`` is a part of ``proof.Proof``: it uses the proof's reading methods."""

from __future__ import annotations

import ast
from collections import Counter
from typing import Any, Optional

import torch.nn as nn

from .source import assigned_names, call_name, exits, is_self, mutated_attrs, self_attr, self_path
from .values import UNKNOWN, Index, Member


class LoopReading:
    """How ``proof.Proof`` reads a ``for`` statement."""

    def for_stmt(self, stmt: ast.For, env: dict[str, Any]) -> list[Counter]:
        """Paths through a loop over every member of a container, or a fixed ``range``."""
        loop = self.loop_of(stmt, env)
        assigned = assigned_names(stmt.body) | assigned_names([stmt.target])
        for name in assigned:
            self.rebind(name, env)
        if loop is None or stmt.orelse or exits(stmt.body):
            iter_paths = self.expr(stmt.iter, env)
            self.poison_in(stmt, {**env, **(loop[0] if loop else {})})
            return iter_paths
        bindings, times = loop
        per_iteration = [counts for counts, _ in self.body(stmt.body, {**env, **bindings}, [(Counter(), False)])]
        total: Counter = Counter()
        for key in set().union(*per_iteration) if per_iteration else ():
            counts = {c.get(key, 0) for c in per_iteration}
            if len(counts) > 1:  # different runs in different iterations or ranks: uncounted
                self.poison(key)
            elif key.endswith(("[*]", "#")) or key == "*":
                total[key] = counts.pop()  # a different member each iteration: each runs this often
            else:
                total[key] = counts.pop() * times
        for name in assigned:
            self.rebind(name, env)
        return [total]

    def loop_of(self, stmt: ast.For, env: dict[str, Any]) -> Optional[tuple[dict[str, Any], int]]:
        """(names the loop binds, iterations) for a loop over every member of containers (``zip`` of
        equal lengths too) or over ``range(n)`` with ``n`` known; else ``None``."""
        it, target = stmt.iter, stmt.target
        if (
            call_name(it) == "enumerate"
            and len(it.args) == 1
            and isinstance(target, ast.Tuple)
            and len(target.elts) == 2
        ):
            it, target = it.args[0], target.elts[1]
        names = [
            n.id if isinstance(n, ast.Name) else None
            for n in (target.elts if isinstance(target, ast.Tuple) else [target])
        ]
        if call_name(it) == "zip" and it.args and not it.keywords and len(names) == len(it.args):
            members = [self.members(a) for a in it.args]
            sizes = {m[1] for m in members if m is not None}
            if all(m is not None for m in members) and len(sizes) == 1:
                return {n: Member(m[0]) for n, m in zip(names, members) if n}, sizes.pop()
            return None
        if call_name(it) == "items" and len(names) == 2:
            names = names[1:]
        found = self.members(it)
        if found is not None and len(names) == 1 and names[0]:
            return {names[0]: Member(found[0])}, found[1]
        if call_name(it) == "range" and len(it.args) == 1 and names[0] and isinstance(target, ast.Name):
            bound = self.range_bound(it.args[0], env)
            return ({names[0]: Index(bound)}, bound) if bound is not None else None
        return None

    def members(self, it: ast.AST) -> Optional[tuple[Optional[str], int]]:
        """(container path, size) when iterating ``it`` yields every member of a container once."""
        if call_name(it) == "reversed" and len(it.args) == 1:
            it = it.args[0]
        if call_name(it) in ("values", "items", "children") and not it.args and isinstance(it.func, ast.Attribute):
            if call_name(it) == "children" and not is_self(it.func.value):
                return None
            it = it.func.value
        if is_self(it):  # iterating the module itself: a container's every member
            containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
            return (None, len(self.children)) if isinstance(self.module, containers) else None
        path = self_path(it, self.module)
        held = self.module.get_submodule(path) if path else None
        if isinstance(held, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            return path, len(held)
        return None

    def range_bound(self, node: ast.AST, env: dict[str, Any]) -> Optional[int]:
        if call_name(node) == "len" and len(node.args) == 1:
            path = self_path(node.args[0], self.module)
            return len(self.module.get_submodule(path)) if path else None
        bound = self.known.value(node, env)
        if bound is UNKNOWN and self_attr(node) is not None:
            held = self.module.__dict__.get(self_attr(node))  # a depth fixed at build time
            if type(held) is int and self_attr(node) not in mutated_attrs(type(self.module)):
                return held
        return bound if type(bound) is int else None
