"""Every docstring example written as ``>>>`` runs and prints what it shows (the others are plain examples)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, rank_env

pytestmark = pytest.mark.launch  # every test here starts processes


# What tools write beside the sources (tests/test_install.py builds a wheel in place, perhaps at the
# same time as this test under `pytest -n 2`): not a docstring example's doing.
_TOOL_OUTPUT = {"build", "dist", ".benchmarks", ".pytest_cache", ".ruff_cache", "__pycache__"}


def _repository_entries() -> list[str]:
    names = (p.name for p in ROOT.iterdir())
    return sorted(n for n in names if n not in _TOOL_OUTPUT and not n.endswith(".egg-info"))


def test_docstring_examples_run(tmp_path):
    # In a subprocess: some examples start the one-process group a notebook gets. In a temporary
    # folder: examples that write files (a checkpoint, a .safetensors file) write them there, and
    # the repository is left as it was.
    before = _repository_entries()
    cmd = [sys.executable, "-m", "pytest", "-q", "--doctest-modules", str(ROOT / "zeta_fsdp"), "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=rank_env(), capture_output=True, text=True, timeout=600)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:]
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert " passed" in summary and "skipped" not in summary, summary
    assert _repository_entries() == before, "a docstring example wrote into the repository"
