"""``zeta_fsdp.training`` and ``zeta_fsdp.loss`` on real gloo ranks (cases in ``training_cases.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import dist_test

test_two_ranks = dist_test("training_cases.py", 2)
test_four_ranks = dist_test("training_cases.py", 4)


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
    assert report["params"] == {"local_bytes": 440, "full_bytes": 440, "tensors": 2, "dtypes": ["float32"]}
    assert report["world_size"] == 1 and "1.000" in report.table()
    assert "master weights float32; optimizer state -" in report.table()


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


def test_clip_grad_norm_rejects_bad_norm_type_by_name():
    """``norm_type="fro"`` used to fail inside float() with a bare "could not convert string"."""
    from zeta_fsdp.training import clip_grad_norm_

    net = torch.nn.Linear(3, 2)
    net(torch.randn(4, 3)).sum().backward()
    for bad in ("fro", "nuc", 0, -2.0, float("nan"), float("-inf"), True, None, "2"):
        with pytest.raises(ValueError, match=r"norm_type=.*not accepted. Accepted: a positive float.*'inf'") as info:
            clip_grad_norm_(net, 1.0, norm_type=bad)
        assert repr(bad) in str(info.value), str(info.value)
    want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in net.parameters()]), float("inf"))
    assert abs(clip_grad_norm_(net, 1e9, norm_type="inf") - want.item()) <= 1e-6
    assert abs(clip_grad_norm_(net, 1e9, norm_type="INF") - want.item()) <= 1e-6
    assert clip_grad_norm_(net, 1e9, norm_type=3) > 0


def test_loss_collective_buffers_on_the_communication_device(monkeypatch):
    """``reduce([])`` (a rank with no records, e.g. ``reduced_loss`` before any step) all-reduced a
    CPU tensor, which NCCL refuses: the buffer must be on the group's communication device."""
    import torch.distributed as dist

    from zeta_fsdp import loss

    assert loss.comm_device() == torch.device("cpu")  # no process group
    backend = {"name": "nccl"}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend["name"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert loss.comm_device() == torch.device("cuda", 3)
    backend["name"] = "cpu:gloo,cuda:nccl"
    assert loss.comm_device() == torch.device("cpu")
    backend["name"] = "gloo"
    assert loss.comm_device() == torch.device("cpu")
    # the buffer of reduce([]) is allocated on that device: "meta" stands in for cuda here
    seen = []
    monkeypatch.setattr(loss, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(loss, "comm_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: seen.append(tensor.device))
    loss.MaskedTokenLossReduction().reduce([])
    assert seen == [torch.device("meta")], seen


def test_no_sync_defer_values_single_process():
    """A bad ``defer`` is a ValueError naming it, raised on entering, before anything changes;
    a plain module accepts both good values (nothing to defer)."""
    from zeta_fsdp.costs import accumulation_costs
    from zeta_fsdp.training import memory_report, no_sync

    net = torch.nn.Linear(2, 2)
    for bad in ("replicas", "ALL REDUCE", None, 1):
        with pytest.raises(ValueError, match=r"defer=.*not accepted. Accepted: 'all'.*'all_reduce'") as info:
            with no_sync(net, defer=bad):
                raise AssertionError("entered")
        assert repr(bad) in str(info.value)
    for good in ("all", "all_reduce", "All_Reduce"):
        with no_sync(net, defer=good):
            net(torch.ones(1, 2)).sum().backward()
    with pytest.raises(ValueError, match="micro_batches=0 is not accepted"):
        accumulation_costs(0, sharded=1, unsharded=1, partial=1, reduce_scatter_units=1, all_reduce_units=1)
    report = memory_report(net, micro_batches=2)
    assert {c.grad_bytes for c in report["accumulation"].values()} == {24}  # whole gradients, no collective
    assert 'no_sync(defer="all_reduce")' in report.table()
