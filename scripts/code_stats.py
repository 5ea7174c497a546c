"""Measure a package's shape: code vs docstring vs comment lines, function lengths, engine mentions.

A line counts once, as the first of: docstring (inside a module/class/function docstring), comment
(only a ``#`` comment), blank, else code. A function's length is its CODE lines only (its own body
without nested functions' docstrings, comments or blanks; a nested function counts in its own right
and inside its parent, as a reader holds both).

    python scripts/code_stats.py                 # zeta_fsdp/, the summary
    python scripts/code_stats.py --modules       # plus one line per module
    python scripts/code_stats.py --json          # machine-readable
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A file outside engines/ that names an engine: imports one, or branches on one by name.
ENGINE_NAMES = re.compile(
    r"""["'](replicate|fully_shard)["']"""  # an engine's name as a value: a branch or a choice
    r"|engines\.(fully_shard|replicate)\b"  # an engine's module imported directly
    r"|_composable\.replicate|\bReplicatedModule\b"  # torch's replicate engine itself
)


@dataclass
class Module:
    path: str
    lines: int = 0
    code: int = 0
    docstring: int = 0
    comment: int = 0
    blank: int = 0
    functions: dict[str, int] = field(default_factory=dict)


def docstring_lines(tree: ast.Module) -> set[int]:
    """Line numbers (1-based) inside every module/class/function docstring."""
    found: set[int] = set()
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    for node in nodes:
        body = getattr(node, "body", [])
        first = body[0] if body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            found.update(range(first.lineno, first.end_lineno + 1))
    return found


def comment_only_lines(source: str) -> set[int]:
    """Line numbers whose only token is a comment."""
    comments, other = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            other.update(range(tok.start[0], tok.end[0] + 1))
    return comments - other


def measure(path: Path, root: Path) -> Module:
    source = path.read_text()
    tree = ast.parse(source)
    text = source.splitlines()
    docs, comments = docstring_lines(tree), comment_only_lines(source)
    code_lines: set[int] = set()
    mod = Module(str(path.relative_to(root)), lines=len(text))
    for number, line in enumerate(text, start=1):
        if number in docs:
            mod.docstring += 1
        elif number in comments:
            mod.comment += 1
        elif not line.strip():
            mod.blank += 1
        else:
            mod.code += 1
            code_lines.add(number)
    for node, qualname in walk_functions(tree):
        span = range(node.lineno, node.end_lineno + 1)
        mod.functions[qualname] = sum(1 for n in span if n in code_lines)
    return mod


def walk_functions(tree: ast.AST, prefix: str = ""):
    """Yield (function node, qualified name) for every function and method, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield node, name
            yield from walk_functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from walk_functions(node, f"{prefix}{node.name}.")
        else:
            yield from walk_functions(node, prefix)


def percentile(values: list[int], q: float) -> int:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return 0
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def engine_mentions(package: Path, root: Path) -> list[str]:
    """Package files outside engines/ whose code (not docstrings/comments) names an engine."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if "engines" in path.relative_to(package).parts:
            continue
        source = path.read_text()
        tree = ast.parse(source)
        skip = docstring_lines(tree) | comment_only_lines(source)
        hits = [
            n
            for n, line in enumerate(source.splitlines(), start=1)
            if n not in skip and ENGINE_NAMES.search(line.split("#", 1)[0])
        ]
        if hits:
            found.append(f"{path.relative_to(root)}:{','.join(map(str, hits))}")
    return found


def summarize(package: Path, root: Path) -> dict:
    modules = [measure(p, root) for p in sorted(package.rglob("*.py"))]
    lengths = {f"{m.path}:{name}": n for m in modules for name, n in m.functions.items()}
    values = list(lengths.values())
    return {
        "modules": len(modules),
        "lines": sum(m.lines for m in modules),
        "code": sum(m.code for m in modules),
        "docstring": sum(m.docstring for m in modules),
        "comment": sum(m.comment for m in modules),
        "blank": sum(m.blank for m in modules),
        "functions": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "over_40": sum(v > 40 for v in values),
        "over_60": sum(v > 60 for v in values),
        "over_80": sum(v > 80 for v in values),
        "longest": sorted(lengths.items(), key=lambda kv: -kv[1])[:10],
        "modules_over_500": [(m.path, m.lines) for m in modules if m.lines > 500],
        "engine_mentions_outside_engines": engine_mentions(package, root),
        "per_module": [
            {"path": m.path, "lines": m.lines, "code": m.code, "docstring": m.docstring, "comment": m.comment}
            for m in modules
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default=str(ROOT / "zeta_fsdp"))
    parser.add_argument("--modules", action="store_true", help="one line per module")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    package = Path(args.package).resolve()
    stats = summarize(package, package.parent)
    if args.json:
        print(json.dumps(stats, indent=1))
        return 0
    if args.modules:
        for m in stats["per_module"]:
            print(
                f"{m['lines']:5d} lines {m['code']:5d} code {m['docstring']:5d} doc {m['comment']:4d} comment  {m['path']}"
            )
    print(
        f"{stats['modules']} modules, {stats['lines']} lines: code {stats['code']}, docstring {stats['docstring']}, "
        f"comment {stats['comment']}, blank {stats['blank']}"
    )
    print(
        f"{stats['functions']} functions (code lines): median {stats['p50']}, p90 {stats['p90']}, "
        f">40: {stats['over_40']}, >60: {stats['over_60']}, >80: {stats['over_80']}"
    )
    print("longest: " + ", ".join(f"{name} {n}" for name, n in stats["longest"]))
    print("modules over 500 lines: " + (", ".join(f"{p} {n}" for p, n in stats["modules_over_500"]) or "none"))
    print("outside engines/, naming an engine: " + (" ".join(stats["engine_mentions_outside_engines"]) or "none"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
