"""A wheel of the package, installed into a fresh virtual environment, runs its own main jobs.

Built as a user gets it (``pip install zeta-fsdp``): a wheel, a new venv with ``pip install <wheel>``
(only ``install_requires``), then ``python -m zeta_fsdp demo`` and ``python -m zeta_fsdp plan`` from
an empty folder, with no checkout on the import path. The venv sees the torch this suite runs on
(and what that torch requires) through a ``.pth`` file, nothing else of this environment: the wheel
installs against the user's torch, whichever release it is, with no second torch download.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import ROOT, launches
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from zeta_fsdp.distributed import without_launcher_env
from zeta_fsdp.models.gpt import small
from zeta_fsdp.planner import plan
from zeta_fsdp.torch_compat import MIN_TORCH

pytestmark = pytest.mark.launch  # every test here starts processes


def _clean_env() -> dict[str, str]:
    """Ours without the checkout on the import path (nor a job's launcher variables)."""
    env = without_launcher_env()
    for var in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(var, None)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env={**_clean_env(), **env}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


def _torch_closure() -> list[importlib.metadata.Distribution]:
    """The installed torch and every distribution it requires (extras and markers followed)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo: list[tuple[str, frozenset]] = [("torch", frozenset())]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional requirement this environment does not have
        if key in found and not extras:
            continue
        found[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((req.name, frozenset(req.extras)))
    return list(found.values())


def _expose_running_torch(venv_python: Path, links: Path) -> None:
    """Link the running torch's distributions (files and metadata) into ``links`` and name that
    folder in a ``.pth`` of the venv: the venv imports this torch and pip counts it installed."""
    links.mkdir()
    for dist in _torch_closure():
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            source, target = Path(dist.locate_file(top)), links / top
            if source.exists() and not target.exists():
                target.symlink_to(source)
    site = _run(
        [str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], links, 60
    ).stdout.strip()
    (Path(site) / "running-torch.pth").write_text(f"{links}\n")


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
    _expose_running_torch(python, base / "running-torch")
    # Pinned to the running torch (this replaces any machine-wide constraints file, which may cap
    # torch below it): pip must keep the user's torch, or fail saying why.
    keep = base / "keep-torch.txt"
    keep.write_text(f"torch=={importlib.metadata.version('torch')}\n")  # PyPI's: 2.15.0, no "+cu132"
    pip = _run([str(python), "-m", "pip", "install", str(wheel)], base, 600, PIP_CONSTRAINT=str(keep))
    assert not re.search(r"Successfully installed.* torch-\d", pip.stdout), pip.stdout  # the user's torch is kept
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
        "torch>=" + ".".join(map(str, MIN_TORCH)),
    ]


def test_imported_from_the_venv_not_the_checkout(installed):
    python, empty, _ = installed
    code = "import zeta_fsdp, torch; print(zeta_fsdp.__file__); print(torch.__version__); print(torch.__file__)"
    where, version, torch_file = _run([str(python), "-c", code], empty, 120).stdout.split()
    assert Path(where).is_relative_to(python.parent.parent), where
    assert not Path(where).is_relative_to(ROOT), where
    # the torch this suite runs on, not a second one in the venv
    assert version == torch.__version__, version
    assert Path(torch_file).resolve() == Path(torch.__file__).resolve(), torch_file


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
