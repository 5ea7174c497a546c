"""Evidence that a forward may skip a module on some ranks in a step: such a module never becomes a
unit (a unit one rank skips misses collectives its peers join), and naming it is refused.

Evidence only; code that cannot be read is trusted (the run-time check, ``divergence``, catches the rest):
- experts: a container named ``expert...`` (the members a router picks per token);
- a readable call under a condition on the data: in a ``forward`` (or a module-level helper it hands
  ``self`` or a child to), a child that runs only in one branch of a test reading the call's arguments
  (or something computed from them, or a random draw), inside a loop over data, or after a
  data-dependent ``return`` / ``continue`` / ``break``: a router's ``if mask.any()``, an optional
  tower's ``if image is not None``, stochastic depth's ``if torch.rand(()) < p: continue``;
- a Hugging Face multimodal language model's towers (``modality_towers``); Hugging Face forwards are
  otherwise trusted (their conditions read the call's options, alike on every rank; LayerDrop is refused
  by ``fsdp()`` from the config).
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
import textwrap
from typing import Callable, Optional

import torch.nn as nn

from .tree import declared_blocks, is_hugging_face, is_under, members_of

__all__ = [
    "check_layerdrop",
    "modality_towers",
    "runnable_blocks",
    "skip_evidence",
    "skippable_modules",
    "skippable_note",
]

_EXPERTS = re.compile(r"expert", re.IGNORECASE)
_TOWER = re.compile(r"(vision|visual|image|audio|video|speech|multi_modal|mm_)", re.IGNORECASE)
_RANDOM = {"rand", "rand_like", "randn", "randn_like", "random", "randint", "randperm", "multinomial", "bernoulli"}
_RANDOM |= {"uniform", "uniform_", "normal_", "bernoulli_", "exponential_", "random_", "sample", "choice", "shuffle"}
# Their forwards condition on the call's options (`adapter_names`, `output_hidden_states`), alike on every
# rank; what they may skip is known from configs (towers, LayerDrop) and structure (experts).
_TRUSTED_LIBRARIES = ("transformers.", "peft.")
_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_HELPER_DEPTH = 2  # helpers reached from a forward through helpers: enough for the dispatch code seen


@functools.cache
def _function_tree(fn: Callable) -> Optional[ast.FunctionDef]:
    """The parsed definition of ``fn`` (``None`` when it cannot be read: builtin, REPL, ``exec``)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    first = tree.body[0] if tree.body else None
    return first if isinstance(first, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _params(node: ast.FunctionDef) -> list[str]:
    a = node.args
    return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]]


class _Reader:
    """One function read as a module's forward: where each child is used and the conditions around it.

    ``selves``: names that stand for the module (``self``, or ``this``); ``aliases``: names that stand
    for a child (a helper's parameter handed ``self.layers``); ``children``: the module's child names.
    """

    def __init__(
        self, fn: ast.FunctionDef, owner: type, selves: set[str], aliases: dict[str, str], children: list[str]
    ):
        self.fn, self.owner, self.selves, self.aliases, self.children = fn, owner, selves, dict(aliases), children
        self.members: set[str] = set()  # aliases that stand for one member of a child (loop variables)
        self.indirect: dict[int, set[str]] = {}  # the children each call read on uses, by node id
        self.parents = {id(c): p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}
        self.data = self._data_names()

    def refs(self, node: ast.AST) -> set[str]:
        """The children ``node`` itself names: ``self.x``, an alias, ``getattr(self, "x")`` / ``f"x{i}"``."""
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in self.selves:
            return {node.attr} & set(self.children)
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return {self.aliases[node.id]}
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2:
            owner, key = node.args[0], node.args[1]
            if isinstance(owner, ast.Name) and owner.id in self.selves:
                prefix = key.value if isinstance(key, ast.Constant) else None
                if isinstance(key, ast.JoinedStr) and key.values and isinstance(key.values[0], ast.Constant):
                    prefix = key.values[0].value
                return {c for c in self.children if isinstance(prefix, str) and c.startswith(prefix)}
        return set()

    def uses(self, node: ast.AST, child: str) -> bool:
        """``node`` names ``child``, or calls a method or helper that uses it."""
        return child in self.refs(node) or child in self.indirect.get(id(node), ())

    def reads(self, node: ast.AST, names: set[str]) -> bool:
        return any(isinstance(n, ast.Name) and n.id in names or _attr_key(n) in names for n in ast.walk(node))

    def is_data(self, node: ast.AST) -> bool:
        """``node`` reads the call's arguments (or what was computed from them) or draws a random number
        (itself, or in a method of the module it calls: ``if self._drop(): continue``)."""
        return self.is_data_value(node, self.data) or any(self._draws(n) for n in ast.walk(node))

    def _draws(self, node: ast.AST) -> bool:
        func = node.func if isinstance(node, ast.Call) else None
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in self.selves):
            return False
        method = inspect.getattr_static(self.owner, func.attr, None)
        tree = _function_tree(method) if inspect.isfunction(method) else None
        return tree is not None and any(isinstance(n, ast.Call) and _callee_name(n) in _RANDOM for n in ast.walk(tree))

    def _data_names(self) -> set[str]:
        """The arguments (not ``self``, nor a flag with a constant default such as timm's ``pre_logits=False``),
        and every local or ``self.x`` assigned from them (a fixed point)."""
        data = set(_params(self.fn)) - self.selves - _options(self.fn) - set(self.aliases)  # a child is no data
        bindings = []
        for n in ast.walk(self.fn):
            if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.NamedExpr)) and n.value is not None:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                bindings.append((n.value, targets))
            elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
                bindings.append((n.iter, [n.target]))
        for _ in range(len(bindings) + 1):
            grown = {
                key
                for value, targets in bindings
                if self.is_data_value(value, data)
                for t in targets
                for key in _bound_names(t)
            }
            if grown <= data:
                return data
            data |= grown
        return data

    def is_data_value(self, value: ast.AST, data: set[str]) -> bool:
        random = any(isinstance(n, ast.Call) and _callee_name(n) in _RANDOM for n in ast.walk(value))
        return random or self.reads(value, data)

    def bind_members(self) -> None:
        """Loop variables over a child stand for one member of it in the loop's body: ``block`` in ``for block
        in self.blocks``, ``for i, block in enumerate(self.blocks)``, ``for name, block in self.blocks.items()``,
        ``for block, norm in zip(self.blocks, self.norms)`` (never the index ``i``, nor the key ``name``)."""
        for n in ast.walk(self.fn):
            if isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
                self._bind(n.target, n.iter)

    def _bind(self, target: ast.AST, source: ast.AST) -> None:
        call = source if isinstance(source, ast.Call) else None
        name = _callee_name(call) if call is not None else None
        if isinstance(target, ast.Tuple) and call is not None:
            if name == "enumerate" and call.args and len(target.elts) == 2:
                return self._bind(target.elts[1], call.args[0])
            if name == "items" and len(target.elts) == 2 and isinstance(call.func, ast.Attribute):
                return self._bind(target.elts[1], call.func.value)
            if name == "zip" and len(call.args) == len(target.elts):
                for element, arg in zip(target.elts, call.args):
                    self._bind(element, arg)
            return None
        if isinstance(call, ast.Call) and name == "values" and isinstance(call.func, ast.Attribute):
            source = call.func.value
        owners = {c for sub in ast.walk(source) for c in self.refs(sub)}
        if isinstance(target, ast.Name) and len(owners) == 1 and target.id not in self.aliases:
            self.aliases[target.id] = next(iter(owners))
            self.members.add(target.id)
        return None

    def why_conditional(self, use: ast.AST, child: str) -> Optional[str]:
        """How ``use`` may not run (or run a different number of times) on some ranks, if it may."""
        node = use
        while id(node) in self.parents:
            parent = self.parents[id(node)]
            why = self._guard(parent, node, child)
            if why:
                return why
            node = parent
        return self._after_exit(use)

    def _guard(self, parent: ast.AST, node: ast.AST, child: str) -> Optional[str]:
        if isinstance(parent, (ast.If, ast.IfExp, ast.While)) and node is not parent.test and self.is_data(parent.test):
            branches = (
                (parent.body, parent.orelse)
                if isinstance(parent, (ast.If, ast.While))
                else ([parent.body], [parent.orelse])
            )
            other = next((b for b in branches if not any(node is s for s in b)), [])
            if isinstance(parent, ast.While) or not any(self.uses(n, child) for s in other for n in ast.walk(s)):
                return f"under `{_line(parent.test)}`"
        if isinstance(parent, (ast.For, ast.AsyncFor)) and node is not parent.iter and node is not parent.target:
            if self.is_data(parent.iter):  # data, a random draw, or a slice of the blocks by either
                return f"in a loop over `{_line(parent.iter)}`"
        if isinstance(parent, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            for gen in parent.generators:
                if any(self.is_data(t) for t in gen.ifs) or self.is_data(gen.iter):
                    return f"in a comprehension over `{_line(gen.iter)}`"
        if isinstance(parent, ast.BoolOp) and node in parent.values[1:]:
            before = parent.values[: parent.values.index(node)]
            if any(self.is_data(v) for v in before):
                return f"after `{_line(before[0])}`"
        return None

    def _after_exit(self, use: ast.AST) -> Optional[str]:
        """A data-dependent ``continue`` / ``break`` in a loop around ``use`` (stochastic depth, a router)."""
        loops = set()
        node = use
        while id(node) in self.parents:
            node = self.parents[id(node)]
            if isinstance(node, _LOOPS):
                loops.add(id(node))
        for test in (n for n in ast.walk(self.fn) if isinstance(n, ast.If) and self.is_data(n.test)):
            for exit_ in (e for s in test.body for e in ast.walk(s) if isinstance(e, (ast.Continue, ast.Break))):
                loop = self._loop_of(exit_)
                if loop is not None and id(loop) in loops:
                    return f"after `if {_line(test.test)}: {type(exit_).__name__.lower()}`"
        return None

    def _loop_of(self, node: ast.AST) -> Optional[ast.AST]:
        while id(node) in self.parents:
            node = self.parents[id(node)]
            if isinstance(node, _LOOPS):
                return node
        return None


def _options(fn: ast.FunctionDef) -> set[str]:
    """Parameters with a bool, number or string default: settings of the call, alike on every rank (a
    ``None`` default may stand for an optional input: ``image=None``)."""
    a = fn.args
    pairs = [*zip(reversed(a.posonlyargs + a.args), reversed(a.defaults)), *zip(a.kwonlyargs, a.kw_defaults)]
    return {
        p.arg
        for p, d in pairs
        if isinstance(d, ast.Constant) and d.value is not None and isinstance(d.value, (bool, int, float, str))
    }


def _attr_key(node: ast.AST) -> Optional[str]:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def _bound_names(target: ast.AST) -> set[str]:
    """Names (and ``self.x`` keys) an assignment target binds."""
    keys = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return keys | {k for n in ast.walk(target) if (k := _attr_key(n))}


def _callee_name(call: ast.Call) -> Optional[str]:
    return getattr(call.func, "attr", None) or getattr(call.func, "id", None)


def _line(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _forward_of(module: nn.Module) -> Optional[Callable]:
    """The forward to read for ``module``'s children; ``None`` for torch's containers and for the forwards
    of Hugging Face and PEFT modules, trusted as a whole (``_TRUSTED_LIBRARIES``)."""
    forward = module.__dict__.get("forward") or type(module).forward
    forward = getattr(forward, "__func__", forward)
    if forward is nn.Module.forward or forward is nn.Sequential.forward:
        return None
    if (getattr(forward, "__module__", None) or "").startswith(_TRUSTED_LIBRARIES):
        return None
    return forward


def _conditional_children(
    fn: Callable, owner: type, selves: Optional[set[str]], aliases: dict[str, str], children: list[str], depth: int = 0
) -> tuple[dict[str, str], set[str]]:
    """(the children a call of ``fn`` may skip on some ranks: name -> why; every child it uses).

    ``fn``: ``owner``'s forward, one of its methods or a module-level helper it hands ``self`` or a child;
    a helper or method called under a condition on the data makes every child it uses conditional."""
    tree = _function_tree(fn)
    if tree is None:
        return {}, set()
    params = _params(tree)
    reader = _Reader(tree, owner, selves if selves is not None else set(params[:1]), aliases, children)
    reader.bind_members()
    calls = {}  # the calls read on, by node id: (callee, what it may skip, every child it uses)
    for node in ast.walk(tree):
        callee = _callee(fn, owner, node, reader) if depth < _HELPER_DEPTH else None
        if callee is not None:
            calls[id(node)] = (callee[0], *_conditional_children(*callee, children, depth + 1))
    reader.indirect = {key: used_there for key, (_, _, used_there) in calls.items()}
    found: dict[str, str] = {}
    used: set[str] = set()
    for node in ast.walk(tree):
        for child in reader.refs(node):
            used.add(child)
            why = reader.why_conditional(node, child)
            if why and child not in found:
                member = (
                    isinstance(reader.parents.get(id(node)), ast.Subscript) or getattr(node, "id", 0) in reader.members
                )
                what = "its members" if member else "it"
                found[child] = f"{fn.__qualname__} runs {what} {why}"
        if id(node) in calls:
            called, inner, inner_used = calls[id(node)]
            used |= inner_used
            for child in inner_used:  # the call is a use of every child the callee uses
                why = reader.why_conditional(node, child)
                if why:
                    found.setdefault(child, f"{fn.__qualname__} calls {called.__qualname__} {why}")
            for child, inner_why in inner.items():
                found.setdefault(child, inner_why)
    return found, used


def _callee(
    fn: Callable, owner: type, call: ast.AST, reader: _Reader
) -> Optional[tuple[Callable, type, set[str], dict[str, str]]]:
    """A call ``_conditional_children`` reads on: a method of the module (``self.encode(x)``), or a
    module-level function handed ``self`` or a child (``dispatch(self.experts, x)``)."""
    if not isinstance(call, ast.Call):
        return None
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in reader.selves:
        method = inspect.getattr_static(owner, func.attr, None)
        method = getattr(method, "__func__", method)  # staticmethod / classmethod
        if not inspect.isfunction(method) or func.attr in reader.children:
            return None
        tree = _function_tree(method)
        return (method, owner, set(_params(tree)[:1]), {}) if tree is not None else None
    helper = getattr(fn, "__globals__", {}).get(func.id) if isinstance(func, ast.Name) else None
    library = (getattr(helper, "__module__", None) or "").startswith(("torch.", *_TRUSTED_LIBRARIES))
    tree = _function_tree(helper) if inspect.isfunction(helper) and helper is not fn and not library else None
    if tree is None:
        return None
    selves, aliases = set(), {}
    for param, arg in zip(_params(tree), call.args):
        if isinstance(arg, ast.Name) and arg.id in reader.selves:
            selves.add(param)
        elif len(reader.refs(arg)) == 1:
            aliases[param] = next(iter(reader.refs(arg)))
    return (helper, owner, selves, aliases) if selves or aliases else None


def modality_towers(model: nn.Module) -> dict[str, str]:
    """The towers of a Hugging Face multimodal language model (``vision_tower``, ``visual``,
    ``audio_tower``, ``multi_modal_projector``, ... beside a ``language_model`` or ``lm_head``) by name,
    with why: its forward runs each only for batches that carry that input. Empty for other models
    (CLIP's towers run on every batch).

    Example:
        >>> modality_towers(nn.Linear(2, 2))
        {}
    """
    config = getattr(model, "config", None)
    if config is None or not is_hugging_face(model) or getattr(config, "text_config", None) is None:
        return {}
    names = [n.rsplit(".", 1)[-1] for n, _ in model.named_modules()]
    if "language_model" not in names and "lm_head" not in names:
        return {}  # contrastive (CLIP): every batch carries both inputs
    towers: dict[str, str] = {}
    for name, _ in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if name and _TOWER.match(last) and not any(name.startswith(t + ".") for t in towers):
            towers[name] = f"{type(model).__name__} runs its {last} only for batches that carry that input"
    return towers


def skippable_modules(model: nn.Module) -> dict[str, str]:
    """The modules a forward may skip on some ranks in a step, on evidence (the module docstring), by
    name with why. Neither they nor anything inside them becomes a unit.

    Example:
        >>> class MoE(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ffns = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
        ...     def forward(self, x, route):
        ...         for i, ffn in enumerate(self.ffns):
        ...             if (route == i).any():
        ...                 x = x + ffn(x)
        ...         return x
        >>> skippable_modules(MoE())
        {'ffns': 'MoE.forward runs its members under `(route == i).any()`'}
    """
    hugging_face = is_hugging_face(model)
    found = dict(modality_towers(model)) if hugging_face else {}
    for owner_name, owner in model.named_modules():
        if any(is_under(owner_name, [f]) for f in found):
            continue
        children = [n for n, _ in owner.named_children()]
        forward = None if hugging_face or not children else _forward_of(owner)
        why = _conditional_children(forward, type(owner), None, {}, children)[0] if forward is not None else {}
        for name, child in owner.named_children():
            path = f"{owner_name}.{name}" if owner_name else name
            if name in why:
                found[path] = why[name]
            elif isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) > 1 and _EXPERTS.search(name):
                found[path] = f"named {name!r}: the experts a router picks per token"
    return found


def skip_evidence(model: nn.Module, *, given: bool) -> dict[str, str]:
    """``skippable_modules`` as the plan uses it: a Hugging Face model's declared blocks
    (``_no_split_modules``) are trusted unless the user named the blocks, but for its optional towers."""
    skippable = skippable_modules(model)
    declared = tuple(declared_blocks(model))
    if given or not declared:
        return skippable
    towers = modality_towers(model)
    return {
        n: w
        for n, w in skippable.items()
        if n in towers or not any(isinstance(m, declared) for m in model.get_submodule(n).modules())
    }


def runnable_blocks(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], skippable: dict[str, str], *, given: bool, caller: str
) -> list[tuple[str, nn.Module]]:
    """``blocks`` without those inside a module a forward may skip (``skip_evidence``): a unit one rank
    skips would not join its collectives there. A ``TransformerBlock`` the user named there is refused."""
    skipped = members_of(model, skippable)
    bad = [name for name, module in blocks if id(module) in skipped]
    if bad and given:
        holder = next(c for c in skippable if is_under(bad[0], [c]))
        raise ValueError(
            f"{caller}(): TransformerBlock makes {bad[0]} an FSDP unit, but a forward may skip it on some ranks "
            f"({holder}: {skippable[holder]}). A rank that skips it would not join its unit's collectives: "
            "wrong gradients or a hang. Name the class of the layer that holds it (the MoE layer or block) "
            "instead, or run it on every rank in every step."
        )
    return [(name, module) for name, module in blocks if id(module) not in skipped]


def skippable_note(skippable: dict[str, str]) -> str:
    """The plan table's line on the modules a forward may skip (grouped by why)."""
    by_why: dict[str, list[str]] = {}
    for name, why in skippable.items():
        by_why.setdefault(why, []).append(name)
    parts = [
        f"{', '.join(names[:2])}{f' (+{len(names) - 2} more)' if len(names) > 2 else ''} ({why})"
        for why, names in by_why.items()
    ]
    return (
        "not units, as ranks may skip them in a step: "
        + "; ".join(parts)
        + ". They stay in the unit of the module holding them (an MoE layer is one unit, not its experts)"
    )


def _layerdrop_settings(model: nn.Module) -> list[str]:
    """Every LayerDrop probability above 0 the model holds, as Python on it (``model.config.layerdrop=0.1``,
    ``model.model.decoder.layerdrop=0.1``): a config's ``layerdrop``, ``encoder_layerdrop``, ...
    (sub-configs too) and the copies modules keep (``self.layerdrop``)."""
    found, seen = [], set()
    for name, module in model.named_modules():
        where = f"model.{name}" if name else "model"
        value = module.__dict__.get("layerdrop")
        if isinstance(value, (int, float)) and value > 0:
            found.append(f"{where}.layerdrop={value}")
        configs = [(f"{where}.config", module.__dict__.get("config"))]
        while configs:
            at, config = configs.pop()
            if config is None or id(config) in seen or not hasattr(config, "to_dict"):
                continue
            seen.add(id(config))
            for key, value in vars(config).items():
                if key.endswith("layerdrop") and isinstance(value, (int, float)) and value > 0:
                    found.append(f"{at}.{key}={value}")
                elif hasattr(value, "to_dict"):
                    configs.append((f"{at}.{key}", value))
    return found


def check_layerdrop(model: nn.Module, caller: str) -> None:
    """``ValueError`` when ``model`` drops layers at random in training (LayerDrop, ``layerdrop > 0``) and
    its blocks are to be units: each rank draws its own drops, so a rank skips a unit its peers run."""
    settings = _layerdrop_settings(model)
    keys = ", ".join(sorted({s.split("=")[0].rsplit(".", 1)[-1] + "=0.0" for s in settings if ".config." in s}))
    if settings:
        raise ValueError(
            f"{caller}(): {', '.join(settings)}: LayerDrop skips random layers in training, drawn on each rank, "
            "but these layers are FSDP units: a rank that skips one does not join its collectives (wrong "
            "weights, then a collective mismatch or a hang). Turn it off before fsdp(): set each value listed to "
            "0.0 (on your model, the names as written), or build the model with the config keys listed at 0.0 "
            f"(from_pretrained(..., {keys})); or pass auto_wrap=False (the whole model one unit)."
        )
