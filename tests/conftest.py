"""Shared test helpers: launch real gloo ranks with torchrun, as users do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests import zeta_fsdp.models.gpt, as users run them from the repo root


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


def launch_worker(
    out: Path,
    nproc: int,
    worker: str,
    cases: list[str],
    *args: str,
    timeout: float = 600,
    allow_exit_code: bool = False,
) -> tuple[list[dict], subprocess.CompletedProcess]:
    """Run ``cases`` of ``tests/<worker>`` in one launch; return (each rank's results, the process).

    One rank runs as a plain ``python`` process (the one-process group ``fsdp()`` starts in a
    notebook); more go through ``torchrun``. Every rank must write its results to ``out``, and the
    launch must exit 0 unless ``allow_exit_code`` (a launch that kills a rank on purpose).
    """
    script = str(ROOT / "tests" / worker)
    argv = ["--out", str(out), "--cases", ",".join(cases), *args]
    if nproc == 1:
        cmd = [sys.executable, script, *argv]
        proc = subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=timeout)
    else:
        proc = torchrun(nproc, script, *argv, timeout=timeout)
    files = sorted(out.glob("rank*.json")) if out.exists() else []
    if len(files) != nproc or (proc.returncode != 0 and not allow_exit_code):
        raise AssertionError(f"launch failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads(f.read_text()) for f in files], proc


def merge_ranks(per_rank: list[dict], cases: list[str]) -> dict[str, str]:
    """{case: "ok" if every rank passed it, else the failing ranks' tracebacks}."""
    results = {}
    for name in cases:
        failures = [f"rank {r}: {res[name]}" for r, res in enumerate(per_rank) if res[name] != "ok"]
        results[name] = "ok" if not failures else "\n".join(failures)
    return results


def run_dist(tmp_path: Path, nproc: int, worker: str, cases: list[str], timeout: float = 600) -> dict[str, str]:
    """Run ``cases`` of ``worker`` in one launch; return {case: "ok" or the failing ranks' tracebacks}."""
    per_rank, _ = launch_worker(tmp_path / f"results_{nproc}", nproc, worker, cases, timeout=timeout)
    return merge_ranks(per_rank, cases)


def check_case(results: dict[str, str], case: str) -> None:
    """One case of a launch passed on every rank (else: the failing ranks' tracebacks)."""
    assert results[case] == "ok", results[case]


@pytest.fixture(scope="session")
def session_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dist")


@pytest.fixture(scope="session")
def dist_results(session_tmp) -> Callable[[str, int, list[str]], dict[str, str]]:
    """``dist_results(worker, nproc, cases)``: the results of one launch, made at the first call.

    Each launch runs in ``session_tmp/<worker's stem>``; a failed launch fails every test that
    asks for it, without launching again.
    """
    launched: dict[tuple, object] = {}

    def results(worker: str, nproc: int, cases: list[str]) -> dict[str, str]:
        key = (worker, nproc, tuple(cases))
        if key not in launched:
            try:
                launched[key] = run_dist(session_tmp / Path(worker).stem, nproc, worker, cases)
            except AssertionError as e:
                launched[key] = e
        if isinstance(launched[key], AssertionError):
            raise launched[key]
        return launched[key]

    return results


def dist_test(worker: str, nproc: int, cases: list[str]) -> Callable:
    """A test with one id per case of ``cases``, all run by one launch of ``worker`` on ``nproc`` ranks.

    Example (in a test module): ``test_two_ranks = dist_test("dist_cases.py", 2, TWO_RANK_CASES)``.
    """

    @pytest.mark.parametrize("case", cases)
    def test(dist_results, case):
        check_case(dist_results(worker, nproc, cases), case)

    test.__doc__ = f"{worker} on {nproc} ranks: the case passed on every rank."
    return test
