"""The optimizer step on local shards (issue 32) on real gloo ranks: cases in ``optim_cases.py``."""

from __future__ import annotations

from conftest import dist_test

test_two_ranks = dist_test("optim_cases.py", 2)
