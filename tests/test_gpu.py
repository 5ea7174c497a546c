"""GPU tests: the façade, numerics, meta init, offload, checkpoints, HF weights and compile on one CUDA
device (``tests/gpu_cases.py``), the demo on one CUDA rank, and ``benchmarks/bench_gpu.py``.

Skipped cleanly without CUDA. The rest of the suite never sees a GPU (``conftest`` hides it, so CPU tests
stay on CPU on a GPU host); these tests give it back to the processes they start.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, gpu_env

pytestmark = [pytest.mark.gpu, pytest.mark.launch]


def _cuda_available() -> bool:
    env = gpu_env()
    if env is None:
        return False
    probe = [sys.executable, "-c", "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


needs_cuda = pytest.mark.skipif(not _cuda_available(), reason="no CUDA device")


def _run(*cmd: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *cmd], cwd=ROOT, env=gpu_env(), capture_output=True, text=True, timeout=timeout
    )


@needs_cuda
def test_gpu_cases():
    proc = _run("tests/gpu_cases.py", timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@needs_cuda
def test_demo_one_cuda_rank():
    proc = _run("-m", "zeta_fsdp", "demo", "--nproc", "1", "--steps", "4", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CUDA" in proc.stdout and "largest difference 0.0e+00" in proc.stdout, proc.stdout[-3000:]


@needs_cuda
def test_bench_gpu_quick():
    proc = _run("benchmarks/bench_gpu.py", "--quick", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
