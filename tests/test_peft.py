"""PEFT LoRA with fsdp(): frozen bf16 base + fp32 adapters, adapter files in PEFT's layout, merged save.

Multi-rank cases in ``peft_cases.py`` (2 gloo ranks, exact parity against a single-process
reference); the planner's accounting of frozen weights runs here without a process group.
"""

from __future__ import annotations

import pytest
from conftest import dist_test

pytest.importorskip("transformers")
pytest.importorskip("peft")

from peft_cases import lora_llama  # noqa: E402

from zeta_fsdp import plan  # noqa: E402

test_peft_two_ranks = dist_test("peft_cases.py", 2)


def test_plan_counts_frozen_weights_without_gradients_or_optimizer_state():
    import torch

    model = lora_llama()
    params = dict(model.named_parameters())
    p = plan(model, world_size=2, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    trainable = sum(t.numel() for t in params.values() if t.requires_grad)
    frozen = sum(t.numel() for t in params.values() if not t.requires_grad)
    assert {t.dtype for t in params.values() if not t.requires_grad} == {torch.bfloat16}
    # every tensor here splits evenly over 2 ranks (even dim 0): no padding
    assert p.param_bytes == (frozen * 2 + trainable * 4) // 2  # bf16 frozen, fp32 adapters, 1/2 each
    assert p.grad_bytes == trainable * 4 // 2  # gradients for the adapters only
    assert p.optimizer_bytes == 2 * trainable * 4 // 2 + 4 * len([t for t in params.values() if t.requires_grad])
    assert any("frozen parameter(s)" in n for n in p.notes), p.notes
    # what fp32 masters for the frozen base would have cost: twice the frozen bytes
    all_fp32 = plan(model.requires_grad_(True), world_size=2, auto_wrap=True, mp="bf16", shard_strat="FULL_SHARD")
    assert all_fp32.param_bytes == (frozen + trainable) * 4 // 2
