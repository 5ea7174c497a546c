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


def test_loss_mask_never_counts_an_ignored_label():
    """Issue 29: a loss_mask built from attention alone counts positions labelled -100 (or the reduction's
    ignore_index): they must weigh 0, not add loss 0 with weight 1 (which halved the loss)."""
    logits = torch.randn(1, 4, 5)
    labels = torch.tensor([[1, 2, -100, -100]])
    want = torch.nn.functional.cross_entropy(logits[0, :2], labels[0, :2])
    batch = {"labels": labels, "loss_mask": torch.ones(1, 4, dtype=torch.long)}
    loss, record = MaskedTokenLossReduction().forward(batch, logits)
    assert record["loss_sum_and_ub_size"][1].item() == 2.0
    assert torch.allclose(loss, want, rtol=1e-6, atol=0)
    padded = {"labels": torch.tensor([[1, 2, 0, 0]]), "loss_mask": torch.ones(1, 4)}  # pad id 0 as ignore_index
    loss, record = MaskedTokenLossReduction(ignore_index=0).forward(padded, logits)
    assert record["loss_sum_and_ub_size"][1].item() == 2.0
    assert torch.allclose(loss, want, rtol=1e-6, atol=0)
    other = {"labels": torch.tensor([[1, 2, -1, -1]]), "loss_mask": torch.ones(1, 4)}  # -1: not a valid target
    loss, _ = MaskedTokenLossReduction(ignore_index=-1).forward(other, logits)
    assert torch.allclose(loss, want, rtol=1e-6, atol=0)


def test_per_sample_on_classification_logits():
    """Issue 29: logits (B, C) with labels (B,) are one loss per sample (an IndexError before)."""
    logits, labels = torch.randn(4, 3), torch.tensor([0, 2, -100, 1])
    reduction = PerSampleLossReduction()
    loss, record = reduction.forward({"labels": labels}, logits)
    keep = labels != -100
    want = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    assert record["loss_sum_and_ub_size"][1].item() == 3.0
    assert torch.allclose(loss, want, rtol=1e-6, atol=0) and torch.allclose(reduction.reduce([record]), want)
    loss, _ = reduction.forward((torch.zeros(4, 7), labels), logits)  # an (inputs, labels) batch
    assert torch.allclose(loss, want, rtol=1e-6, atol=0)
    try:
        reduction.forward({}, torch.tensor(2.0))
    except ValueError as e:
        assert "one loss per sample" in str(e)
    else:
        raise AssertionError("a 0-dim loss was accepted as per-sample losses")
