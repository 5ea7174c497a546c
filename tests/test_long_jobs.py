"""Checkpoints for long jobs: async save, manager, preemption, data position at another world size, crash recovery.

Cases run in ``long_jobs_cases.py`` (real gloo ranks); the crash-recovery test runs
``tests/crash_train.py`` under ``torchrun --max-restarts=1`` as a user would.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, check_case, launch_worker, launches, merge_ranks, rank_env, worker_cases

TWO_RANK_CASES = worker_cases("long_jobs_cases.py", 2)  # the data resume cases are the "resume" group


def launch(out: Path, nproc: int, cases: list[str], shared: Path) -> dict:
    per_rank, _ = launch_worker(out, nproc, "long_jobs_cases.py", cases, "--dir", str(shared), timeout=600)
    return merge_ranks(per_rank, cases)


@pytest.fixture(scope="module")
@launches
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("long_jobs")


@pytest.fixture(scope="module")
@launches
def two_ranks(shared, tmp_path_factory) -> dict:
    return launch(tmp_path_factory.mktemp("two"), 2, TWO_RANK_CASES, shared)


@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_two_ranks(two_ranks, case):
    check_case(two_ranks, case)


@pytest.mark.launch
@pytest.mark.parametrize("nproc", [1, 4])
def test_data_position_saved_at_2_resumed_at(two_ranks, shared, tmp_path, nproc):
    """Saved at 2 ranks mid-epoch, resumed at ``nproc``: same global batches in the same order, losses within the bound."""
    assert two_ranks["data_reference_run_saves_midway"] == "ok", "the 2-rank reference run failed"
    check_case(launch(tmp_path, nproc, ["data_resume_at_this_world_size"], shared), "data_resume_at_this_world_size")


def _torchrun_with_restart(out: Path, ckpt: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += [str(ROOT / "tests" / "crash_train.py"), "--out", str(out), "--ckpt", str(ckpt), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.mark.launch
def test_crash_recovery_under_torchrun_restart_is_exact(tmp_path):
    """SIGKILL one rank mid-training; torchrun restarts; the resumed run ends bit-identical to an uninterrupted one."""
    _torchrun_with_restart(tmp_path / "clean", tmp_path / "ckpt_clean")
    _torchrun_with_restart(tmp_path / "crash", tmp_path / "ckpt_crash", "--kill-at", "5")
    clean = [json.loads(line) for line in (tmp_path / "clean" / "attempts.jsonl").read_text().splitlines()]
    crash = [json.loads(line) for line in (tmp_path / "crash" / "attempts.jsonl").read_text().splitlines()]
    assert [(a["attempt"], a["resumed_from"], a["steps"]) for a in clean] == [(0, 0, 10)], clean
    # Only the restarted attempt finishes; it resumed from a checkpoint saved before the kill (every 2 steps).
    assert len(crash) == 1 and crash[0]["attempt"] == 1 and crash[0]["steps"] == 10, crash
    assert crash[0]["resumed_from"] in (2, 4), crash
    want = torch.load(tmp_path / "clean" / "final.pt", weights_only=True)
    got = torch.load(tmp_path / "crash" / "final.pt", weights_only=True)
    for part in ("model", "optim"):
        assert list(got[part]) == list(want[part]), part
        for key, value in want[part].items():
            same = torch.equal(got[part][key], value) if isinstance(value, torch.Tensor) else got[part][key] == value
            assert same, f"{part}: {key} differs from the uninterrupted run"
    # Retention: keep_last=2 of step_2 ... step_10, and no partial directory left.
    assert sorted(p.name for p in (tmp_path / "ckpt_crash").iterdir()) == ["step_10", "step_8"]


@pytest.mark.launch
def test_bench_long_jobs_quick(tmp_path):
    """``benchmarks/bench_long_jobs.py --quick`` runs end to end; its figures are only checked to be well-formed."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "bench_long_jobs.py"), "--quick", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    text = (tmp_path / "long_jobs.md").read_text()
    assert "## Training stall per save" in text and "## Extra memory of the staged copy" in text
    # The staged copy is exactly one copy of the rank's shards: that ratio is not a timing.
    ratios = [float(x) for x in re.findall(r"\| \*\*([0-9.]+)\*\* \| -?[0-9.]+ MiB \|$", text, re.M)]
    assert ratios == [1.0, 1.0], ratios


LOADER_BEFORE_GROUP = """
import json, sys
from zeta_fsdp.data import ResumableLoader

import torch.distributed as dist
assert not dist.is_initialized()  # built before any process group, as a script may do under torchrun
loader = ResumableLoader(list(range(40)), global_batch_size=8, shuffle=False)
try:
    ResumableLoader(list(range(40)), global_batch_size=5)
    refused = ""
except ValueError as e:
    refused = str(e)
out = {"rank": loader.rank, "world": loader.world_size, "batch": next(iter(loader)), "refused": refused}
open(sys.argv[1] + f"/rank{loader.rank}.json", "w").write(json.dumps(out, default=lambda t: t.tolist()))
"""


@pytest.mark.launch
def test_loader_built_before_the_group_takes_torchrun_rank(tmp_path):
    """Issue 18: under torchrun, a ``ResumableLoader`` built before the process group exists is still rank r of W
    (each rank its own slice of the global batch), and refuses a global batch size W does not divide."""
    from conftest import torchrun

    script = tmp_path / "loader_before_group.py"
    script.write_text(LOADER_BEFORE_GROUP)
    proc = torchrun(2, str(script), str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert [got[r]["world"] for r in (0, 1)] == [2, 2]
    assert got[0]["batch"] == [0, 1, 2, 3] and got[1]["batch"] == [4, 5, 6, 7], got
    for r in (0, 1):
        assert "global_batch_size=5" in got[r]["refused"] and "world_size=2" in got[r]["refused"], got[r]


def test_per_rank_state_at_another_world_size_is_refused(tmp_path):
    """Issue 29 §5: a state saved alike by every rank resumes at any world size; a per-rank one saved by 2 ranks
    cannot be resharded to this one process: ``CheckpointError`` naming it and both world sizes."""
    from zeta_fsdp.state_dict import CheckpointError
    from zeta_fsdp.state_dict.manager import restore_rank_states

    class Holder:
        def __init__(self):
            self.state = None

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            self.state = state

    same = Holder()
    restore_rank_states({"data": same}, {"data": [{"epoch": 1, "t": torch.ones(2)}] * 2}, tmp_path)
    assert same.state["epoch"] == 1
    per_rank = Holder()
    with pytest.raises(
        CheckpointError, match=r"different state per rank for \['cursor'\], saved by 2 ranks; this job has 1"
    ):
        restore_rank_states(
            {"cursor": per_rank, "data": same}, {"cursor": [{"pos": 0}, {"pos": 5}], "data": [{}, {}]}, tmp_path
        )
    assert per_rank.state is None  # refused before anything loaded
