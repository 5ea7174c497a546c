"""The façade on real gloo ranks: parity with a single-process reference, bf16, meta, comms, memory."""

from __future__ import annotations

import pytest
from conftest import run_dist

TWO_RANK_CASES = [
    "parity_full_shard",
    "parity_shard_grad",
    "parity_no_shard",
    "parity_auto_detect",
    "parity_root_only_default_args",
    "parity_class_name_and_checkpointing",
    "parity_cpu_offload",
    "parity_weights_shared_across_blocks",
    "parity_compiled_blocks",
    "parity_after_memory_measurement",
    "bf16_policy_on_every_unit",
    "meta_device_init",
    "comm_parity_with_hand_written",
    "memory_full_shard_halves_params",
    "wrapping_twice_is_a_clear_error",
]
FOUR_RANK_CASES = [
    "parity_hybrid_shard",
    "parity_hybrid_shard_zero2",
    "parity_int_reshard_after_forward",
    "user_mesh_is_honoured",
]


@pytest.fixture(scope="module")
def two_rank_results(session_tmp):
    return run_dist(session_tmp, 2, "dist_cases.py", TWO_RANK_CASES)


@pytest.fixture(scope="module")
def four_rank_results(session_tmp):
    return run_dist(session_tmp, 4, "dist_cases.py", FOUR_RANK_CASES)


@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_two_ranks(two_rank_results, case):
    assert two_rank_results[case] == "ok", two_rank_results[case]


@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_four_ranks(four_rank_results, case):
    assert four_rank_results[case] == "ok", four_rank_results[case]
