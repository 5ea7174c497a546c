"""``zeta_fsdp.loss`` on real gloo ranks (the ``"loss"`` group of ``training_cases.py``) and alone."""

from __future__ import annotations

import torch
from conftest import dist_test

from zeta_fsdp.loss import MaskedTokenLossReduction, PerSampleLossReduction

test_two_ranks = dist_test("training_cases.py", 2, group="loss")


def test_masked_token_mean_without_a_process_group():
    reduction = MaskedTokenLossReduction()
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 1] = 5.0  # position 0 predicts label 1 well; position 2 is masked out
    batch = {"labels": torch.tensor([[1, 2, 3]]), "loss_mask": torch.tensor([[1, 1, 0]])}
    loss, record = reduction.forward(batch, logits)
    ce = torch.nn.functional.cross_entropy(logits[0, :2], batch["labels"][0, :2], reduction="sum")
    assert torch.equal(record["loss_sum_and_ub_size"], torch.stack([ce.double(), torch.tensor(2.0).double()]))
    assert torch.allclose(loss, ce / 2)  # one process: dp size 1, the local mean
    assert reduction.reduce([record, record]).item() == (ce.double() * 2 / 4).float().item()


def test_all_masked_gives_zero_not_nan():
    reduction = MaskedTokenLossReduction()
    batch = {"labels": torch.tensor([[1, 2]]), "loss_mask": torch.tensor([[0, 0]])}
    loss, record = reduction.forward(batch, torch.randn(1, 2, 4))
    assert loss.item() == 0.0 and reduction.reduce([record]).item() == 0.0


def test_per_sample_mean_weighs_every_sample_once():
    reduction = PerSampleLossReduction()
    _, a = reduction.forward({}, torch.tensor([1.0, 2.0, 3.0]))
    _, b = reduction.forward({}, torch.tensor([10.0]))
    assert reduction.reduce([a, b]).item() == 4.0
