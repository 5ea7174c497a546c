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
