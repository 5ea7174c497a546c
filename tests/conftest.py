"""Shared test helpers: launch real gloo ranks with torchrun, as users do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests import examples.gpt, as users run them from the repo root


def rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def torchrun(nproc: int, script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` local ranks (fresh processes, free port) and return the result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]
    return subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=timeout)


def run_dist(tmp_path: Path, nproc: int, worker: str, cases: list[str], timeout: float = 600) -> dict[str, str]:
    """Run ``cases`` of ``worker`` in one launch; return {case: "ok" or the failing ranks' tracebacks}."""
    out = tmp_path / f"results_{nproc}"
    proc = torchrun(nproc, str(ROOT / "tests" / worker), "--out", str(out), "--cases", ",".join(cases), timeout=timeout)
    files = sorted(out.glob("rank*.json")) if out.exists() else []
    if proc.returncode != 0 or len(files) != nproc:
        raise AssertionError(f"launch failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    per_rank = [json.loads(f.read_text()) for f in files]
    results = {}
    for name in cases:
        failures = [f"rank {r}: {res[name]}" for r, res in enumerate(per_rank) if res[name] != "ok"]
        results[name] = "ok" if not failures else "\n".join(failures)
    return results


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")
