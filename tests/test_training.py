"""``zeta_fsdp.training`` and ``zeta_fsdp.loss`` on real gloo ranks (cases in ``training_cases.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_dist

TWO_RANK_CASES = [
    "no_sync_full_shard_accumulation",
    "no_sync_hybrid_accumulation",
    "no_sync_restores_on_exception_and_nesting",
    "clip_grad_norm_full_shard",
    "clip_grad_norm_across_meshes_tp",
    "memory_report_values",
    "token_weighted_loss_and_grads",
    "token_weighted_loss_micro_batches_and_ignore_index",
    "reduce_is_one_all_reduce_of_two_numbers",
    "all_masked_rank_gives_no_nan",
    "per_sample_mean_uneven_batches",
]
FOUR_RANK_CASES = [
    "no_sync_hybrid_2x2_accumulation",
    "clip_grad_norm_hybrid_2x2",
]


@pytest.fixture(scope="module")
def two_rank_results(session_tmp):
    return run_dist(session_tmp / "training", 2, "training_cases.py", TWO_RANK_CASES)


@pytest.fixture(scope="module")
def four_rank_results(session_tmp):
    return run_dist(session_tmp / "training", 4, "training_cases.py", FOUR_RANK_CASES)


@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_two_ranks(two_rank_results, case):
    assert two_rank_results[case] == "ok", two_rank_results[case]


@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_four_ranks(four_rank_results, case):
    assert four_rank_results[case] == "ok", four_rank_results[case]


# single-process checks: no process group needed


def test_clip_grad_norm_plain_module_matches_torch():
    from zeta_fsdp.training import clip_grad_norm_

    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    b = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 4)
    for net in (a, b):
        net(x).pow(2).sum().backward()
    a[1].bias.grad = b[1].bias.grad = None
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1).item()
    assert abs(clip_grad_norm_(a, 0.1) - want) <= 1e-6
    for p, q in zip(a.parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-7)
    assert clip_grad_norm_(torch.nn.Linear(2, 2), 1.0) == 0.0  # no gradients at all
    with pytest.raises(RuntimeError, match="non-finite"):
        a[0].weight.grad[0, 0] = float("nan")
        clip_grad_norm_(a, 1.0, error_if_nonfinite=True)


def test_memory_report_plain_module():
    from zeta_fsdp.training import memory_report

    net = torch.nn.Linear(10, 10)
    report = memory_report(net)
    assert report["params"] == {"local_bytes": 440, "full_bytes": 440, "tensors": 2}
    assert report["world_size"] == 1 and "1.000" in report.table()


def test_loss_reduction_single_process_values():
    from zeta_fsdp.loss import MaskedTokenLossReduction, PerSampleLossReduction

    torch.manual_seed(0)
    logits = torch.randn(2, 4, 7)
    labels = torch.randint(0, 7, (2, 4))
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    reduction = MaskedTokenLossReduction()
    loss, record = reduction.forward({"labels": labels, "loss_mask": mask}, logits)
    ce = torch.nn.functional.cross_entropy(logits.view(-1, 7), labels.view(-1), reduction="none").view(2, 4)
    want = (ce * mask).sum() / mask.sum()
    assert torch.allclose(loss, want) and torch.allclose(reduction.reduce(record), want)
    # per-token losses instead of logits, and an (inputs, labels) tuple batch
    loss, _ = reduction.forward({"loss_mask": mask}, ce)
    assert torch.allclose(loss, want)
    loss, _ = reduction((None, torch.where(mask.bool(), labels, -100)), logits)
    assert torch.allclose(loss, want)
    # an inf loss at a masked position does not leak in
    ce_inf = ce.clone()
    ce_inf[1, 3] = float("inf")
    assert torch.allclose(reduction.forward({"loss_mask": mask}, ce_inf)[0], want)
    sample = PerSampleLossReduction().forward({"labels": labels, "loss_mask": mask}, logits)[0]
    assert torch.allclose(sample, ((ce * mask).sum(1) / mask.sum(1)).mean())
