"""Block detection and parity on timm's own model code (no downloads).

timm imports torchvision; the torchvision wheel on the registry is a CUDA build that fails beside
a ``+cpu`` torch (and breaks ``import transformers`` with it), so this file runs in the CI
environment where a matching torchvision is installed, and skips as a whole elsewhere.
"""

from __future__ import annotations

import warnings

import pytest
from conftest import dist_test

pytest.importorskip("torchvision")
pytest.importorskip("timm")

import torch  # noqa: E402
from timm_models import PLANS, TINY, build  # noqa: E402

from zeta_fsdp.wrapping import build_wrap_plan  # noqa: E402


@pytest.mark.parametrize("name", list(PLANS))
def test_default_configs_are_wrapped_per_innermost_block(name):
    blocks, stage = PLANS[name]
    with torch.device("meta"):  # the real sizes, nothing allocated
        model = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "found nothing" warning
        plan = build_wrap_plan(model, auto_wrap=True)
    assert {c.__name__ for c in plan.block_classes} == blocks
    assert all(c is not torch.nn.Sequential for c in plan.block_classes)
    chosen = [u for u in plan.units if u.kind == "block"]
    assert chosen and all(type(u.modules[0]).__name__ in blocks for u in chosen)
    assert not any(type(m).__name__ == stage for u in plan.units for m in u.modules), "a stage became a unit"
    if stage:
        assert any(stage in n for n in plan.notes), plan.notes
    # the largest unit and its share, as the table shows them
    largest = max(plan.units, key=lambda u: u.numel)
    share = largest.numel / sum(p.numel() for p in model.parameters())
    assert plan.largest is largest and abs(plan.share(largest) - share) < 1e-12
    assert f"largest unit: {largest.name} ({largest.kind}), {100 * share:.1f}%" in plan.table()


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_configs_get_the_units(name):
    plan = build_wrap_plan(TINY[name].build(), auto_wrap=True)
    assert [u.name for u in plan.units] == TINY[name].units


test_timm_parity = dist_test("timm_cases.py", 2)
