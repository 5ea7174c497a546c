"""The optimizer step on local shards (issue 32) on real gloo ranks: cases in ``optim_cases.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import dist_test

from zeta_fsdp import cpu_threads
from zeta_fsdp.cpu_threads import fair_share, share_cores

test_two_ranks = dist_test("optim_cases.py", 2)


# ---------------------------------------------------------------- CPU ranks share cores (in-process)


@pytest.fixture
def threads():
    """Restore torch's intra-op threads after a test that changes them."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_fair_share_of_cores():
    assert fair_share(cores=16, ranks=8) == 2
    assert fair_share(cores=2, ranks=8) == 1  # never 0
    assert fair_share(cores=2, ranks=2) == 1


def test_share_cores_sets_the_fair_share_unless_the_user_chose(monkeypatch, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "64")
    monkeypatch.setattr(cpu_threads, "_AT_IMPORT", torch.get_num_threads())  # nobody called set_num_threads
    assert share_cores(torch.device("cuda")) is None  # GPU compute, no offload: nothing to share
    assert share_cores(torch.device("cpu")) == 1 and torch.get_num_threads() == 1
    torch.set_num_threads(2)  # the user's own call, after import: left alone
    assert share_cores(torch.device("cpu")) is None and torch.get_num_threads() == 2
    monkeypatch.setattr(cpu_threads, "_AT_IMPORT", 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's environment: left alone
    assert share_cores(torch.device("cpu"), cpu_offload=True) is None and torch.get_num_threads() == 2
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")  # under torchrun: whose OMP_NUM_THREADS is it?
    parent_has_it = b"OMP_NUM_THREADS=" in Path(f"/proc/{os.getppid()}/environ").read_bytes()
    assert (share_cores(torch.device("cpu")) is None) == parent_has_it
