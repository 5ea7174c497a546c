"""transformers' Trainer and accelerate with an fsdp() model (zeta_fsdp.integrations).

Two launches of ``trainer_cases.py``: 2 ranks (train, checkpoint, resume, save, NO_SHARD, bf16,
LoRA, errors, accelerate), then 1 rank on the files the first left (a single-process Trainer on the
same global batches; the 2-rank checkpoint resumed on 1 rank).
"""

from __future__ import annotations

import pytest
from conftest import check_case, launch_worker, launches, merge_ranks, worker_cases

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")

TWO = worker_cases("trainer_cases.py", 2)
ONE = worker_cases("trainer_cases.py", 1, "one")


def _launch(out, nproc, cases, work) -> dict:
    per_rank, _ = launch_worker(out, nproc, "trainer_cases.py", cases, "--work", str(work), timeout=600)
    return merge_ranks(per_rank, cases)


@pytest.fixture(scope="module")
@launches
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("trainer_work")


@pytest.fixture(scope="module")
@launches
def two_ranks(work, tmp_path_factory) -> dict:
    return _launch(tmp_path_factory.mktemp("two"), 2, TWO, work)


@pytest.fixture(scope="module")
@launches
def one_rank(two_ranks, work, tmp_path_factory) -> dict:
    assert two_ranks[TWO[0]] == "ok", "the 2-rank run the 1-rank cases compare with failed"
    return _launch(tmp_path_factory.mktemp("one"), 1, ONE, work)


@pytest.mark.parametrize("case", TWO)
def test_two_ranks(two_ranks, case):
    check_case(two_ranks, case)


@pytest.mark.parametrize("case", ONE)
def test_one_rank(one_rank, case):
    check_case(one_rank, case)


@pytest.mark.launch
def test_import_zeta_fsdp_does_not_import_the_integrations():
    import subprocess
    import sys

    code = "import sys, zeta_fsdp; assert not [m for m in sys.modules if m.startswith(('accelerate', 'zeta_fsdp.integrations'))]"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
