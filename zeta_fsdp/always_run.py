"""Which modules a forward provably runs the same number of times on every call, read from source.

FSDP2 all-gathers a unit's parameters when the unit's forward starts. A unit that one rank skips
in a step (an expert no token reached, a tower for a batch without images) misses collectives the
other ranks join: a hang, an abort, or tensors paired with the wrong ones (wrong gradients). So a
block may be its own unit only when we can PROVE that its forward runs on every rank, every step,
and as many times on each.

The proof counts, for every path through a ``forward``, how many times each child runs, and a child
is proven when every path runs it the same number of times (at least once). Paths split where a
condition depends on the data (``if mask.any():``, ``x if image is None else ...``). A condition
on the model's own settings (``self.grad_checkpointing``, ``self.norm is not None``,
``getattr(self, "aa", None)``, a method's default argument such as ``pre_logits=False``) is read
from the model as it is when planned: it is the same on every rank. What counts as a run:
``self.x(...)``; every member of ``self.blocks`` for ``self.blocks(...)`` on an ``nn.Sequential``,
for ``for b in self.blocks: x = b(x)`` (also ``.values()``, ``.items()``, ``enumerate``,
``self.children()``, ``range(len(self.blocks))`` with ``self.blocks[i]``, ``getattr(self, f"b{i}")``
over ``range(n)`` with ``n`` members) and for ``checkpoint`` / ``checkpoint_seq``. Methods of the
module (``self.forward_features(x)``) are read as if written in place.

Anything else makes the child unproven: a source that cannot be read (a class made by ``exec``), a
child handed to a helper function or to a local name, a method of a child (``self.stack.run_some``),
a comprehension, lambda or ``while`` loop that mentions it, a loop over data (``range(k(x))``, the
ids a router hit) or with ``break`` / ``continue`` / ``return`` in it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from collections import Counter
from typing import Any, Callable, Optional

import torch.nn as nn

__all__ = ["always_run"]

_UNKNOWN = object()  # a value the proof cannot know (it depends on the data or on the caller)
_MAX_PATHS = 256  # more paths than this through one forward: prove nothing rather than guess
_MAX_DEPTH = 8  # methods read in place, nested
_FIXED = (bool, int, float, str, type(None), tuple, nn.Module)  # values the same on every rank
_COMPARE = {
    ast.Is: lambda a, b: a is b,
    ast.IsNot: lambda a, b: a is not b,
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
}
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda)


class _TooManyPathsError(Exception):
    """Too many paths to count: nothing in this forward is proven."""


class _Member:
    """A loop variable bound to one member of ``container`` per iteration (``None``: of the module)."""

    def __init__(self, container: Optional[str]) -> None:
        self.container = container


class _Index:
    """A loop variable counting ``0 .. bound - 1``."""

    def __init__(self, bound: int) -> None:
        self.bound = bound


@functools.cache
def _parsed(function: Callable) -> Optional[ast.FunctionDef]:
    """The parsed ``function`` (``None`` when its source cannot be read: ``exec``, a builtin)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body else None
    return fn if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


@functools.cache
def _parents(fn: ast.AST) -> dict[int, ast.AST]:
    return {id(child): node for node in ast.walk(fn) for child in ast.iter_child_nodes(node)}


def _self_attr(node: ast.AST) -> Optional[str]:
    """``attr`` when ``node`` is ``self.attr``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def _call_name(node: ast.AST) -> Optional[str]:
    """``f`` for ``f(...)`` or ``a.b.f(...)``."""
    if not isinstance(node, ast.Call):
        return None
    return getattr(node.func, "id", None) or getattr(node.func, "attr", None)


def _assigned_names(stmts: list[ast.stmt]) -> set[str]:
    return {n.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _add(a: Counter, b: Counter) -> Counter:
    out = Counter(a)
    out.update(b)
    return out


def _ab(a: Counter, b: Counter, returns: bool) -> tuple[Counter, bool]:
    return _add(a, b), returns


def _sequence(firsts: list[Counter], thens: list[Counter]) -> list[Counter]:
    """Every path of ``firsts`` followed by every path of ``thens`` (duplicates merged)."""
    out = {frozenset(c.items()): c for c in (_add(a, b) for a in firsts for b in thens)}
    if len(out) > _MAX_PATHS:
        raise _TooManyPathsError
    return list(out.values())


class _Proof:
    """Counts the runs of ``module``'s children along every path of its ``forward``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.children = dict(module.named_children())
        self.poisoned: set[str] = set()  # children run in a way the proof cannot count
        self.reading: list[Callable] = []  # the methods being read, outermost first
        # per child, the arguments known at each call of it (a flag such as pre_logits=False)
        self.call_args: dict[str, list[dict[str, Any]]] = {}

    # --- values fixed by the model -------------------------------------------------------------
    def value(self, node: ast.AST, env: dict[str, Any]) -> Any:
        """The value of ``node`` when it is the same on every rank, else ``_UNKNOWN``."""
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            got = env.get(node.id, _UNKNOWN)
            return _UNKNOWN if isinstance(got, (_Member, _Index)) else got
        if isinstance(node, ast.Attribute):
            base = self.module if (isinstance(node.value, ast.Name) and node.value.id == "self") else None
            base = base if base is not None else self.value(node.value, env)
            if not isinstance(base, nn.Module):
                return _UNKNOWN
            got = getattr(base, node.attr, _UNKNOWN)
            return got if isinstance(got, _FIXED) else _UNKNOWN
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            got = self.value(node.operand, env)
            return _UNKNOWN if got is _UNKNOWN else not got
        if isinstance(node, ast.BoolOp):
            return self._bool_op(node, env)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
            left, right = self.value(node.left, env), self.value(node.comparators[0], env)
            if left is _UNKNOWN or right is _UNKNOWN:
                return _UNKNOWN
            try:
                return bool(_COMPARE[type(node.ops[0])](left, right))
            except Exception:  # noqa: BLE001 - a comparison we cannot evaluate is simply unknown
                return _UNKNOWN
        if isinstance(node, ast.Call):
            return self._call_value(node, env)
        return _UNKNOWN

    def _bool_op(self, node: ast.BoolOp, env: dict[str, Any]) -> Any:
        values = [self.value(v, env) for v in node.values]
        decisive = (lambda v: not v) if isinstance(node.op, ast.And) else bool
        if any(v is not _UNKNOWN and decisive(v) for v in values):
            return isinstance(node.op, ast.Or)  # some operand decides it, whatever the unknown ones are
        return _UNKNOWN if _UNKNOWN in values else isinstance(node.op, ast.And)

    def _call_value(self, node: ast.Call, env: dict[str, Any]) -> Any:
        name = _call_name(node)
        if name in ("is_scripting", "is_tracing") and not node.args:
            return False  # torch.jit: never under FSDP2
        on_self = node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
        if name in ("getattr", "hasattr") and on_self and len(node.args) in (2, 3):
            attr = self.value(node.args[1], env)
            if not isinstance(attr, str):
                return _UNKNOWN
            if name == "hasattr":
                return hasattr(self.module, attr)
            default = self.value(node.args[2], env) if len(node.args) == 3 else _UNKNOWN
            got = getattr(self.module, attr, default)
            return got if isinstance(got, _FIXED) else _UNKNOWN
        return _UNKNOWN

    # --- what an expression runs ---------------------------------------------------------------
    def expr(self, node: Optional[ast.AST], env: dict[str, Any]) -> list[Counter]:
        """The counts of children run by evaluating ``node``, one per path through it."""
        if node is None:
            return [Counter()]
        if isinstance(node, ast.IfExp):
            test = self.value(node.test, env)
            if test is not _UNKNOWN:
                self.shadow(lambda: self.expr(node.orelse if test else node.body, dict(env)))
                return self.expr(node.body if test else node.orelse, env)
            return _sequence(self.expr(node.test, env), self.expr(node.body, env) + self.expr(node.orelse, env))
        if isinstance(node, ast.BoolOp):
            paths = self.expr(node.values[0], env)
            for later in node.values[1:]:  # may not be evaluated: whatever it runs is uncounted
                self.poison_in(later)
            return paths
        if isinstance(node, _COMPREHENSIONS):
            self.poison_in(node)
            return [Counter()]
        if isinstance(node, ast.Call):
            return self.call(node, env)
        self.check_mention(node, env)
        paths = [Counter()]
        for child in ast.iter_child_nodes(node):
            paths = _sequence(paths, self.expr(child, env))
        return paths

    def call(self, node: ast.Call, env: dict[str, Any]) -> list[Counter]:
        """Paths through a call: its arguments, then what it runs."""
        runs, consumed = self.callee(node, env)
        paths = [Counter()]
        if not consumed or consumed is not node.func:
            func_parts = [node.func.value] if isinstance(node.func, ast.Attribute) else [node.func]
            for part in func_parts:
                if part is not consumed:
                    paths = _sequence(paths, self.expr(part, env))
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            if arg is not consumed:
                paths = _sequence(paths, self.expr(arg, env))
        return _sequence(paths, runs)

    def callee(self, node: ast.Call, env: dict[str, Any]) -> tuple[list[Counter], Optional[ast.AST]]:
        """(paths of what the call itself runs, the node naming it, which is not a mention to check)."""
        name = _call_name(node)
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
        method = self.method(node.func)
        if method is not None:
            return self.read_method(method, node, env), node.func
        return [Counter()], None

    def run_key(self, target: ast.AST, env: dict[str, Any]) -> Optional[str]:
        """The key of the child that calling ``target`` runs: ``"x"``, ``"x[*]"`` (one member of
        ``x`` per loop iteration, or every member of an ``nn.Sequential``), ``"b#"`` (``getattr(self,
        f"b{i}")``), ``"*"`` (one child of the module per iteration); ``None`` when it is no child."""
        attr = _self_attr(target)
        if attr is not None and attr in self.children:
            child = self.children[attr]
            return f"{attr}[*]" if type(child).forward is nn.Sequential.forward else attr
        if isinstance(target, ast.Name) and isinstance(env.get(target.id), _Member):
            container = env[target.id].container
            return "*" if container is None else f"{container}[*]"
        if isinstance(target, ast.Subscript):
            index, holder = self.value_or_loop(target.slice, env), _self_attr(target.value)
            held = self.children.get(holder or "")
            if isinstance(index, _Index) and isinstance(held, (nn.ModuleList, nn.Sequential)):
                return f"{holder}[*]" if len(held) == index.bound else None
        prefix = _getattr_prefix(target)
        if prefix is not None:
            index = target.args[1].values[1].value  # i or i + k in f"b{...}"
            offset = 0
            if isinstance(index, ast.BinOp) and isinstance(index.op, ast.Add) and isinstance(index.right, ast.Constant):
                index, offset = index.left, index.right.value
            loop = self.value_or_loop(index, env)
            if isinstance(loop, _Index) and type(offset) is int:
                names = {f"{prefix}{i + offset}" for i in range(loop.bound)}
                matching = {n for n in self.children if re.fullmatch(re.escape(prefix) + r"\d+", n)}
                return f"{prefix}#" if names == matching else None
        return None

    def value_or_loop(self, node: ast.AST, env: dict[str, Any]) -> Any:
        return env.get(node.id, _UNKNOWN) if isinstance(node, ast.Name) else self.value(node, env)

    def sequence_keys(self, node: ast.AST) -> Optional[list[str]]:
        """The children a ``checkpoint_seq`` argument runs once each (``None``: not one we can name)."""
        attr = _self_attr(node)
        if attr in self.children and isinstance(self.children[attr], (nn.Sequential, nn.ModuleList)):
            return [f"{attr}[*]"]
        if isinstance(node, (ast.List, ast.Tuple)):
            names = [_self_attr(e) for e in node.elts]
            return names if all(n in self.children for n in names) else None
        return None

    def method(self, func: ast.AST) -> Optional[Callable]:
        """The plain function behind ``self.name`` when ``name`` is a method of the module's own
        class (not one of ``nn.Module``'s)."""
        attr = _self_attr(func)
        if attr is None or attr in self.children:
            return None
        function = inspect.getattr_static(type(self.module), attr, None)
        if not inspect.isfunction(function) or getattr(nn.Module, attr, None) is function:
            return None
        return function

    def read_method(self, function: Callable, node: ast.Call, env: dict[str, Any]) -> list[Counter]:
        """Paths through ``self.method(...)``: its body read in place, its arguments bound where known."""
        fn = _parsed(function)
        if fn is None or function in self.reading or len(self.reading) >= _MAX_DEPTH:
            for name in self.children:  # unreadable or recursive: whatever it runs is uncounted
                self.poisoned.add(name)
            return [Counter()]
        self.reading.append(function)
        try:
            return [counts for counts, _ in self.body(fn.body, self.bind(function, node, env), [(Counter(), False)])]
        finally:
            self.reading.pop()

    def bind(self, function: Callable, node: ast.Call, env: dict[str, Any]) -> dict[str, Any]:
        """The method's parameters known at this call: constants, model settings, defaults."""
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return {}
        try:
            params = list(inspect.signature(function).parameters.values())[1:]  # after self
        except (TypeError, ValueError):  # a builtin
            return {}
        bound: dict[str, Any] = {}
        for param, arg in zip(params, node.args):
            bound[param.name] = self.value_or_loop(arg, env)
        for keyword in node.keywords:
            bound[keyword.arg] = self.value_or_loop(keyword.value, env)
        for param in params:
            if param.name not in bound and param.default is not inspect.Parameter.empty:
                bound[param.name] = param.default if isinstance(param.default, _FIXED) else _UNKNOWN
        return {k: v for k, v in bound.items() if v is not _UNKNOWN}

    def shadow(self, read: Callable[[], list[Counter]]) -> None:
        """The branch a setting does not take now, read too: a user may flip the setting later (on
        every rank alike), so a child that branch runs a data-dependent number of times is unproven.
        The calls it makes do not count as calls (their arguments are not the ones used now)."""
        saved = {k: list(v) for k, v in self.call_args.items()}
        paths = read()
        self.call_args = saved
        for key in set().union(*paths) if paths else ():
            if len({p.get(key, 0) for p in paths}) > 1:
                self.poisoned.add(_child_of(key, self.children))

    # --- mentions the proof cannot count ---------------------------------------------------------
    def check_mention(self, node: ast.AST, env: dict[str, Any]) -> None:
        """Poison a child mentioned where it may run uncounted: handed to a call or a name, or a
        method of it called. Reading it (``self.x.weight``, ``len(self.x)``, ``self.x is None``) is fine."""
        attr = _self_attr(node)
        if isinstance(node, ast.Name) and isinstance(env.get(node.id), _Member):
            attr = env[node.id].container  # a loop's member: its container
            attr = attr if attr is not None else "*"
        if attr is None or (attr not in self.children and attr != "*") or self.reading_harmless(node):
            return
        self.poisoned.update(self.children if attr == "*" else [attr])

    def reading_harmless(self, node: ast.AST) -> bool:
        fn = _parsed(self.reading[-1]) if self.reading else None
        up = _parents(fn).get(id(node)) if fn is not None else None
        if isinstance(up, ast.Compare) or (isinstance(up, ast.Call) and _call_name(up) in ("len", "isinstance")):
            return True
        if isinstance(up, (ast.Attribute, ast.Subscript)) and up.value is node:
            outer = _parents(fn).get(id(up))
            return not (isinstance(outer, ast.Call) and outer.func is up)  # self.x.run(h), self.x[0](h)
        return False

    def poison_in(self, node: ast.AST) -> None:
        """Every child ``node`` mentions, and every child's members reached by a loop variable."""
        for sub in ast.walk(node):
            attr = _self_attr(sub)
            if attr in self.children:
                self.poisoned.add(attr)
            elif self.method(sub) is not None:
                self.poisoned.update(self.children)  # a method may run anything

    # --- statements -------------------------------------------------------------------------------
    def body(
        self, stmts: list[ast.stmt], env: dict[str, Any], paths: list[tuple[Counter, bool]]
    ) -> list[tuple[Counter, bool]]:
        """Paths after ``stmts``: (counts, returned). A path that raises is dropped (no step runs)."""
        for stmt in stmts:
            live = [counts for counts, done in paths if not done]
            if not live:
                break
            ended = [(counts, True) for counts, done in paths if done]
            after = self.stmt(stmt, env)
            merged = {(frozenset(c.items()), done): (c, done) for c, done in ended}
            merged.update(
                ((frozenset(s.items()), r), (s, r)) for s, r in (_ab(c, more, r) for c in live for more, r in after)
            )
            paths = list(merged.values())
            if len(paths) > _MAX_PATHS:
                raise _TooManyPathsError
        return paths

    def stmt(self, stmt: ast.stmt, env: dict[str, Any]) -> list[tuple[Counter, bool]]:
        """Paths through one statement: (counts, whether it returns)."""
        start = [(Counter(), False)]
        if isinstance(stmt, ast.If):
            return self.if_stmt(stmt, env)
        if isinstance(stmt, ast.For):
            return [(c, False) for c in self.for_stmt(stmt, env)]
        if isinstance(stmt, (ast.With, ast.AsyncWith)):
            paths = [Counter()]
            for item in stmt.items:
                paths = _sequence(paths, self.expr(item.context_expr, env))
            return self.body(stmt.body, env, [(c, False) for c in paths])
        if isinstance(stmt, ast.Try):
            for handler in stmt.handlers:
                self.poison_in(handler)
            return self.body(stmt.body + stmt.orelse + stmt.finalbody, env, start)
        if isinstance(stmt, ast.Raise):
            return []
        if isinstance(stmt, ast.Return):
            return [(c, True) for c in self.expr(stmt.value, env)]
        if isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)):
            paths = self.expr(stmt.value, env)
            self.assign(stmt, env)
            return [(c, False) for c in paths]
        if isinstance(stmt, ast.Assert):
            return [(c, False) for c in self.expr(stmt.test, env)]
        self.poison_in(stmt)  # while, match, a nested def or class: uncounted
        for name in _assigned_names([stmt]):
            env.pop(name, None)
        return start

    def assign(self, stmt: ast.stmt, env: dict[str, Any]) -> None:
        """Track a local bound to a value fixed by the model (``aa = getattr(self, "aa", None)``)."""
        for name in _assigned_names([stmt]):
            env.pop(name, None)
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            got = self.value(stmt.value, env)
            if got is not _UNKNOWN:
                env[stmt.targets[0].id] = got

    def if_stmt(self, stmt: ast.If, env: dict[str, Any]) -> list[tuple[Counter, bool]]:
        test = self.value(stmt.test, env)
        if test is not _UNKNOWN:  # fixed by the model: the same branch on every rank
            untaken = stmt.orelse if test else stmt.body
            self.shadow(lambda: [c for c, _ in self.body(untaken, dict(env), [(Counter(), False)])])
            return self.body(stmt.body if test else stmt.orelse, env, [(Counter(), False)])
        starts = [(c, False) for c in self.expr(stmt.test, env)]
        branches = self.body(stmt.body, dict(env), starts) + self.body(stmt.orelse, dict(env), starts)
        for name in _assigned_names(stmt.body + stmt.orelse):
            env.pop(name, None)
        return branches

    def for_stmt(self, stmt: ast.For, env: dict[str, Any]) -> list[Counter]:
        """Paths through a loop over every member of a container, or a fixed ``range``."""
        loop = self.loop_of(stmt, env)
        assigned = _assigned_names(stmt.body) | _assigned_names([stmt])
        for name in assigned:
            env.pop(name, None)
        iter_paths = self.expr(stmt.iter, env) if loop is None or loop[1] is None else [Counter()]
        if loop is None or stmt.orelse or _exits(stmt.body):
            self.poison_in(stmt)
            return iter_paths
        bindings, times = loop
        inner = dict(env, **bindings)
        per_iteration = [counts for counts, _ in self.body(stmt.body, inner, [(Counter(), False)])]
        total: Counter = Counter()
        for key in set().union(*per_iteration):
            counts = {c.get(key, 0) for c in per_iteration}
            if len(counts) > 1:  # different runs in different iterations or ranks: uncounted
                self.poisoned.add(_child_of(key, self.children))
            elif key.endswith(("[*]", "#")) or key == "*":
                total[key] = counts.pop()  # a different member each iteration: each runs this often
            else:
                total[key] = counts.pop() * times
        for name in assigned:
            env.pop(name, None)
        return _sequence(iter_paths, [total])

    def loop_of(self, stmt: ast.For, env: dict[str, Any]) -> Optional[tuple[dict[str, Any], Optional[int]]]:
        """(names the loop binds, iterations) for a loop over every member of a child container
        (iterations ``None``: as many as members) or over ``range(n)`` with ``n`` fixed; else ``None``."""
        it, target = stmt.iter, stmt.target
        names = [n.id for n in (target.elts if isinstance(target, ast.Tuple) else [target]) if isinstance(n, ast.Name)]
        if _call_name(it) == "enumerate" and len(it.args) == 1:
            it, names = it.args[0], names[1:]
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("values", "items"):
            it, names = it.func.value, names[-1:]
        if isinstance(it, ast.Call) and _self_attr(it.func) == "children" and not it.args:
            return ({n: _Member(None) for n in names[-1:]}, len(self.children))
        container = _self_attr(it)
        held = self.children.get(container or "")
        if isinstance(held, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            return ({n: _Member(container) for n in names[-1:]}, len(held))
        if _call_name(it) == "range" and len(it.args) == 1 and isinstance(target, ast.Name):
            bound = self.value(it.args[0], env)
            if isinstance(it.args[0], ast.Call) and _call_name(it.args[0]) == "len" and len(it.args[0].args) == 1:
                holder = self.children.get(_self_attr(it.args[0].args[0]) or "")
                bound = len(holder) if holder is not None else _UNKNOWN
            if type(bound) is int:
                return ({target.id: _Index(bound)}, bound)
        return None

    # --- the verdict ------------------------------------------------------------------------------
    def proven(self, forward: Callable, args: dict[str, Any]) -> set[str]:
        """Names of the children every path runs equally often, ``"x[*]"`` for a container whose every
        member runs; ``args``: the forward's arguments known at every call of the module."""
        fn = _parsed(forward)
        self.reading.append(forward)
        try:
            paths = [counts for counts, _ in self.body(fn.body, dict(args), [(Counter(), False)])]
        except _TooManyPathsError:
            return set()
        finally:
            self.reading.pop()
        if not paths:
            return set()
        proven: set[str] = set()
        for key in set().union(*paths):
            if len({p.get(key, 0) for p in paths}) != 1 or _child_of(key, self.children) in self.poisoned:
                continue
            proven |= self.expand(key)
        return proven

    def known_args(self, child: str) -> dict[str, Any]:
        """The arguments of ``child``'s forward that every call of it passes alike (defaults included)."""
        calls = self.call_args.get(child, [])
        if not calls:
            return {}
        return {k: v for k, v in calls[0].items() if all(k in c and _same(c[k], v) for c in calls[1:])}

    def expand(self, key: str) -> set[str]:
        if key == "*":
            return set(self.children)
        if key.endswith("#"):
            return {n for n in self.children if re.fullmatch(re.escape(key[:-1]) + r"\d+", n)}
        if key.endswith("[*]"):
            return {key[:-3], key}
        return {key}


def _exits(stmts: list[ast.stmt]) -> bool:
    """A ``return`` / ``yield`` in ``stmts``, or a ``break`` / ``continue`` of this loop (not of a
    nested one), outside nested functions and classes."""
    todo = [(s, False) for s in stmts]
    while todo:
        node, nested = todo.pop()
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom)):
            return True
        if isinstance(node, (ast.Break, ast.Continue)) and not nested:
            return True
        if not isinstance(node, _SCOPES):
            inner = nested or isinstance(node, (ast.For, ast.While))
            todo.extend((child, inner) for child in ast.iter_child_nodes(node))
    return False


def _child_of(key: str, children: dict[str, nn.Module]) -> str:
    return key[:-3] if key.endswith("[*]") else key.rstrip("#")


def _getattr_prefix(node: ast.AST) -> Optional[str]:
    """``p`` for ``getattr(self, f"p{i}")``."""
    if not (isinstance(node, ast.Call) and _call_name(node) == "getattr" and len(node.args) == 2):
        return None
    if not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
        return None
    text = node.args[1]
    parts = text.values if isinstance(text, ast.JoinedStr) else []
    if len(parts) == 2 and isinstance(parts[0], ast.Constant) and isinstance(parts[1], ast.FormattedValue):
        return str(parts[0].value)
    return None


# Forwards trusted to run every child on every rank: wrappers that call the model they hold (PEFT's
# PeftModel/LoraModel; a LightningModule, whose training_step, not forward, calls its model), and
# Hugging Face's modeling code, whose conditions are on the call's arguments (`inputs_embeds is None`),
# the same on every rank (its LayerDrop is the documented exception: docs/pitfalls.md).
_PASS_THROUGH = ("peft.", "lightning.", "pytorch_lightning.", "transformers.")


def _passes_through(forward: Callable) -> bool:
    return any((getattr(forward, "__module__", None) or "").startswith(p) for p in _PASS_THROUGH)


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and not isinstance(a, nn.Module) and a == b)


def _proven_children(module: nn.Module, args: dict[str, Any]) -> tuple[set[str], Optional[str], Callable]:
    """(names of the children ``module.forward`` runs equally often on every path, with containers
    whose every member it runs marked ``"name[*]"``; why the others are not proven; the arguments
    each child's forward is called with, where known)."""
    children = {n for n, _ in module.named_children()}
    forward = type(module).forward
    if forward is nn.Sequential.forward:
        return children, None, lambda _: {}
    if forward is nn.Module.forward:  # nn.ModuleList / nn.ModuleDict: their holder calls the members
        return set(), f"{type(module).__name__} has no forward", lambda _: {}
    if _passes_through(forward):
        return children, None, lambda _: {}
    if _parsed(forward) is None:
        return set(), f"the source of {type(module).__name__}.forward cannot be read", lambda _: {}
    proof = _Proof(module)
    proven = proof.proven(forward, args)
    return proven, f"{type(module).__name__}.forward does not provably call it on every run", proof.known_args


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
    proven, why = {id(model)}, {}
    # (name, module, whether its holder runs each of its members, its forward's known arguments)
    todo: list[tuple[str, nn.Module, bool, dict[str, Any]]] = [("", model, False, {})]
    while todo:
        name, module, every_member, args = todo.pop()
        if every_member:
            called, reason, args_of = {n for n, _ in module.named_children()}, None, lambda _: {}
        else:
            called, reason, args_of = _proven_children(module, args)
        for child_name, child in module.named_children():
            path = f"{name}.{child_name}" if name else child_name
            if child_name in called:
                proven.add(id(child))
                todo.append((path, child, child_name + "[*]" in called, args_of(child_name)))
            elif any(True for _ in child.parameters()):
                why[path] = reason or "not called"
    return proven, why
