"""Counting, along every path through a module's forward, how many times each child runs.

Keys of what runs: ``"a.b"`` (a submodule reached through containers: ``self.transformer.wte``),
``"a[*]"`` (every member of the container ``a`` once: an ``nn.Sequential`` called, or one member per
iteration of a loop over it), ``"*"`` (one child of the module per iteration), ``"b#"`` (``getattr(self,
f"b{i}")`` over ``range(n)``). A path is a ``Counter`` of keys; a child is proven when every path
counts it alike and nothing ran it in a way the proof cannot count (it is then *poisoned*).
"""

from __future__ import annotations

import ast
import inspect
import re
from collections import Counter
from typing import Any, Callable, Optional

import torch.nn as nn

from .loops import LoopReading
from .source import (
    assigned_names,
    call_name,
    getattr_prefix,
    is_self,
    parents,
    parsed,
    returns,
    self_attr,
    self_path,
)
from .values import UNKNOWN, Alias, Index, Known, Member, same

MAX_PATHS = 256  # more paths than this through one forward: prove nothing rather than guess
_MAX_DEPTH = 8  # methods read in place, nested
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda)
# Context managers that never swallow an exception (one that might could skip the rest of its body).
_TRANSPARENT = {"no_grad", "enable_grad", "inference_mode", "set_grad_enabled", "autocast", "nullcontext"}
_TRANSPARENT |= {"record_function", "sdpa_kernel", "device", "stream", "profile", "annotate"}
_READS = ("len", "isinstance", "hasattr", "type", "id")

Paths = list[Counter]
Steps = list[tuple[Counter, bool]]  # (counts, whether the path has returned)


class Unprovable(Exception):  # noqa: N818 - a verdict, not an error
    """Too many paths, or an exit the proof does not follow: nothing in this forward is proven."""


def _add(a: Counter, b: Counter) -> Counter:
    out = Counter(a)
    out.update(b)
    return out


def sequence(firsts: Paths, thens: Paths) -> Paths:
    """Every path of ``firsts`` followed by every path of ``thens`` (duplicates merged)."""
    out = {frozenset(c.items()): c for c in (_add(a, b) for a in firsts for b in thens)}
    if len(out) > MAX_PATHS:
        raise Unprovable
    return list(out.values())


def top_child(key: str) -> str:
    """The child of the module a key names (``"transformer"`` for ``"transformer.h[*]"``)."""
    return key.split(".")[0].split("[")[0].rstrip("#")


class Proof(LoopReading):
    """Counts the runs of ``module``'s children along every path of one entry function."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.known = Known(module)
        self.children = dict(module.named_children())
        self.poisoned: set[str] = set()  # children run in a way the proof cannot count
        self.reading: list[Callable] = []  # the functions being read, outermost first
        self.call_args: dict[str, list[dict[str, Any]]] = {}  # per child, the known arguments of each call

    def poison(self, key: Optional[str]) -> None:
        if key == "*" or key is None:
            self.poisoned.update(self.children)
        else:
            self.poisoned.add(top_child(key))

    # --- expressions ------------------------------------------------------------------------------
    def expr(self, node: Optional[ast.AST], env: dict[str, Any]) -> Paths:
        """The counts of children run by evaluating ``node``, one per path through it."""
        if node is None:
            return [Counter()]
        if isinstance(node, ast.IfExp):
            return self.if_expr(node, env)
        if isinstance(node, ast.BoolOp):
            paths = self.expr(node.values[0], env)
            for later in node.values[1:]:  # may not be evaluated: whatever it runs is uncounted
                self.poison_in(later, env)
            return paths
        if isinstance(node, _COMPREHENSIONS):
            self.poison_in(node, env)
            return [Counter()]
        if isinstance(node, ast.NamedExpr):
            self.rebind(node.target.id, env)
        if isinstance(node, ast.Call):
            return self.call(node, env)
        self.check_mention(node, env)
        paths = [Counter()]
        for child in ast.iter_child_nodes(node):
            paths = sequence(paths, self.expr(child, env))
        return paths

    def if_expr(self, node: ast.IfExp, env: dict[str, Any]) -> Paths:
        test = self.known.value(node.test, env)
        paths = self.expr(node.test, env)
        if test is not UNKNOWN:  # the model's structure: the same branch on every rank
            self.shadow(lambda: self.expr(node.orelse if test else node.body, dict(env)))
            return sequence(paths, self.expr(node.body if test else node.orelse, env))
        return sequence(paths, self.expr(node.body, env) + self.expr(node.orelse, env))

    def rebind(self, name: str, env: dict[str, Any]) -> None:
        """A loop variable reassigned (a walrus): what it runs afterwards is uncounted."""
        held = env.pop(name, None)
        if isinstance(held, Member):
            self.poison(held.path)  # what it runs after the reassignment is not the loop's member
        elif isinstance(held, Index):
            self.poison(None)

    def call(self, node: ast.Call, env: dict[str, Any]) -> Paths:
        """Paths through a call: its arguments, then what it runs."""
        runs, consumed = self.callee(node, env)
        paths = [Counter()]
        if consumed is not node.func:
            func = node.func.value if isinstance(node.func, ast.Attribute) else node.func
            if func is not consumed:
                paths = sequence(paths, self.expr(func, env))
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            if arg is not consumed:
                paths = sequence(paths, self.expr(arg, env))
        return sequence(paths, runs)

    def callee(self, node: ast.Call, env: dict[str, Any]) -> tuple[Paths, Optional[ast.AST]]:
        """(paths of what the call itself runs, the node naming it: not a mention to check)."""
        name = call_name(node)
        if name == "checkpoint" and node.args:  # torch.utils.checkpoint.checkpoint(fn, *args)
            key = self.run_key(node.args[0], env)
            if key is not None:
                return [Counter({key: 1})], node.args[0]
        if name == "checkpoint_seq" and node.args:  # timm: runs each member of a sequence once
            keys = self.sequence_keys(node.args[0])
            if keys is not None:
                return [Counter(keys)], node.args[0]
        key = self.run_key(node.func, env)
        if key is not None:
            if key in self.children:
                self.call_args.setdefault(key, []).append(self.bind(type(self.children[key]).forward, node, env))
            return [Counter({key: 1})], node.func
        method = self.method(node.func) or self.super_method(node.func)
        if method is not None:
            return self.read_method(method, node, env), node.func
        return [Counter()], None

    def run_key(self, target: ast.AST, env: dict[str, Any]) -> Optional[str]:
        """The key of the submodule calling ``target`` runs; ``None`` when it is none we can name."""
        path = self_path(target, self.module)
        if path is not None:
            held = self.module.get_submodule(path)
            return f"{path}[*]" if type(held).forward is nn.Sequential.forward else path
        if isinstance(target, ast.Name) and isinstance(env.get(target.id), Member):
            container = env[target.id].path
            return "*" if container is None else f"{container}[*]"
        if isinstance(target, ast.Subscript):
            index, holder = self.known.loop_or_value(target.slice, env), self_path(target.value, self.module)
            held = self.module.get_submodule(holder) if holder else None
            if isinstance(index, Index) and isinstance(held, (nn.ModuleList, nn.Sequential)):
                return f"{holder}[*]" if len(held) == index.bound else None
        return self.prefix_key(target, env)

    def prefix_key(self, target: ast.AST, env: dict[str, Any]) -> Optional[str]:
        """``"b#"`` for ``getattr(self, f"b{i + k}")`` over a ``range`` covering every ``b<n>`` child."""
        prefix = getattr_prefix(target)
        if prefix is None:
            return None
        index, offset = target.args[1].values[1].value, 0
        if isinstance(index, ast.BinOp) and isinstance(index.op, ast.Add) and isinstance(index.right, ast.Constant):
            index, offset = index.left, index.right.value
        loop = self.known.loop_or_value(index, env)
        if not (isinstance(loop, Index) and type(offset) is int):
            return None
        names = {f"{prefix}{i + offset}" for i in range(loop.bound)}
        matching = {n for n in self.children if re.fullmatch(re.escape(prefix) + r"\d+", n)}
        return f"{prefix}#" if names == matching else None

    def sequence_keys(self, node: ast.AST) -> Optional[list[str]]:
        """The submodules a ``checkpoint_seq`` argument runs once each (``None``: none we can name)."""
        if isinstance(node, ast.Call) and is_self(getattr(node.func, "value", None)) and not node.args:
            return ["*"] if call_name(node) == "children" else None
        path = self_path(node, self.module)
        if path is not None and isinstance(self.module.get_submodule(path), (nn.Sequential, nn.ModuleList)):
            return [f"{path}[*]"]
        if isinstance(node, (ast.List, ast.Tuple)):
            keys = [self.run_key(e, {}) if self_path(e, self.module) else None for e in node.elts]
            return keys if all(k is not None for k in keys) else None
        return None

    def method(self, func: ast.AST) -> Optional[Callable]:
        """The function behind ``self.name`` (or ``self`` itself: its forward) when it is a method of
        the module's own class, not one of ``nn.Module``'s."""
        if is_self(func):
            return type(self.module).forward
        attr = self_attr(func)
        return None if attr is None or attr in self.children else self.method_named(attr)

    def super_method(self, func: ast.AST) -> Optional[Callable]:
        """The function ``super().name`` calls from the function being read (the next class in the
        module's MRO after the one defining it)."""
        if not (isinstance(func, ast.Attribute) and call_name(func.value) == "super" and not func.value.args):
            return None
        mro = type(self.module).__mro__
        current = self.reading[-1] if self.reading else None
        owner = next((i for i, k in enumerate(mro) if current in vars(k).values()), None)
        if owner is None:
            return None
        for klass in mro[owner + 1 :]:
            if func.attr in vars(klass):
                found = vars(klass)[func.attr]
                return found if inspect.isfunction(found) and klass is not nn.Module else None
        return None

    def method_named(self, attr: str) -> Optional[Callable]:
        function = inspect.getattr_static(type(self.module), attr, None)
        if not inspect.isfunction(function) or getattr(nn.Module, attr, None) is function:
            return None
        return function

    def read_method(self, function: Callable, node: ast.Call, env: dict[str, Any]) -> Paths:
        """Paths through ``self.method(...)``: its body read in place, its arguments bound where known."""
        fn = parsed(function)
        if fn is None or function in self.reading or len(self.reading) >= _MAX_DEPTH:
            self.poison(None)  # unreadable or recursive: whatever it runs is uncounted
            return [Counter()]
        self.reading.append(function)
        try:
            return [counts for counts, _ in self.body(fn.body, self.bind(function, node, env), [(Counter(), False)])]
        finally:
            self.reading.pop()

    def bind(self, function: Callable, node: ast.Call, env: dict[str, Any]) -> dict[str, Any]:
        """The function's parameters known at this call: constants, structure, defaults."""
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return {}
        try:
            params = list(inspect.signature(function).parameters.values())[1:]  # after self
        except (TypeError, ValueError):  # a builtin
            return {}
        bound = {p.name: self.known.loop_or_value(a, env) for p, a in zip(params, node.args)}
        bound.update((k.arg, self.known.loop_or_value(k.value, env)) for k in node.keywords)
        for param in params:
            if param.name not in bound and param.default is not inspect.Parameter.empty:
                bound[param.name] = (
                    param.default if isinstance(param.default, (bool, int, str, type(None))) else UNKNOWN
                )
        return {k: v for k, v in bound.items() if v is not UNKNOWN}

    def known_args(self, child: str) -> dict[str, Any]:
        """The arguments of ``child``'s forward that every call of it passes alike (defaults included)."""
        calls = self.call_args.get(child, [])
        if not calls:
            return {}
        return {k: v for k, v in calls[0].items() if all(k in c and same(c[k], v) for c in calls[1:])}

    # --- mentions the proof cannot count ------------------------------------------------------------
    def check_mention(self, node: ast.AST, env: dict[str, Any]) -> None:
        """Poison a submodule mentioned where it may run uncounted: handed to a call or a name, a method
        of it called, ``self`` itself handed on. Reading it (``self.x.weight``, ``len(self.x)``) is fine."""
        if is_self(node):
            self.check_self(node)
            return
        key = self_path(node, self.module)
        if isinstance(node, ast.Name) and isinstance(env.get(node.id), (Member, Alias)):
            key = env[node.id].path or "*"
        if key is None:
            self.check_alias(node)
            return
        if not self.harmless(node):
            self.poison(key)

    def harmless(self, node: ast.AST) -> bool:
        up = self.parent(node)
        if isinstance(up, ast.Compare) or (
            isinstance(up, ast.Call) and call_name(up) in _READS and up.func is not node
        ):
            return True
        if isinstance(up, (ast.Attribute, ast.Subscript)) and up.value is node:
            if self_path(up, self.module) is not None:
                return True  # a longer path: checked on its own
            outer = self.parent(up)
            return not (isinstance(outer, ast.Call) and outer.func is up)  # self.x.run(h), self.x[i](h)
        return False

    def check_self(self, node: ast.AST) -> None:
        """``self`` handed anywhere but an attribute read or a reading builtin: anything may run."""
        up = self.parent(node)
        if isinstance(up, ast.Attribute):
            return
        if isinstance(up, ast.Call) and call_name(up) in _READS + ("super",):
            return
        if isinstance(up, ast.Call) and call_name(up) == "getattr" and len(up.args) >= 2:
            name = self.known.value(up.args[1], {})
            if not isinstance(name, str) or name in self.children or self.method_named(name) is not None:
                self.poison(name if name in self.children else None)  # a child, a method, or any name
            return
        self.poison(None)

    def check_alias(self, node: ast.AST) -> None:
        """``self._modules`` or an attribute holding modules in a list or dict (an alias of a child)."""
        attr = self_attr(node)
        if attr is None or attr in self.children:
            return
        if attr in ("_modules", "__dict__"):
            self.poison(None)
            return
        held = self.module.__dict__.get(attr)
        items = held.values() if isinstance(held, dict) else held if isinstance(held, (list, tuple, set)) else ()
        aliased = {id(m) for m in items if isinstance(m, nn.Module)}
        for name, child in self.children.items():
            if aliased & {id(m) for m in child.modules()}:
                self.poison(name)

    def parent(self, node: ast.AST) -> Optional[ast.AST]:
        fn = parsed(self.reading[-1]) if self.reading else None
        return parents(fn).get(id(node)) if fn is not None else None

    def poison_in(self, node: ast.AST, env: dict[str, Any]) -> None:
        """Every submodule ``node`` mentions (loop variables included) or may run through a method."""
        for sub in ast.walk(node):
            if is_self(sub) and not isinstance(self.parent(sub), ast.Attribute):
                self.poison(None)
            path = self_path(sub, self.module)
            if path is not None:
                self.poison(path)
            elif isinstance(sub, ast.Name) and isinstance(env.get(sub.id), (Member, Index, Alias)):
                held = env[sub.id]
                self.poison(None if isinstance(held, Index) else held.path)
            elif self_attr(sub) is not None and self.method(sub) is not None:
                self.poison(None)  # a method may run anything
            else:
                self.check_alias(sub)

    def shadow(self, read: Callable[[], Paths]) -> None:
        """The branch the model's structure does not take, read too: a child it runs a data-dependent
        number of times is unproven. Its calls do not set the arguments children are read with."""
        saved = {k: list(v) for k, v in self.call_args.items()}
        paths = read()
        self.call_args = saved
        for key in set().union(*paths) if paths else ():
            if len({p.get(key, 0) for p in paths}) > 1:
                self.poison(key)

    # --- statements ---------------------------------------------------------------------------------
    def body(self, stmts: list[ast.stmt], env: dict[str, Any], paths: Steps) -> Steps:
        """Paths after ``stmts``. A path that raises is dropped (no step runs)."""
        for stmt in stmts:
            live = [counts for counts, done in paths if not done]
            if not live:
                break
            after = self.stmt(stmt, env)
            merged = {(frozenset(c.items()), True): (c, True) for c, done in paths if done}
            for counts in live:
                for more, done in after:
                    total = _add(counts, more)
                    merged[(frozenset(total.items()), done)] = (total, done)
            paths = list(merged.values())
            if len(paths) > MAX_PATHS:
                raise Unprovable
        return paths

    def stmt(self, stmt: ast.stmt, env: dict[str, Any]) -> Steps:
        """Paths through one statement: (counts, whether it returns)."""
        if isinstance(stmt, ast.If):
            return self.if_stmt(stmt, env)
        if isinstance(stmt, ast.For):
            return [(c, False) for c in self.for_stmt(stmt, env)]
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            return self.with_stmt(stmt, env)
        if isinstance(stmt, ast.Try):
            return self.try_stmt(stmt, env)
        if isinstance(stmt, ast.Raise):
            return []
        if isinstance(stmt, ast.Return):
            return [(c, True) for c in self.expr(stmt.value, env)]
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            path = self_path(stmt.value, self.module)
            if path is not None:  # a local name for a submodule: its uses are checked
                self.rebind(stmt.targets[0].id, env)
                env[stmt.targets[0].id] = Alias(path)
                return [(Counter(), False)]
        if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)):
            paths = self.expr(stmt.value, env)
            self.assign(stmt, env)
            return [(c, False) for c in paths]
        if isinstance(stmt, ast.Assert):
            return [(c, False) for c in self.expr(stmt.test, env)]
        if returns([stmt]):
            raise Unprovable  # a return inside a while or match: paths the proof does not follow
        self.poison_in(stmt, env)  # while, match, a nested def or class: uncounted
        for name in assigned_names([stmt]):
            self.rebind(name, env)
        return [(Counter(), False)]

    def assign(self, stmt: ast.stmt, env: dict[str, Any]) -> None:
        """Track a local bound to a known value (``aa = getattr(self, "aa", None)``)."""
        for name in assigned_names([stmt]):
            self.rebind(name, env)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            got = self.known.value(stmt.value, env)
            if got is not UNKNOWN:
                env[stmt.targets[0].id] = got

    def if_stmt(self, stmt: ast.If, env: dict[str, Any]) -> Steps:
        test = self.known.value(stmt.test, env)
        starts = [(c, False) for c in self.expr(stmt.test, env)]
        if test is not UNKNOWN:  # the model's structure: the same branch on every rank
            untaken = stmt.orelse if test else stmt.body
            self.shadow(lambda: [c for c, _ in self.body(untaken, dict(env), [(Counter(), False)])])
            return self.body(stmt.body if test else stmt.orelse, env, starts)
        branches = self.body(stmt.body, dict(env), starts) + self.body(stmt.orelse, dict(env), starts)
        for name in assigned_names(stmt.body + stmt.orelse):
            self.rebind(name, env)
        return branches

    def with_stmt(self, stmt: ast.With | ast.AsyncWith, env: dict[str, Any]) -> Steps:
        paths = [Counter()]
        for item in stmt.items:
            paths = sequence(paths, self.expr(item.context_expr, env))
        after = self.body(stmt.body, env, [(c, False) for c in paths])
        if all(call_name(item.context_expr) in _TRANSPARENT for item in stmt.items):
            return after
        if returns(stmt.body):  # a context manager may swallow an exception and skip the rest
            raise Unprovable
        for counts, _ in after:
            for key in counts:
                self.poison(key)
        return after

    def try_stmt(self, stmt: ast.Try, env: dict[str, Any]) -> Steps:
        """An exception caught part way through the body: what the body runs is uncounted."""
        if not stmt.handlers:
            return self.body(stmt.body + stmt.orelse + stmt.finalbody, env, [(Counter(), False)])
        if returns(stmt.body + stmt.handlers + stmt.orelse):
            raise Unprovable
        for part in stmt.body + stmt.handlers + stmt.orelse:
            self.poison_in(part, env)
        for name in assigned_names(stmt.body + stmt.handlers + stmt.orelse):
            self.rebind(name, env)
        return self.body(stmt.finalbody, env, [(Counter(), False)])

    # --- the verdict --------------------------------------------------------------------------------
    def proven(self, entry: Callable, args: dict[str, Any]) -> set[str]:
        """Keys every path runs alike and nothing poisoned, expanded: ``"a"``, ``"a.b"``, ``"a[*]"``."""
        fn = parsed(entry)
        self.reading.append(entry)
        try:
            paths = [counts for counts, _ in self.body(fn.body, dict(args), [(Counter(), False)])]
        except Unprovable:
            return set()
        finally:
            self.reading.pop()
        keys = set().union(*paths) if paths else set()
        for key in keys:
            if len({p.get(key, 0) for p in paths}) > 1:  # a member run on some paths only: its holder too
                self.poison(key)
        return {name for key in keys if top_child(key) not in self.poisoned for name in self.expand(key)}

    def expand(self, key: str) -> set[str]:
        if key == "*":
            return set(self.children)
        if key.endswith("#"):
            return {n for n in self.children if re.fullmatch(re.escape(key[:-1]) + r"\d+", n)}
        path = key[:-3] if key.endswith("[*]") else key
        parts = path.split(".")
        return {".".join(parts[: i + 1]) for i in range(len(parts))} | {key}
