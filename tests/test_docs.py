"""Every code block in docs/ runs as written.

Convention (per Markdown file, blocks concatenated in order):
- ```python            -> run in one fresh `python` process (notebook-style: no group set-up).
- ```python torchrun   -> run with `torchrun --standalone --nproc-per-node 2`.
- ```python no-run     -> shown only (e.g. needs a GPU cluster or a download); keep these rare.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, rank_env

DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks(path: Path, mode: str) -> str:
    chosen = []
    for info, body in FENCE.findall(path.read_text()):
        tag = info.strip()
        if tag == mode:
            chosen.append(body)
    return "\n".join(chosen)


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=rank_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.launch
@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_doc_code_runs(doc, tmp_path):
    plain, launched = blocks(doc, ""), blocks(doc, "torchrun")
    if not plain and not launched:
        pytest.skip(f"{doc.name} has no runnable python blocks")
    if plain:
        script = tmp_path / "doc_plain.py"
        script.write_text(plain)
        proc = _run([sys.executable, str(script)], tmp_path)
        assert proc.returncode == 0, f"{doc.name} (python blocks) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    if launched:
        script = tmp_path / "doc_torchrun.py"
        script.write_text(launched)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
        proc = _run(cmd, tmp_path)
        assert proc.returncode == 0, (
            f"{doc.name} (torchrun blocks) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


def test_api_reference_lists_every_public_name():
    import zeta_fsdp

    text = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in zeta_fsdp.__all__ if f"`{name}" not in text]
    assert not missing, f"docs/api.md does not list: {missing}"


def test_every_public_name_has_a_docstring_with_an_example():
    import inspect

    import zeta_fsdp

    lacking = [n for n in zeta_fsdp.__all__ if "Example" not in (inspect.getdoc(getattr(zeta_fsdp, n)) or "")]
    assert not lacking, f"public names without an example in their docstring: {lacking}"


@pytest.mark.launch
def test_public_surface_is_small_and_import_is_light():
    """At most 36 public names; ``import zeta_fsdp`` loads no command-line module and no optional
    integration (a fresh interpreter, so nothing imported by other tests hides it)."""
    code = (
        "import sys, zeta_fsdp\n"
        "assert len(zeta_fsdp.__all__) <= 36, len(zeta_fsdp.__all__)\n"
        "heavy = [m for m in sys.modules if m.startswith('zeta_fsdp.cli') or m.split('.')[0] in\n"
        "         ('transformers', 'safetensors', 'lightning', 'peft', 'timm', 'matplotlib')]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_former_top_level_names_still_import_with_a_warning():
    import warnings

    import zeta_fsdp
    import zeta_fsdp.options
    import zeta_fsdp.state_dict

    for name, home in [("resolve_sharding", zeta_fsdp.options), ("prune_checkpoints", zeta_fsdp.state_dict)]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(zeta_fsdp, name)
        assert value is getattr(home, name)
        assert any(issubclass(w.category, DeprecationWarning) and home.__name__ in str(w.message) for w in caught)
    with pytest.raises(AttributeError, match="no_such_name"):
        zeta_fsdp.no_such_name  # noqa: B018
