"""A wheel of the package, installed into a fresh virtual environment, runs its own main jobs.

Built as a user gets it (``pip install zeta-fsdp``): a wheel, a new venv with ``pip install
torch==2.13.0 <wheel>`` (only ``install_requires``), then ``python -m zeta_fsdp demo`` and
``python -m zeta_fsdp plan`` from an empty folder, with no checkout on the import path.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import ROOT, launches

from zeta_fsdp.distributed import without_launcher_env
from zeta_fsdp.models.gpt import small
from zeta_fsdp.planner import plan

pytestmark = pytest.mark.launch  # every test here starts processes

TORCH = "torch==2.13.0"  # the fast CPU build on these machines (and the version the suite pins)


def _clean_env() -> dict[str, str]:
    """Ours without the checkout on the import path (nor a job's launcher variables)."""
    env = without_launcher_env()
    for var in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(var, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


@pytest.fixture(scope="module")
@launches
def installed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(python of a fresh venv holding only the wheel and its requirements, an empty folder, the wheel)."""
    base = tmp_path_factory.mktemp("install")
    # --no-build-isolation: build with the setuptools already here (no download, seconds).
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(base), str(ROOT)],
        base,
        300,
    )
    (wheel,) = base.glob("zeta_fsdp-*.whl")
    _run([sys.executable, "-m", "venv", str(base / "venv")], base, 300)
    python = base / "venv" / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", TORCH, str(wheel)], base, 600)
    empty = base / "empty"
    empty.mkdir()
    return python, empty, wheel


def test_wheel_holds_the_package_only(installed):
    _, _, wheel = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert "zeta_fsdp/models/gpt.py" in names and "zeta_fsdp/cli/main.py" in names
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"zeta_fsdp"}, tops  # no tests/, examples/, benchmarks/ in the wheel
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [
        line
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    assert sorted(r.split(":", 1)[1].strip() for r in requires if "extra ==" not in r) == [
        "einops",
        "numpy",
        "torch>=2.13",
    ]


def test_imported_from_the_venv_not_the_checkout(installed):
    python, empty, _ = installed
    out = _run(
        [str(python), "-c", "import zeta_fsdp, torch; print(zeta_fsdp.__file__); print(torch.__version__)"], empty, 120
    )
    where, version = out.stdout.split()
    assert Path(where).is_relative_to(python.parent.parent), where
    assert not Path(where).is_relative_to(ROOT), where
    assert version.startswith("2.13.0"), version


def test_demo_from_an_empty_folder(installed):
    python, empty, _ = installed
    proc = _run([str(python), "-m", "zeta_fsdp", "demo", "--steps", "2"], empty, 600)
    finals = {}
    for line in proc.stdout.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] in ("FULL_SHARD", "SHARD_GRAD", "NO_SHARD"):
            finals[cells[0]] = float(cells[1].split(" -> ")[1])
    assert list(finals) == ["FULL_SHARD", "SHARD_GRAD", "NO_SHARD"], proc.stdout
    # Same seed, same data: strategies differ only in reduction order (the demo's fp32 tolerance).
    assert max(finals.values()) - min(finals.values()) <= 1e-4, finals
    assert "loss after 2 steps: equal across strategies" in proc.stdout
    assert list(empty.iterdir()) == [], "the demo left files in the working folder"


def test_plan_from_an_empty_folder(installed):
    python, empty, _ = installed
    proc = _run([str(python), "-m", "zeta_fsdp", "plan", "zeta_fsdp.models.gpt:small"], empty, 300)
    with torch.device("meta"):
        expected = plan(small(), world_size=8)  # the checkout's planner: the same figures
    assert "FULL_SHARD on 8 ranks: mesh 8" in proc.stdout
    assert f"sharded parameter bytes on rank 0: {expected.param_bytes:,}" in proc.stdout, proc.stdout
    assert "-> matches the plan" in proc.stdout, proc.stdout  # the dry-run subprocess ran from the wheel too
