"""Trust the user's model: named and structurally detected blocks are units whatever their forward's
source looks like; only evidence (experts, a call under a condition on the data, a random skip,
LayerDrop) keeps a block out or refuses it. Multi-rank: ``trust_cases.py`` (parity of the trusted
patterns, the run-time divergence check, LayerDrop refused on every rank)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import dist_test
from trust_models import (
    TRUSTED,
    Block,
    DropByMethod,
    OptionalTower,
    Plain,
    RandomSubset,
    SkipSome,
    StochasticDepth,
    lm_loss,
)
from worker import expect_error

from zeta_fsdp import fsdp
from zeta_fsdp.divergence import DEFAULT_FORWARDS, ENV, resolve_forwards
from zeta_fsdp.wrapping import build_wrap_plan

test_two_ranks = dist_test("trust_cases.py", 2)
test_four_ranks = dist_test("trust_cases.py", 4)

BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


@pytest.mark.parametrize("make", list(TRUSTED.values()), ids=list(TRUSTED))
def test_blocks_are_units_however_the_forward_reaches_them(make):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "found no repeated block" fallback to one unit
        detected = build_wrap_plan(make(), auto_wrap=True)
        named = build_wrap_plan(make(), auto_wrap=True, transformer_block=Block)
        by_name = build_wrap_plan(make(), auto_wrap=True, transformer_block="Block")
    for plan in (detected, named, by_name):
        assert [u.name for u in plan.blocks] == BLOCKS, plan.table()
        assert plan.skippable == {}, plan.skippable


def test_a_setting_that_skips_blocks_is_no_evidence():
    # `if i not in self.skip`: a setting, not the data; the run-time check covers a per-rank setting
    assert [u.name for u in build_wrap_plan(SkipSome(), auto_wrap=True).blocks] == BLOCKS


def test_an_optional_tower_and_random_skips_are_evidence():
    plan = build_wrap_plan(OptionalTower(), auto_wrap=True)
    assert [u.name for u in plan.blocks] == BLOCKS, plan.table()  # the tower's Blocks are not units
    assert plan.skippable == {"tower": "OptionalTower.forward runs it under `image is not None`"}
    expect_error(
        ValueError,
        lambda: build_wrap_plan(OptionalTower(), auto_wrap=True, transformer_block=Block),
        "TransformerBlock makes tower.0 an FSDP unit",
        "OptionalTower.forward runs it under `image is not None`",
    )
    with pytest.warns(UserWarning, match="ONE FSDP unit"):  # the stack's blocks are its only repeats
        dropped = build_wrap_plan(StochasticDepth(), auto_wrap=True)
    assert dropped.blocks == [] and "torch.rand" in dropped.table(), dropped.table()
    model = StochasticDepth()
    before = {n: p.clone() for n, p in model.named_parameters()}
    expect_error(
        ValueError,
        lambda: fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD", TransformerBlock=Block),
        "blocks.0",
        "after `if self.training and torch.rand(()) < 0.5: continue`",
    )
    assert not dist.is_initialized()  # refused before a process group
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("make", [RandomSubset, DropByMethod], ids=["randperm", "a-method-that-draws"])
def test_random_skips_read_anywhere_are_evidence(make):
    with pytest.warns(UserWarning, match="ONE FSDP unit"):
        assert build_wrap_plan(make(), auto_wrap=True).blocks == []
    expect_error(ValueError, lambda: build_wrap_plan(make(), auto_wrap=True, transformer_block=Block), "blocks.")


def _opt(**kw):
    transformers = pytest.importorskip("transformers")
    cfg = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2)
    cfg.update(max_position_embeddings=32, word_embed_proj_dim=16, **kw)
    return transformers.OPTForCausalLM(transformers.OPTConfig(**cfg))


def test_layerdrop_is_refused_naming_every_setting_and_the_way_out():
    model = _opt(layerdrop=0.5)
    before = {n: p.clone() for n, p in model.named_parameters()}
    expect_error(
        ValueError,
        lambda: fsdp(model, auto_wrap=True, shard_strat="FULL_SHARD"),
        "config.layerdrop=0.5",
        "model.decoder.layerdrop=0.5",  # OPT copies it at construction: config alone would not turn it off
        "layerdrop=0.0",
        "auto_wrap=False",
    )
    assert not dist.is_initialized()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert [u.kind for u in build_wrap_plan(_opt(layerdrop=0.0), auto_wrap=True).blocks] == ["block", "block"]
    assert [u.kind for u in build_wrap_plan(model, auto_wrap=False).units] == ["root"]  # one unit: no skip


def shared_step(module: nn.Module, batch) -> torch.Tensor:
    """A module-level training-step helper, as Lightning projects share one between modules."""
    x, y = batch
    return lm_loss(module(x), y)


def test_lightning_modules_get_one_unit_per_block():
    pl = pytest.importorskip("lightning.pytorch")

    class Shared(pl.LightningModule):
        """Borrows a plain module's forward; training_step goes through helper methods."""

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 8)
            self.blocks = nn.ModuleList(Block() for _ in range(4))
            self.head = nn.Linear(8, 32)

        forward = Plain.forward

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def _loss(self, batch):
            return shared_step(self, batch)  # self handed to a helper: no longer a reason to refuse

    class Holder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = Plain()

        def training_step(self, batch, batch_idx):
            return shared_step(self.model, batch)

    assert [u.name for u in build_wrap_plan(Shared(), auto_wrap=True).blocks] == BLOCKS
    assert [u.name for u in build_wrap_plan(Holder(), auto_wrap=True).blocks] == [f"model.{b}" for b in BLOCKS]


def test_divergence_check_option_and_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert resolve_forwards(None) == DEFAULT_FORWARDS
    assert (resolve_forwards(True), resolve_forwards(False), resolve_forwards(0), resolve_forwards(7)) == (
        None,
        0,
        0,
        7,
    )
    for text, want in (("always", None), ("off", 0), ("12", 12)):
        monkeypatch.setenv(ENV, text)
        assert resolve_forwards(None) == want
    assert resolve_forwards(3) == 3  # the keyword wins over the environment
    monkeypatch.setenv(ENV, "sometimes")
    expect_error(ValueError, lambda: resolve_forwards(None), "ZETA_FSDP_DIVERGENCE_CHECK='sometimes'", "'always'")
    monkeypatch.delenv(ENV)
    for bad in (-1, 2.5, "on"):
        expect_error(ValueError, lambda bad=bad: fsdp(Plain(), divergence_check=bad), f"divergence_check={bad!r}")
    assert not dist.is_initialized()
