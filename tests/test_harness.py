"""The multi-rank harness: a case failing on one rank fails fast, with its own message, and the
other cases of the launch still report (``worker.run_cases`` + ``conftest.launch_worker``)."""

from __future__ import annotations

import os

import pytest
from conftest import launch_worker, merge_ranks, worker_cases

pytestmark = pytest.mark.launch  # every test here starts processes


def test_failure_on_one_rank_reports_itself_and_the_rest_still_run(tmp_path, monkeypatch):
    # A short collective timeout: without the agreement the failing case would end in a gloo
    # timeout (the report then says "Timed out", not the assertion) - this keeps that quick.
    monkeypatch.setenv("ZETA_TEST_TIMEOUT", "60")
    cases = worker_cases("harness_cases.py", 2)
    per_rank, _ = launch_worker(tmp_path / "out", 2, "harness_cases.py", cases)
    results = merge_ranks(per_rank, cases)
    assert results["first_case_passes"] == "ok"
    failed = results["rank0_fails_between_collectives"]
    assert "rank 0: Traceback" in failed and "AssertionError: rank 0 breaks on purpose" in failed, failed
    assert "Timed out" not in failed and "timeout" not in failed.lower(), failed
    # rank 1 was released from its collective by rank 0 leaving (its own error, not a hang)
    assert per_rank[1]["rank0_fails_between_collectives"] != "ok"
    # the launch stopped there; the harness launched the remaining cases again, and they report
    assert os.path.isdir(tmp_path / "out" / "relaunch1")
    assert results["case_after_the_failure_still_reports"] == "ok"
    alike = results["every_rank_fails_alike"]
    assert "rank 0 fails on purpose" in alike and "rank 1 fails on purpose" in alike, alike
    # a failure every rank agrees on needs no relaunch: the next case runs in the same launch
    assert not os.path.isdir(tmp_path / "out" / "relaunch2")
    assert [res["case_after_an_agreed_failure"] for res in per_rank] == [{"rank": 0}, {"rank": 1}]
