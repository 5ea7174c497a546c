"""The façade on real gloo ranks: parity with a single-process reference, bf16, meta, comms, memory."""

from __future__ import annotations

from conftest import dist_test

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
    "single_ignored_parameter_is_accepted",
]
FOUR_RANK_CASES = [
    "parity_hybrid_shard",
    "parity_hybrid_shard_zero2",
    "parity_int_reshard_after_forward",
    "user_mesh_is_honoured",
    "meta_init_replicas_identical_shards_distinct",
]


test_two_ranks = dist_test("dist_cases.py", 2, TWO_RANK_CASES)
test_four_ranks = dist_test("dist_cases.py", 4, FOUR_RANK_CASES)
